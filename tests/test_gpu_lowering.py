"""runtime/gpu/lowering.py on CPU: a per-channel reduction over (0, 2, 3) becomes two reductions
with the same values (to float32 summation order), in every opset form; others are left alone. A
causally masked softmax becomes BiasSoftmax (checked against its documented semantics) and its
backward Where goes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import one_graph_model
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from runtime.gpu.elementwise_steps import round_bf16_numpy
from runtime.gpu.lowering import lower_for_cuda
from runtime.specialize import specialize


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _reduction(op: str, opset: int, axes: list[int], keepdims: int) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 4, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = []
    if (op == "ReduceSum" and opset >= 13) or (op == "ReduceMean" and opset >= 18):
        node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims)
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
    else:
        node = helper.make_node(op, ["x"], ["y"], axes=axes, keepdims=keepdims)
    model = helper.make_model(helper.make_graph([node], "g", [x], [y], inits), opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean"])
@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [[0, 2, 3], [0, -1], [-4, 2]])
def test_a_channel_reduction_becomes_two_with_the_same_values(op, opset, keepdims, axes):
    model = _reduction(op, opset, axes, keepdims)
    feeds = {"x": np.random.default_rng(0).normal(size=(6, 3, 4, 5)).astype(np.float32)}
    lowered = lower_for_cuda(specialize(model, {"x": (6, 3, 4, 5)}))
    assert [n.op_type for n in lowered.graph.node] == [op, op]
    onnx.checker.check_model(lowered)
    expected, got = _run(model, feeds)[0], _run(lowered, feeds)[0]
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axes", [[1], [0], [2, 3], [0, 1, 2, 3], [0, 1]])
def test_reductions_that_keep_no_channel_or_reduce_one_block_are_left_alone(axes):
    model = _reduction("ReduceSum", 18, axes, 1)
    lowered = lower_for_cuda(specialize(model, {"x": (6, 3, 4, 5)}))
    assert [n.op_type for n in lowered.graph.node] == ["ReduceSum"]


def test_axes_from_a_constant_node_as_the_transpiler_writes_them():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 4, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([0, 2, 3], np.int64))),
             helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=1)]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    lowered = lower_for_cuda(specialize(model, {"x": (6, 3, 4, 5)}))
    assert [n.op_type for n in lowered.graph.node].count("ReduceMean") == 2
    feeds = {"x": np.random.default_rng(1).normal(size=(6, 3, 4, 5)).astype(np.float32)}
    np.testing.assert_allclose(_run(lowered, feeds)[0], _run(model, feeds)[0], rtol=1e-5, atol=1e-6)


def test_a_reduction_over_no_axis_that_is_a_no_op_becomes_an_identity():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1, noop_with_empty_axes=1)
    empty = numpy_helper.from_array(np.zeros((0,), np.int64), "axes")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y], [empty]), opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    lowered = lower_for_cuda(specialize(model, {"x": (2, 3)}))
    assert [n.op_type for n in lowered.graph.node] == ["Identity"]
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    np.testing.assert_array_equal(_run(lowered, feeds)[0], feeds["x"])
    # Without noop_with_empty_axes, empty axes mean every axis: left alone.
    attrs = model.graph.node[0].attribute
    del attrs[[a.name for a in attrs].index("noop_with_empty_axes")]
    assert [n.op_type for n in lower_for_cuda(specialize(model, {"x": (2, 3)})).graph.node] == ["ReduceSum"]


class BiasSoftmax(OpRun):
    """onnxruntime's com.microsoft.BiasSoftmax as documented: softmax(x + bias) over ``axis``, the
    bias repeated over the leading dims (is_inner_broadcast=0). The CPU EP has no kernel for it."""

    op_domain = "com.microsoft"

    def _run(self, x, bias, axis=None, is_inner_broadcast=None):
        assert is_inner_broadcast == 0
        z = x + bias
        e = np.exp(z - z.max(axis=axis, keepdims=True))
        return ((e / e.sum(axis=axis, keepdims=True)).astype(x.dtype),)


def _attention_mask_model(fill: float, mask_shape: tuple[int, ...]) -> onnx.ModelProto:
    """Scores [2, 3, 4, 4] masked by a causal mask, softmax, then what the transpiler's backward
    writes for the Where: Where(mask, 0, S * g)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 4])
    g = helper.make_tensor_value_info("g", TensorProto.FLOAT, [2, 3, 4, 4])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("s", "dx")]
    mask = ~np.tril(np.ones((4, 4), bool))
    inits = [numpy_helper.from_array(np.broadcast_to(mask, mask_shape).copy(), "mask"),
             numpy_helper.from_array(np.array(fill, np.float32), "fill"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    nodes = [helper.make_node("Where", ["mask", "fill", "x"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["s"], axis=-1),
             helper.make_node("Mul", ["s", "g"], ["sg"]),
             helper.make_node("Where", ["mask", "zero", "sg"], ["dx"])]
    return one_graph_model(nodes, [x, g], outs, inits)


def test_a_causally_masked_softmax_becomes_bias_softmax_and_its_backward_where_goes():
    model = _attention_mask_model(-np.inf, (4, 4))
    lowered = lower_for_cuda(specialize(model, {"x": (2, 3, 4, 4), "g": (2, 3, 4, 4)}))
    ops = [n.op_type for n in lowered.graph.node]
    assert ops.count("BiasSoftmax") == 1 and "Softmax" not in ops
    assert "Where" not in ops  # the [4, 4] additive mask is an initializer, computed once
    assert "com.microsoft" in {o.domain for o in lowered.opset_import}
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(2, 3, 4, 4)).astype(np.float32), "g": rng.normal(size=(2, 3, 4, 4)).astype(np.float32)}
    expected = _run(model, feeds)
    got = ReferenceEvaluator(lowered, new_ops=[BiasSoftmax]).run(None, feeds)
    for e, o in zip(expected, got):
        np.testing.assert_allclose(o, e, rtol=1e-6, atol=1e-7)
    assert (got[1][..., ~np.tril(np.ones((4, 4), bool))] == 0).all()  # the dropped Where's zeros


def test_a_mask_fed_at_run_time_becomes_an_additive_mask_computed_in_the_graph():
    model = _attention_mask_model(-np.inf, (4, 4))
    mask = next(t for t in model.graph.initializer if t.name == "mask")
    model.graph.initializer.remove(mask)
    model.graph.input.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, [4, 4]))
    shapes = {"x": (2, 3, 4, 4), "g": (2, 3, 4, 4), "mask": (4, 4)}
    lowered = lower_for_cuda(specialize(model, shapes))
    assert [n.op_type for n in lowered.graph.node].count("Where") == 1  # the additive mask, each run
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(2, 3, 4, 4)).astype(np.float32), "g": rng.normal(size=(2, 3, 4, 4)).astype(np.float32),
             "mask": ~np.tril(np.ones((4, 4), bool))}
    got = ReferenceEvaluator(lowered, new_ops=[BiasSoftmax]).run(None, feeds)
    for e, o in zip(_run(model, feeds), got):
        np.testing.assert_allclose(o, e, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("last", ["Mul", "Sub"])
def test_the_backward_where_goes_also_where_elementwise_fusion_took_its_product(last):
    """The softmax backward ``S * (g - r)`` fused into one node (GPU elementwise fusion, before the
    cut) still ends in a product with S, which is 0 where the mask filled: the Where goes. A fused
    node that ends in something else (``S * g - r``: not 0 where S is) keeps it."""
    from runtime.gpu.elementwise_fusion import fuse_elementwise
    from runtime.gpu.elementwise_steps import DOMAIN

    f = TensorProto.FLOAT
    x, g = (helper.make_tensor_value_info(n, f, ["N", 3, 4, 4]) for n in ("x", "g"))
    r = helper.make_tensor_value_info("r", f, ["N", 3, 4, 1])
    outs = [helper.make_tensor_value_info(n, f, None) for n in ("s", "dx")]
    inits = [numpy_helper.from_array(~np.tril(np.ones((4, 4), bool)), "mask"),
             numpy_helper.from_array(np.array(-np.inf, np.float32), "fill"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    nodes = [helper.make_node("Where", ["mask", "fill", "x"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["s"], axis=-1)]
    if last == "Mul":
        nodes += [helper.make_node("Sub", ["g", "r"], ["gr"]), helper.make_node("Mul", ["s", "gr"], ["sg"])]
    else:
        nodes += [helper.make_node("Mul", ["s", "g"], ["p"]), helper.make_node("Sub", ["p", "r"], ["sg"])]
    nodes.append(helper.make_node("Where", ["mask", "zero", "sg"], ["dx"]))
    model = one_graph_model(nodes, [x, g, r], outs, inits)
    fused = fuse_elementwise(model)
    assert [n.domain for n in fused.graph.node].count(DOMAIN) == 1
    shapes = {"x": (2, 3, 4, 4), "g": (2, 3, 4, 4), "r": (2, 3, 4, 1)}
    lowered = lower_for_cuda(specialize(fused, shapes))
    # The additive mask is an initializer; the backward's Where is left only where it is needed.
    assert [n.op_type for n in lowered.graph.node].count("Where") == (0 if last == "Mul" else 1)
    rng = np.random.default_rng(0)
    feeds = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
    got = ReferenceEvaluator(lowered, new_ops=[BiasSoftmax]).run(None, feeds)
    for e, o in zip(_run(model, feeds), got):
        np.testing.assert_allclose(o, e, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fill, mask_shape", [(-1.0, (4, 4)),  # a fill exp() does not flush to 0
                                              (-np.inf, (2, 1, 4, 4))])  # one mask per batch row: not an outer broadcast
def test_masks_the_rewrite_cannot_prove_equal_are_left_alone(fill, mask_shape):
    model = _attention_mask_model(fill, mask_shape)
    lowered = lower_for_cuda(specialize(model, {"x": (2, 3, 4, 4), "g": (2, 3, 4, 4)}))
    assert [n.op_type for n in lowered.graph.node] == ["Where", "Softmax", "Mul", "Where"]


def test_outputs_onnxruntime_would_copy_at_run_start_are_taken_out_of_the_session():
    """A segment output computable from constants alone, or an Identity of an input, would be
    copied by onnxruntime with a blocking cudaMemcpy when a run starts (illegal while a CUDA graph
    is captured): the segment computes the first once on the host and copies the second itself."""
    from types import SimpleNamespace

    from runtime.gpu.compile import Compiled, FixedOutputs
    from runtime.gpu.session import OrtCudaSegment
    from runtime.segments import Segment

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("mask", "same", "y")]
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["ones"], value=numpy_helper.from_array(np.ones(1, np.float32))),
             helper.make_node("Trilu", ["ones"], ["mask"], upper=0),
             helper.make_node("Identity", ["x"], ["same"]),
             helper.make_node("Mul", ["x", "x"], ["y"])]
    model = one_graph_model(nodes, [x], outs, [numpy_helper.from_array(np.array([3, 3], np.int64), "shape")])

    state = Compiled(model, {"x": (2, 3)}, frozenset(), "rank0.onnx: segment 0", (0, 0, 0))
    step = FixedOutputs(ort)
    step.call(state)
    step.ensures(state)
    assert [o.name for o in state.model.graph.output] == ["y"]
    np.testing.assert_array_equal(state.constants["mask"], np.tril(np.ones((3, 3), np.float32)))
    assert state.copies == {"same": "x"}
    # The session's copy of an input is a copy, not a view of the fed buffer.
    segment = OrtCudaSegment(Segment(0, ("n",), ("x",), ("mask", "same", "y"), model), "rank0.onnx",
                             SimpleNamespace(device=None))
    segment.constants, segment.copies = state.constants, state.copies
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    fixed = segment._fixed_values(feeds)
    np.testing.assert_array_equal(fixed["same"], feeds["x"])
    assert not np.shares_memory(fixed["same"], feeds["x"])


