"""Elementwise fusion with bfloat16 edges (--precision bf16; runtime/gpu/elementwise_steps.py): a
chain's casts from and to bfloat16 join it, so the fused node reads and writes bfloat16 itself,
and computes exactly what the graph's casts and float32 nodes compute. Checked on CPU against
onnxruntime (whose CPU provider has bf16 Cast and Transpose, not bf16 arithmetic) through the
NumPy form, and through the fused node's ONNX function; on a GPU, the CuPy kernel against the
NumPy form, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import one_graph_model
from onnx import TensorProto, helper

from runtime.gpu.elementwise_fusion import fuse_elementwise
from runtime.gpu.elementwise_steps import (
    DOMAIN,
    ROUND,
    WIDEN,
    evaluate_numpy,
    fused_steps,
    fused_types,
    round_bf16_numpy,
    widen_bf16_numpy,
)

F, B = TensorProto.FLOAT, TensorProto.BFLOAT16


def _model() -> onnx.ModelProto:
    """x (float) -> bf16 -> Transpose (a bf16 value no chain makes) -> [to float, *x, + b, to bf16]
    -> Transpose -> float: a bias-add-and-activation chain between two bf16 producers/readers,
    as a bf16 MatMul's output feeds one and the next MatMul reads its result."""
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=B),
             helper.make_node("Transpose", ["xb"], ["a"], perm=[1, 0]),
             helper.make_node("Cast", ["a"], ["af"], to=F),
             helper.make_node("Mul", ["af", "af"], ["sq"]),
             helper.make_node("Add", ["sq", "b"], ["s"]),
             helper.make_node("Cast", ["s"], ["sb"], to=B),
             helper.make_node("Transpose", ["sb"], ["tb"], perm=[1, 0]),
             helper.make_node("Cast", ["tb"], ["y"], to=F)]
    inputs = [helper.make_tensor_value_info("x", F, ["n", 64]), helper.make_tensor_value_info("b", F, ["n"])]
    return one_graph_model(nodes, inputs, [helper.make_tensor_value_info("y", F, [64, "n"])])


def _feeds(rows: int = 37) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 64)).astype(np.float32) * np.float32(3)
    x[0, :4] = [np.inf, -np.inf, np.nan, 1.00390625]  # a tie rounds to even (1.0039 = 1 + 2^-8)
    return {"x": x, "b": rng.normal(size=rows).astype(np.float32)}


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_the_casts_join_the_chain_which_reads_and_writes_bfloat16():
    fused = fuse_elementwise(_model(), bfloat16=True)
    (node,) = [n for n in fused.graph.node if n.domain == DOMAIN]
    assert list(node.input) == ["a", "b"] and list(node.output) == ["sb"]
    assert fused_types(node) == ([B, F], [B])
    assert [op for op, _ in fused_steps(node)[0]] == [WIDEN, "Mul", "Add", ROUND]
    # The casts outside (each alone on its side of a Transpose) stay onnxruntime's.
    assert [n.op_type for n in fused.graph.node if n.domain != DOMAIN] == ["Cast", "Transpose", "Transpose", "Cast"]
    # Without bfloat16, the casts stay and only the float32 pair fuses.
    (plain,) = [n for n in fuse_elementwise(_model()).graph.node if n.domain == DOMAIN]
    assert fused_types(plain) == ([F, F], [F]) and list(plain.input) == ["af", "b"]


def test_the_fused_node_computes_what_the_casts_and_float32_nodes_computed():
    model, feeds = _model(), _feeds()
    fused = fuse_elementwise(model, bfloat16=True)
    (node,) = [n for n in fused.graph.node if n.domain == DOMAIN]
    expected = _run(model, feeds)
    # The NumPy form, from x's bf16 bits (rounded to nearest even by round_bf16_numpy, as
    # onnxruntime's Cast rounds), equals onnxruntime's values bit for bit (NaN where NaN).
    a = round_bf16_numpy(feeds["x"]).T.copy()
    (sb,) = evaluate_numpy(node, [a, feeds["b"]])
    got = (sb.astype(np.uint32) << 16).view(np.float32).T
    np.testing.assert_array_equal(got, expected)
    # onnxruntime running the fused node as its function (Casts and the float32 steps): the same.
    np.testing.assert_array_equal(_run(fused, feeds), expected)


@pytest.mark.gpu
def test_the_cupy_kernel_equals_the_numpy_form_bit_for_bit():
    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception:
        pytest.skip("no CUDA device")
    from runtime.gpu.elementwise import ElementwiseRunner
    from runtime.segments import NativeGroup

    feeds = _feeds()
    (node,) = [n for n in fuse_elementwise(_model(), bfloat16=True).graph.node if n.domain == DOMAIN]

    class _Backend:
        compute = cp.cuda.Stream()

    _Backend.cp = cp
    inputs = [round_bf16_numpy(feeds["x"]).T.copy(), feeds["b"]]
    group = NativeGroup(0, 0, 1, (node,), tuple(node.input), tuple(node.output))
    (got,) = ElementwiseRunner(group, "test", _Backend).run({n: cp.asarray(v) for n, v in zip(node.input, inputs)})
    assert got.dtype == np.uint16
    got, expected = cp.asnumpy(got), evaluate_numpy(node, inputs)[0]
    # Bit for bit but for NaN's payload: the GPU's NaN * NaN is 0x7fffffff, NumPy's 0x7fc00000
    # (one H200); either is bfloat16's NaN after rounding.
    nan = np.isnan(widen_bf16_numpy(expected))
    assert nan.any() and np.array_equal(nan, np.isnan(widen_bf16_numpy(got)))
    np.testing.assert_array_equal(got[~nan], expected[~nan])
