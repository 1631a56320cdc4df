"""Cutting rank graphs at collectives: ALAP placement, segment inputs/outputs, contract errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_runtime_outdir import write_out

from runtime import RunError, cut_graph
from runtime.collectives import CollectiveOp
from runtime.segments import Segment


def _cut(out, name, rank):
    return cut_graph(onnx.load(str(out / name)), rank, name)


def _layout(cut):
    return [(type(i).__name__, i.index if isinstance(i, Segment) else i.order) for i in cut.items]


def test_allreduce_rank_is_cut_as_late_as_possible(tmp_path):
    cut = _cut(write_out(tmp_path, 2, "allreduce"), "rank0.onnx", 0)
    assert _layout(cut) == [("Segment", 0), ("AllReduce", 0), ("Segment", 1), ("AllReduce", 1), ("Segment", 2)]
    s0, s1, s2 = cut.segments
    # Segment 0 computes only what bucket 0 (grad.b) needs; w's gradient waits for segment 1.
    assert set(s0.node_names) == {"matmul", "add_b", "diff", "dpred", "grad_b"}
    assert set(s1.node_names) == {"xd", "grad_w_mean", "grad_w"}
    # The loss feeds no collective, so it lands in the last segment with the updates.
    assert {"square", "loss", "b_update", "w_update", "count"} <= set(s2.node_names)
    assert set(s0.inputs) == {"x", "y", "w", "b"}
    assert set(s0.outputs) == {"grad.b", "dpred", "diff"}  # diff: read by the loss in segment 2
    assert set(s1.inputs) == {"x", "dpred"} and s1.outputs == ("grad.w",)
    assert "grad.b.avg" in s2.inputs and "grad.w.avg" in s2.inputs
    # Initializers travel with the segments that read them, never as inputs.
    assert {t.name for t in s0.model.graph.initializer} == {"two", "axis0"}
    assert {t.name for t in s1.model.graph.initializer} == {"axis0", "shape31"}
    for s in cut.segments:
        onnx.checker.check_model(s.model)
        assert all(op.domain != "graph_transpiler" for op in s.model.opset_import)


def test_boundary_values_keep_the_rank_graphs_types(tmp_path):
    cut = _cut(write_out(tmp_path, 2, "allreduce"), "rank0.onnx", 0)
    s1 = cut.segments[1]
    types = {vi.name: vi.type.tensor_type for vi in [*s1.model.graph.input, *s1.model.graph.output]}
    assert [d.dim_param or d.dim_value for d in types["x"].shape.dim] == ["batch", 3]
    assert [d.dim_value for d in types["grad.w"].shape.dim] == [3, 1]
    assert types["dpred"].elem_type == TensorProto.FLOAT


def test_sharded_ranks_place_updates_before_their_broadcast(tmp_path):
    out = write_out(tmp_path, 2, "sharded")
    rank0, rank1 = _cut(out, "rank0.onnx", 0), _cut(out, "rank1.onnx", 1)
    assert _layout(rank0) == [("Segment", 0), ("Reduce", 0), ("Segment", 1), ("Reduce", 1), ("Segment", 2),
                              ("Broadcast", 2), ("Broadcast", 3), ("Segment", 4)]
    assert {"b_update"} <= set(rank0.segments[2].node_names)  # rank 0 owns b: updates before Broadcast 2
    # rank 1 owns w: its update needs Reduce 1 and feeds Broadcast 3, so it runs between them (segment 3).
    by_index = {s.index: s for s in rank1.segments}
    assert {"w_update"} <= set(by_index[3].node_names) and 2 not in by_index
    reduce0 = rank1.collectives[0]
    assert reduce0.op_type == "Reduce" and reduce0.outputs == ()  # non-root: contributes, receives nothing


def test_init_graph_feeds_initializers_straight_into_broadcast(tmp_path):
    out = write_out(tmp_path, 2, "allreduce")
    root = _cut(out, "rank0_init.onnx", 0)
    assert "b.init" in root.constants and "optimizer.step" in root.constants  # no segment carries them
    other = _cut(out, "rank1_init.onnx", 1)
    assert "b.init" not in other.constants
    assert other.collectives[0].inputs == () and other.collectives[0].output_specs[0].shape == (1,)


def _graph(nodes, outputs, value_info=(), inputs=None):
    inputs = inputs if inputs is not None else [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, value_info=list(value_info))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("graph_transpiler", 1)])


def _allreduce(x, y, order):
    return helper.make_node("AllReduce", [x], [y], name=f"ar{order}", domain="graph_transpiler",
                            order=order, reduction="sum", bucket=order, phase="step")


def _f(name, shape=(2,)):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def test_collective_order_contradicting_data_flow_is_an_error():
    nodes = [_allreduce("a", "b", 1), helper.make_node("Neg", ["b"], ["c"], name="neg"), _allreduce("c", "d", 0)]
    with pytest.raises(RunError, match="orders contradict the data flow"):
        cut_graph(_graph(nodes, [_f("d")], [_f("b"), _f("c")]), 0, "bad.onnx")


def test_orders_must_be_a_permutation_from_zero():
    nodes = [_allreduce("a", "b", 0), _allreduce("b", "c", 2)]
    with pytest.raises(RunError, match=r"bad.onnx: collective 'order' attributes are \[0, 2\]"):
        cut_graph(_graph(nodes, [_f("c")], [_f("b")]), 0, "bad.onnx")


def test_collective_outputs_need_static_types():
    nodes = [_allreduce("a", "b", 0)]
    with pytest.raises(RunError, match="collective output 'b' has no tensor type"):
        cut_graph(_graph(nodes, [helper.make_empty_tensor_value_info("b")]), 0, "bad.onnx")


def test_unknown_collective_lists_the_implemented_ones():
    node = helper.make_node("AllToAll", ["a"], ["b"], name="a2a", domain="graph_transpiler", order=0)
    with pytest.raises(RunError, match=r"'AllToAll'.*implemented: AllConcat, AllGather, AllReduce, Broadcast, Reduce, ReduceScatter"):
        cut_graph(_graph([node], [_f("b")]), 0, "bad.onnx")


def test_broadcast_role_is_checked_against_the_rank():
    node = helper.make_node("Broadcast", [], ["b"], name="bc", domain="graph_transpiler", order=0, root=0)
    with pytest.raises(RunError, match=r"Broadcast on rank 0 \(root\) has 0 inputs, expected 1"):
        cut_graph(_graph([node], [_f("b")], inputs=[]), 0, "bad.onnx")


def test_subgraph_captures_are_segment_inputs():
    # An If body reads 'a' from the outer scope: the segment holding the If must take 'a' as input.
    then = helper.make_graph([helper.make_node("Neg", ["a"], ["t"])], "then", [], [_f("t")])
    other = helper.make_graph([helper.make_node("Identity", ["a"], ["e"])], "else", [], [_f("e")])
    nodes = [_allreduce("a", "s", 0),
             helper.make_node("If", ["cond"], ["r"], name="if", then_branch=then, else_branch=other)]
    inputs = [_f("a"), helper.make_tensor_value_info("cond", TensorProto.BOOL, [])]
    cut = cut_graph(_graph(nodes, [_f("r"), _f("s")], inputs=inputs), 0, "if.onnx")
    (segment,) = cut.segments
    assert set(segment.inputs) == {"cond", "a"} and segment.index == 1


def test_dead_nodes_make_no_segment():
    nodes = [helper.make_node("Neg", ["a"], ["unused"], name="dead"), _allreduce("a", "b", 0)]
    cut = cut_graph(_graph(nodes, [_f("b")]), 0, "g.onnx")
    assert [type(i) for i in cut.items] == [type(cut.collectives[0])] and isinstance(cut.items[0], CollectiveOp)


def test_initializer_used_by_two_segments_is_copied_into_both():
    k = numpy_helper.from_array(np.ones(2, np.float32), "k")
    nodes = [helper.make_node("Add", ["a", "k"], ["p"], name="p"), _allreduce("p", "q", 0),
             helper.make_node("Mul", ["q", "k"], ["r"], name="r")]
    model = _graph(nodes, [_f("r")], [_f("q")])
    model.graph.initializer.append(k)
    s0, s1 = cut_graph(model, 0, "g.onnx").segments
    assert [t.name for t in s0.model.graph.initializer] == ["k"] == [t.name for t in s1.model.graph.initializer]


def test_a_constant_node_read_on_both_sides_of_a_collective_is_a_constant_in_both_segments():
    """A Constant's value never crosses a cut as a run-time input: the later segment holds it as an
    initializer, so a reduction's axes stay constant there (and the GPU lowering can split it)."""
    axes = helper.make_node("Constant", [], ["axes"], name="axes", value=numpy_helper.from_array(np.array([0], np.int64)))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])
    nodes = [axes, helper.make_node("ReduceSum", ["x", "axes"], ["p"], name="p"), _allreduce("p", "q", 0),
             helper.make_node("Mul", ["q", "x"], ["m"], name="m"),
             helper.make_node("ReduceSum", ["m", "axes"], ["r"], name="r")]
    model = _graph(nodes, [_f("r", (1, 3))], [_f("p", (1, 3)), _f("q", (1, 3)), _f("m", (4, 3))], inputs=[x])
    s0, s1 = cut_graph(model, 0, "g.onnx").segments
    for segment in (s0, s1):
        assert "axes" not in segment.inputs
        assert [t.name for t in segment.model.graph.initializer] == ["axes"]
        assert not [n for n in segment.model.graph.node if n.op_type == "Constant"]
    assert set(s1.inputs) == {"q", "x"}
    # Values as before: the later segment on its own computes sum over rows of q * x.
    import onnxruntime as ort

    xv = np.arange(12, dtype=np.float32).reshape(4, 3)
    qv = np.ones((1, 3), np.float32) * 2
    session = ort.InferenceSession(s1.model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(["r"], {"q": qv, "x": xv})[0], (qv * xv).sum(0, keepdims=True))