def test_bfloat16_crosses_a_segments_edges_as_float32():
    """--precision bf16 on several ranks: a bfloat16 value crossing a segment's edge (here a
    bfloat16 input, a bfloat16 result and a bfloat16 constant) is float32 outside the session
    (NumPy and CuPy have no bfloat16), exactly; inside, the graph computes as written. Run here on
    onnxruntime's CPU provider, whose bfloat16 kernels cover these moves and casts."""
    from runtime.gpu.compile import Compiled, FixedOutputs, WidenBfloat16

    bf16 = TensorProto.BFLOAT16
    x = helper.make_tensor_value_info("x", bf16, [2, 3])
    outs = [helper.make_tensor_value_info("t", bf16, [3, 2]), helper.make_tensor_value_info("c", bf16, [2]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 2])]
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
             helper.make_node("Cast", ["t"], ["w"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["k"], ["c"], to=bf16)]
    model = one_graph_model(nodes, [x], outs, [numpy_helper.from_array(np.array([1.001, -3.3], np.float32), "k")])
    state = Compiled(model, {"x": (2, 3)}, frozenset(), "rank0.onnx: segment 0", (0, 0, 0))
    for step in (WidenBfloat16(), FixedOutputs(ort)):
        step.call(state)
        step.ensures(state)
    edges = [v.type.tensor_type.elem_type for v in [*state.model.graph.input, *state.model.graph.output]]
    assert edges == [TensorProto.FLOAT] * 3
    # float32 numbers that are bfloat16 numbers pass unchanged; the constant is rounded once.
    feed = np.array([[1.0, -2.5, 0.15625], [2.0 ** 127, 6.103515625e-05, -0.0]], np.float32)
    t, w = ort.InferenceSession(state.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["t", "w"], {"x": feed})
    np.testing.assert_array_equal(t, feed.T)
    np.testing.assert_array_equal(w, feed.T)
    assert state.constants["c"].dtype == np.float32
    np.testing.assert_array_equal(state.constants["c"], np.array([1.0, -3.296875], np.float32))


