"""The loss and its gradient as one node on the GPU (runtime/gpu/cross_entropy.py).

CPU: the rewrite of a transpiled step graph (the built-in GPT, fp32 and bf16) fuses the
SoftmaxCrossEntropyLoss node, its SoftmaxCrossEntropyGrad node and, under bf16, the casts around
them into one node, whose function computes what the replaced nodes computed, bit for bit (plain
onnxruntime runs both graphs); a pair whose log_prob someone else reads is left alone.
GPU (marked ``gpu``): the kernels equal a float64 NumPy reference of the contract for float32 and
bfloat16 scores and gradients, int32 and int64 labels and ignored rows, bit-identical from run to run.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import with_a_body_reading
from onnx import TensorProto, helper

from commands.main import main
from contract.ops import CROSS_ENTROPY_GRAD, LOSS_DOMAIN
from runtime.gpu import cuda_available, gpu_count
from runtime.gpu.cross_entropy import DOMAIN, CrossEntropyRunner, fuse_cross_entropy
from runtime.gpu.elementwise_steps import round_bf16_numpy, widen_bf16_numpy
from runtime.segments import NativeGroup


def _step_graph(model_dir, tmp_path, precision: str) -> onnx.ModelProto:
    out = tmp_path / precision
    assert main(["compile", str(model_dir("gpt") / "model.onnx"), "--gpus", "1", "--precision", precision,
                 "--optimizer", "adamw", "-o", str(out)]) == 0
    return onnx.load(str(out / "rank0.onnx"))


def _loss_part(model: onnx.ModelProto, scores: str, labels: str, loss: str, dscores: str) -> onnx.ModelProto:
    """The nodes between (scores, labels) and (loss, dscores), with the model's functions; bfloat16
    scores and gradients are fed and read as float32 (onnxruntime's Python API takes no bfloat16)
    through a Cast each, outside what the rewrite may fuse."""
    part = onnx.utils.Extractor(onnx.shape_inference.infer_shapes(model)).extract_model([scores, labels], [loss, dscores])
    have = {(f.domain, f.name) for f in part.functions}
    part.functions.extend(f for f in model.functions if (f.domain, f.name) not in have)
    part.opset_import.extend(o for o in model.opset_import if o.domain not in {p.domain for p in part.opset_import})
    graph = part.graph
    for is_input, values in ((True, graph.input), (False, graph.output)):
        for value in values:
            if value.type.tensor_type.elem_type != TensorProto.BFLOAT16:
                continue
            value.type.tensor_type.elem_type = TensorProto.FLOAT
            if is_input:
                graph.node.insert(0, helper.make_node("Cast", [value.name + ".f32"], [value.name], to=TensorProto.BFLOAT16))
            else:
                graph.node.append(helper.make_node("Cast", [value.name], [value.name + ".f32"], to=TensorProto.FLOAT))
            value.name += ".f32"
    return part


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Normal scores (float32, of bfloat16 values where the graph rounds them), labels in range
    with one ignored."""
    rng = np.random.default_rng(3)
    scores, labels = model.graph.input
    shape = [d.dim_value or 6 for d in scores.type.tensor_type.shape.dim]  # rows may be named
    x = widen_bf16_numpy(round_bf16_numpy((rng.standard_normal(shape) * 3).astype(np.float32)))
    y = rng.integers(0, shape[1], shape[0]).astype(helper.tensor_dtype_to_np_dtype(labels.type.tensor_type.elem_type))
    y[1] = -100
    return {scores.name: x, labels.name: y}


def _run(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _ops(model: onnx.ModelProto) -> list[tuple[str, str]]:
    return [(n.domain, n.op_type) for n in model.graph.node]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_fused_node_computes_what_the_pair_computed(model_dir, tmp_path, precision):
    original = _step_graph(model_dir, tmp_path, precision)
    fused = onnx.ModelProto()
    fused.CopyFrom(original)
    fuse_cross_entropy(fused)
    ops = _ops(fused)
    assert [op for op in ops if op[0] == DOMAIN] == [(DOMAIN, "SoftmaxCrossEntropy_0")]
    assert ("", "SoftmaxCrossEntropyLoss") not in ops and (LOSS_DOMAIN, CROSS_ENTROPY_GRAD) not in ops
    # bf16: the scores' widening and the gradient's rounding joined the node.
    casts = lambda m: sum(op == ("", "Cast") for op in _ops(m))  # noqa: E731
    assert casts(original) - casts(fused) == (2 if precision == "bf16" else 0)
    node = next(n for n in fused.graph.node if n.domain == DOMAIN)
    types = {v.name: v.type.tensor_type.elem_type for v in onnx.shape_inference.infer_shapes(original).graph.value_info}
    want = TensorProto.BFLOAT16 if precision == "bf16" else TensorProto.FLOAT
    assert types[node.input[0]] == want and types[node.output[1]] == want
    # The loss and its gradient of the graph before and after the rewrite, on onnxruntime's CPU
    # provider (which runs the fused node's function).
    part = _loss_part(original, *node.input[:2], *node.output)
    feeds = _feeds(part)
    fused_part = fuse_cross_entropy(_loss_part(original, *node.input[:2], *node.output))
    assert [op for op in _ops(fused_part) if op[0] == DOMAIN] == [(DOMAIN, "SoftmaxCrossEntropy_0")]
    expected = _run(part, feeds)
    assert np.isfinite(expected[0]) and np.asarray(expected[1]).any()
    for got, want in zip(_run(fused_part, feeds), expected, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("reader", ["graph output", "subgraph"])
def test_a_pair_whose_log_prob_is_read_elsewhere_is_left(model_dir, tmp_path, reader):
    model = _step_graph(model_dir, tmp_path, "fp32")
    forward = next(n for n in model.graph.node if n.op_type == "SoftmaxCrossEntropyLoss")
    if reader == "subgraph":
        model = with_a_body_reading(model, forward.output[1])
    else:
        model.graph.output.append(helper.make_tensor_value_info(forward.output[1], TensorProto.FLOAT, None))
    before = _ops(model)
    assert _ops(fuse_cross_entropy(model)) == before


# -- the kernels -----------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(gpu_count() < 1 or not cuda_available(), reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")
IGNORE = -100


def _reference(scores: np.ndarray, labels: np.ndarray, dloss: float) -> tuple[float, np.ndarray]:
    """The contract in float64: the mean loss over the rows not ignored and its gradient."""
    x = scores.astype(np.float64)
    lse = np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)) + x.max(axis=1, keepdims=True)
    weight = (labels != IGNORE).astype(np.float64)
    safe = np.where(labels == IGNORE, 0, labels)
    rows = np.arange(len(labels))
    loss = float(((lse[:, 0] - x[rows, safe]) * weight).sum() / weight.sum())
    grad = np.exp(x - lse)
    grad[rows, safe] -= 1
    return loss, grad * (dloss * weight / weight.sum())[:, None]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("rows", "classes", "dtype", "label_dtype"),
                         # classes a multiple of 8 take 16-byte loads (GPT-2-small's padded vocabulary), others one at a time
                         [(64, 50257, "float32", np.int64), (64, 50304, "float32", np.int64),
                          (16, 50304, "bfloat16", np.int64), (33, 1000, "bfloat16", np.int32),
                          (7, 1001, "bfloat16", np.int32), (5, 3, "bfloat16", np.int64)])
