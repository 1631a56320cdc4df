"""The parameters' casts to bfloat16 in one node (runtime/gpu/parameter_casts.py).

CPU: on the bf16 GPT's step graph the rewrite leaves no Cast of a graph input and makes one node
of them all; a rewritten graph computes what the original did, bit for bit (plain onnxruntime runs
the node's function), for values that round up, down, to even, overflow and NaN; casts of other
values, and to other types, are left alone; groups stay within CUDA's kernel arguments.
GPU (marked ``gpu``): the kernel equals NumPy's rounding (elementwise_steps.round_bf16_numpy) bit
for bit, across chunk edges, on sizes no multiple of 4 and on a misaligned view.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from commands.main import main
from runtime.gpu import cuda_available, gpu_count
from runtime.gpu.elementwise_steps import round_bf16_numpy
from runtime.gpu.parameter_casts import CHUNK, DOMAIN, MOST, ParameterCastRunner, batch_parameter_casts
from runtime.segments import NativeGroup


def _model(count: int) -> onnx.ModelProto:
    """Inputs p0.. cast to bf16 and back (onnxruntime's Python API reads no bfloat16), an activation
    x cast to bf16 (not a graph input's cast: left alone) and p0 cast to float16 (another type)."""
    nodes, inputs, outputs = [], [], []
    for i in range(count):
        inputs.append(helper.make_tensor_value_info(f"p{i}", TensorProto.FLOAT, [5 + i]))
        nodes += [helper.make_node("Cast", [f"p{i}"], [f"b{i}"], to=TensorProto.BFLOAT16),
                  helper.make_node("Cast", [f"b{i}"], [f"y{i}"], to=TensorProto.FLOAT)]
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [5 + i]))
    inputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [5]))
    nodes += [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Cast", ["r"], ["rb"], to=TensorProto.BFLOAT16),
              helper.make_node("Cast", ["rb"], ["ry"], to=TensorProto.FLOAT),
              helper.make_node("Cast", ["p0"], ["h"], to=TensorProto.FLOAT16)]
    outputs += [helper.make_tensor_value_info("ry", TensorProto.FLOAT, [5]),
                helper.make_tensor_value_info("h", TensorProto.FLOAT16, [5])]
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _values(size: int, rng) -> np.ndarray:
    special = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, 3.4e38, -np.inf, np.nan, -0.0], np.float32)
    return np.concatenate([special, rng.standard_normal(size).astype(np.float32)])[:size]


def test_the_rewrite_computes_what_the_casts_computed():
    rng = np.random.default_rng(0)
    feeds = {f"p{i}": _values(5 + i, rng) for i in range(3)} | {"x": _values(5, rng)}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)  # noqa: E731
    expected = run(_model(3))
    fused = batch_parameter_casts(_model(3))
    onnx.checker.check_model(fused)
    ours = [n for n in fused.graph.node if n.domain == DOMAIN]
    assert len(ours) == 1 and list(ours[0].input) == ["p0", "p1", "p2"]
    assert sum(n.op_type == "Cast" for n in fused.graph.node) == 3 + 3  # the back-casts, x's pair, p0's float16
    for got, want in zip(run(fused), expected):
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_groups_stay_within_the_kernel_arguments():
    fused = batch_parameter_casts(_model(MOST + 3))
    assert [len(n.input) for n in fused.graph.node if n.domain == DOMAIN] == [MOST, 3]
    assert len({n.op_type for n in fused.graph.node if n.domain == DOMAIN}) == 2


def test_the_bf16_gpt_step_casts_its_parameters_in_one_node(model_dir, tmp_path):
    out = tmp_path / "gpt"
    assert main(["compile", str(model_dir("gpt") / "model.onnx"), "--gpus", "1", "--precision", "bf16", "-o", str(out)]) == 0
    step = onnx.load(str(out / "rank0.onnx"))
    inputs = {i.name for i in step.graph.input}
    before = sum(n.op_type == "Cast" and n.input[0] in inputs for n in step.graph.node)
    step = batch_parameter_casts(step)
    assert before > 2 and not any(n.op_type == "Cast" and n.input[0] in inputs for n in step.graph.node)
    (node,) = [n for n in step.graph.node if n.domain == DOMAIN]
    assert len(node.input) == before


needs_gpu = pytest.mark.skipif(gpu_count() < 1 or not cuda_available(), reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")


@pytest.mark.gpu
@needs_gpu
def test_the_kernel_rounds_as_numpy_does():
    import cupy as cp

    from runtime.gpu.device import GpuDevice

    rng = np.random.default_rng(1)
    sizes = [3, 2 * CHUNK + 5, 4 * CHUNK, 77]
    host = [_values(n, rng) for n in sizes]
    base = cp.asarray(np.concatenate([np.zeros(1, np.float32), host[3]]))
    names = [f"p{i}" for i in range(len(sizes))]
    node = helper.make_node("CastParameters_0", names, [f"c{i}" for i in range(len(sizes))], domain=DOMAIN)
    device = GpuDevice(0, tf32=False)
    runner = ParameterCastRunner(NativeGroup(0, 0, 1, (node,), tuple(names), tuple(node.output)), "test", device)
    values = {name: cp.asarray(h) for name, h in zip(names, host)}
    values["p3"] = base[1:]  # 4 bytes past an aligned start: the one-at-a-time path
    for call in range(2):  # the first call (allocate), then again into the same outputs
        runner.launch(values, allocate=call == 0)
        device.compute.synchronize()
        for i, h in enumerate(host):
            np.testing.assert_array_equal(cp.asnumpy(values[f"c{i}"]), round_bf16_numpy(h), err_msg=f"c{i}")
