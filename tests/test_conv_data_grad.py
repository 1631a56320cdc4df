"""A Conv's data gradient in bf16/fp16 by cuDNN (runtime/gpu/conv_data_grad.py).

CPU: the rewrite takes each bf16/fp16 ConvTranspose that cuDNN's backward-data computes (group 1,
two spatial axes, symmetric pads, no bias, no output_shape) and leaves the rest, float32 ones
included; the fused node carries the ConvTranspose as its function; on the bf16 CNN's step graph it
takes every data gradient, and the nodes keep static bf16 types (what in_session.py needs).
GPU (marked ``gpu``): the node's dX is the exact (float64) ConvTranspose of the rounded inputs
rounded once, within half a spacing plus float32 summation error, first call and a bound run.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from conftest import first_and_bound_run, spacing
from onnx import TensorProto, helper

from commands.main import main
from runtime.gpu import cuda_available, gpu_count
from runtime.gpu.conv_data_grad import DOMAIN, ConvDataGradRunner, fuse_conv_data_grads
from runtime.segments import NativeGroup
from runtime.specialize import specialize, static_values

# (dY shape, W shape, strides, pads (begin = end), output_padding): ResNet's 3x3 same, 3x3 stride 2,
# 1x1 stride 2 shortcut; a dilated rectangular one.
CASES = [((4, 8, 6, 6), (8, 5, 3, 3), [1, 1], [1, 1], [0, 0], [1, 1]),
         ((4, 8, 4, 4), (8, 5, 3, 3), [2, 2], [1, 1], [1, 1], [1, 1]),
         ((4, 8, 4, 4), (8, 5, 1, 1), [2, 2], [0, 0], [1, 1], [1, 1]),
         ((2, 6, 5, 4), (6, 3, 3, 2), [1, 2], [2, 1], [0, 1], [2, 1])]


def _model(elem: int, **changes) -> onnx.ModelProto:
    attrs = {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1], "dilations": [1, 1], "group": 1,
             **changes}
    attrs = {k: v for k, v in attrs.items() if v is not None}
    node = helper.make_node("ConvTranspose", ["dy", "w"], ["dx"], name="conv/grad", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("dy", elem, [2, 4, 4, 4]),
                                            helper.make_tensor_value_info("w", elem, [4, 3, 3, 3])],
                              [helper.make_tensor_value_info("dx", elem, [2, 3, 8, 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)], ir_version=10)


def test_a_bf16_conv_transpose_becomes_the_node_with_its_function():
    fused = fuse_conv_data_grads(_model(TensorProto.BFLOAT16))
    (node,) = fused.graph.node
    assert node.domain == DOMAIN and list(node.input) == ["dy", "w"] and list(node.output) == ["dx"]
    attrs = {a.name: list(a.ints) for a in node.attribute}
    assert attrs == {"strides": [2, 2], "dilations": [1, 1], "pads": [1, 1], "output_padding": [1, 1]}
    (function,) = [f for f in fused.functions if f.name == node.op_type]
    assert [n.op_type for n in function.node] == ["ConvTranspose"]
    onnx.checker.check_model(fused)


@pytest.mark.parametrize("case", ["float32", "asymmetric pads", "group 2", "output_shape", "bias"])
def test_what_backward_data_does_not_compute_is_left_alone(case):
    model = {"float32": lambda: _model(TensorProto.FLOAT),
             "asymmetric pads": lambda: _model(TensorProto.BFLOAT16, pads=[1, 1, 0, 0]),
             "group 2": lambda: _model(TensorProto.BFLOAT16, group=2),
             "output_shape": lambda: _model(TensorProto.BFLOAT16, output_shape=[8, 8], output_padding=None),
             "bias": lambda: _model(TensorProto.BFLOAT16)}[case]()
    if case == "bias":
        model.graph.node[0].input.append("b")
    assert fuse_conv_data_grads(model).graph.node[0].op_type == "ConvTranspose"


def test_the_bf16_cnn_step_takes_every_data_gradient(model_dir, tmp_path):
    out = tmp_path / "cnn"
    assert main(["compile", str(model_dir("cnn_small") / "model.onnx"), "--gpus", "1", "--precision", "bf16",
                 "-o", str(out)]) == 0
    step = onnx.load(str(out / "rank0.onnx"))
    transposes = sum(n.op_type == "ConvTranspose" for n in step.graph.node)
    step = fuse_conv_data_grads(specialize(step, {"images": (8, 3, 16, 16), "labels": (8,)}))
    fused = [n for n in step.graph.node if n.domain == DOMAIN]
    assert transposes > 0 and len(fused) == transposes
    known = static_values(step.graph)
    assert all(known[name][1] == TensorProto.BFLOAT16 for n in fused for name in [*n.input, *n.output])


def _node(strides, pads, extra, dilations) -> onnx.NodeProto:
    return helper.make_node("ConvDataGrad_0", ["dy", "w"], ["dx"], name="dgrad", domain=DOMAIN, strides=strides,
                            pads=pads, output_padding=extra, dilations=dilations)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1 or not cuda_available(), reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_low_precision_data_gradient_is_the_exact_one_rounded_once(case, dtype):
    import cupy as cp

    from runtime.gpu.device import GpuDevice

    dy_shape, w_shape, strides, pads, extra, dilations = CASES[case]
    low, view, mantissa = {"bfloat16": (ml_dtypes.bfloat16, np.uint16, 7), "float16": (np.float16, np.float16, 10)}[dtype]
    rng = np.random.default_rng(case)
    dy, w = (rng.normal(size=s).astype(low).astype(np.float64) for s in (dy_shape, w_shape))

    def transpose(a, b):
        return torch.nn.functional.conv_transpose2d(torch.tensor(a), torch.tensor(b), stride=strides, padding=pads,
                                                    output_padding=extra, dilation=dilations).numpy()

    exact, scale = transpose(dy, w), transpose(np.abs(dy), np.abs(w))
    step = spacing(exact, mantissa)

    def check(raw) -> None:
        dx = cp.asnumpy(raw).view(low).astype(np.float64)
        assert raw.dtype == view and dx.shape == exact.shape
        assert np.all(np.abs(dx - exact) <= 0.5 * step + 1e-5 * scale), float(np.max(np.abs(dx - exact) / step))

    device = GpuDevice(0, tf32=False)
    runner = ConvDataGradRunner(NativeGroup(0, 0, 1, (_node(strides, pads, extra, dilations),), ("dy", "w"), ("dx",)),
                                "test", device)
    feeds = {"dy": cp.asarray(dy.astype(low).view(view)), "w": cp.asarray(w.astype(low).view(view))}
    for result in first_and_bound_run(runner, feeds, device):
        check(result)