def test_bfloat16_edges_the_program_keeps_stay_bfloat16_and_a_kept_constant_is_its_raw_bits():
    """The values GpuProgram passes as bfloat16 (buffers.bfloat16_edges: here the input x, the
    output t and the constant c) keep their type at the session's edge; the rest is widened as
    before. A bfloat16 constant comes out as its raw bits (uint16), as the program holds it."""
    from runtime.gpu.compile import Compiled, FixedOutputs, WidenBfloat16

    bf16 = TensorProto.BFLOAT16
    ins = [helper.make_tensor_value_info("x", bf16, [2, 3]), helper.make_tensor_value_info("y", bf16, [2, 3])]
    outs = [helper.make_tensor_value_info("t", bf16, [3, 2]), helper.make_tensor_value_info("c", bf16, [2]),
            helper.make_tensor_value_info("u", bf16, [2, 3])]
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
             helper.make_node("Add", ["x", "y"], ["u"]),
             helper.make_node("Cast", ["k"], ["c"], to=bf16)]
    model = one_graph_model(nodes, ins, outs, [numpy_helper.from_array(np.array([1.001, -3.3], np.float32), "k")])
    state = Compiled(model, {"x": (2, 3), "y": (2, 3)}, frozenset(), "rank0.onnx: segment 0", (0, 0, 0),
                     bfloat16_edges=frozenset({"x", "t", "c"}))
    for step in (WidenBfloat16(), FixedOutputs(ort)):
        step.call(state)
        step.ensures(state)
    graph = state.model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
    assert types == {"x": bf16, "y": TensorProto.FLOAT, "t": bf16, "u": TensorProto.FLOAT}
    assert state.constants["c"].dtype == np.uint16
    np.testing.assert_array_equal(state.constants["c"], round_bf16_numpy(np.array([1.0, -3.296875], np.float32)))