def test_the_kernels_equal_the_contract(rows, classes, dtype, label_dtype):
    import cupy as cp

    from runtime.gpu.device import GpuDevice

    rng = np.random.default_rng(7)
    scores = (rng.standard_normal((rows, classes)) * 3).astype(np.float32)
    labels = rng.integers(0, classes, rows).astype(label_dtype)
    labels[1] = IGNORE
    labels[2] = 0
    scores[2, 1:9] = -np.inf  # masked classes: no weight in the sum, a gradient of 0
    bf16 = dtype == "bfloat16"
    if bf16:
        scores = widen_bf16_numpy(round_bf16_numpy(scores))
    loss, grad = _reference(scores, labels, 0.5)
    node = helper.make_node("SoftmaxCrossEntropy_0", ["s", "y", "d"], ["loss", "ds"], domain=DOMAIN, ignore_index=IGNORE)
    device = GpuDevice(0, tf32=False)
    runner = CrossEntropyRunner(NativeGroup(0, 0, 3, (node,), ("s", "y", "d"), ("loss", "ds")), "test", device)
    env = {"s": cp.asarray(round_bf16_numpy(scores) if bf16 else scores), "y": cp.asarray(labels),
           "d": cp.asarray(np.array(0.5, np.float32))}
    results = []
    for _ in range(2):
        outs = {"loss": cp.full((), np.nan, np.float32), "ds": cp.zeros((rows, classes), env["s"].dtype)}
        runner.launch({**env, **outs}, allocate=not results)
        device.compute.synchronize()
        results.append({k: cp.asnumpy(v) for k, v in outs.items()})
    got = results[0]["ds"]
    got = widen_bf16_numpy(got) if bf16 else got
    np.testing.assert_allclose(float(results[0]["loss"]), loss, rtol=1e-5)
    # bf16 gradients: one rounding (2^-8 relative) of each element.
    np.testing.assert_allclose(got, grad, rtol=2 ** -8 if bf16 else 1e-5, atol=1e-9)
    assert not got[1].any()  # the ignored row
    for name in ("loss", "ds"):
        np.testing.assert_array_equal(results[0][name], results[1][name])