@pytest.mark.parametrize("count, concats", [(32, 1), (33, 3), (69, 4), (1100, 38)])
def test_a_concat_wider_than_capture_allows_becomes_a_tree_with_the_same_values(count, concats):
    """onnxruntime's CUDA Concat takes at most 32 inputs under CUDA-graph capture (ZeRO wrote 69)."""
    inputs = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [i % 3 + 1, 2]) for i in range(count)]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    # Two unnamed Concats of the same inputs: the tree's node names must still be unique.
    nodes = [helper.make_node("Concat", [v.name for v in inputs], [out], axis=0) for out in ("y", "z")]
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, [y, z]), opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    lowered = lower_for_cuda(specialize(model, {}))
    assert [n.op_type for n in lowered.graph.node] == ["Concat"] * (2 * concats)
    assert max(len(n.input) for n in lowered.graph.node) <= 32
    named = [n.name for n in lowered.graph.node if n.name]
    assert len(named) == len(set(named))
    assert {n.output[0] for n in lowered.graph.node} >= {"y", "z"}
    rng = np.random.default_rng(count)
    feeds = {f"x{i}": rng.normal(size=(i % 3 + 1, 2)).astype(np.float32) for i in range(count)}
    for result in _run(lowered, feeds):
        np.testing.assert_array_equal(result, np.concatenate(list(feeds.values())))


def test_a_bfloat16_node_without_a_kernel_computes_in_float32_between_casts():
    """GlobalAveragePool in bfloat16 (opset 22: a bf16 CNN's pool): onnxruntime has no such kernel
    (on CPU, and on CUDA, where a session would not load); widened, it runs and computes what a
    bfloat16 kernel does: the mean of the bfloat16 values in float, rounded once. The Flatten after
    it (a kernel exists) stays bfloat16."""
    from runtime.gpu.elementwise_steps import round_bf16_numpy, widen_bf16_numpy
    from runtime.gpu.lowering import NO_BF16_KERNEL, widen_bfloat16

    bf16, f32 = TensorProto.BFLOAT16, TensorProto.FLOAT
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=bf16, name="down"),
             helper.make_node("GlobalAveragePool", ["xb"], ["pooled"], name="pool"),
             helper.make_node("Flatten", ["pooled"], ["r"], name="flatten"),
             helper.make_node("Cast", ["r"], ["y"], to=f32, name="up")]
    model = one_graph_model(nodes, [helper.make_tensor_value_info("x", f32, [2, 3, 4, 4])],
                            [helper.make_tensor_value_info("y", f32, [2, 3])], opset=22)
    model = specialize(model, {"x": (2, 3, 4, 4)})
    with pytest.raises(Exception, match="GlobalAveragePool"):
        _run(model, {})
    assert "GlobalAveragePool" in NO_BF16_KERNEL and "Flatten" not in NO_BF16_KERNEL
    widened = widen_bfloat16(model)
    ops = [n.op_type for n in widened.graph.node]
    assert ops == ["Cast", "Cast", "GlobalAveragePool", "Cast", "Flatten", "Cast"], ops
    x = np.random.default_rng(0).normal(size=(2, 3, 4, 4)).astype(np.float32)
    (y,) = _run(widened, {"x": x})
    mean = widen_bf16_numpy(round_bf16_numpy(x)).mean(axis=(2, 3), keepdims=True, dtype=np.float32)
    expected = widen_bf16_numpy(round_bf16_numpy(mean)).reshape(2, 3)
    np.testing.assert_array_equal(y, expected)
