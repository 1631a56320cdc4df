"""What the GPU program builds from a cut, checked on CPU: how long its items' values live and where
they lie in one block (runtime/gpu/buffers.value_lifetimes, pack_buffers) and the order in which a native group's domains run
(runtime/segments.NativeGroup.by_domain)."""

from __future__ import annotations

import numpy as np
from onnx import helper

from runtime.gpu.buffers import pack_buffers, value_lifetimes
from runtime.segments import NativeGroup


def test_values_overlap_in_bytes_only_when_their_lifetimes_do_not():
    rng = np.random.default_rng(0)
    for trial in range(200):
        lifetimes = []
        for i in range(int(rng.integers(1, 40))):
            first = int(rng.integers(0, 30))
            lifetimes.append((f"v{i}", int(rng.integers(0, 5000)), first, first + int(rng.integers(0, 6))))
        offsets, total = pack_buffers(lifetimes, align=16)
        assert set(offsets) == {name for name, *_ in lifetimes}
        for name, nbytes, first, last in lifetimes:
            assert offsets[name] % 16 == 0 and offsets[name] + nbytes <= total, (trial, name)
            for other, nbytes2, first2, last2 in lifetimes:
                apart = offsets[name] + nbytes <= offsets[other] or offsets[other] + nbytes2 <= offsets[name]
                if other != name and not apart and nbytes and nbytes2:
                    assert last < first2 or last2 < first, (trial, name, other)
        # At least the most bytes alive at once; at most one place per value.
        alive = max(sum(n for _, n, a, b in lifetimes if a <= p <= b) for p in range(40))
        assert alive <= total <= sum(-(-max(n, 1) // 16) * 16 for _, n, _, _ in lifetimes)


def test_a_chain_of_equal_values_takes_two_places():
    # An activation passed from item to item, each read only by the next: two places in turn.
    offsets, total = pack_buffers([(f"a{i}", 256, i, i + 1) for i in range(10)])
    assert total == 512 and [offsets[f"a{i}"] for i in range(4)] == [0, 256, 0, 256]


def test_a_value_lives_from_its_item_to_its_last_reader_or_to_the_steps_end():
    """value_lifetimes' rules: an item's output lives to its last reader; one a collective between
    sessions reads, to the step's end (NCCL reads it on its own stream); a constant a session writes
    once when bound, the whole step; values with buffers of their own, and the collective's own
    outputs, are not in the block."""
    items = [(["a", "b", "c", "own"], True),   # 0: a session
             (["d"], True),                    # 1: a session
             (["r"], False),                   # 2: a collective between sessions
             (["e"], True),                    # 3: a native group
             ([], True)]                       # 4: a session
    readers = {"a": [1], "b": [2], "d": [3, 4], "e": [4], "c": [], "r": [3]}
    nbytes = dict.fromkeys(["a", "b", "c", "d", "e", "own", "r"], 64)
    lifetimes = value_lifetimes(items, readers, nbytes, own={"own"}, once={0: {"c"}})
    assert sorted(lifetimes) == [("a", 64, 0, 1), ("b", 64, 0, 5), ("c", 64, 0, 5), ("d", 64, 1, 4), ("e", 64, 3, 4)]


def _node(domain: str, inputs: list[str], output: str) -> helper.NodeProto:
    return helper.make_node("Op", inputs, [output], name=output, domain=domain)


def _domains(group: NativeGroup) -> list[tuple[str, list[str]]]:
    return [(sub.nodes[0].domain, [n.name for n in sub.nodes]) for sub in group.by_domain()]


def test_independent_nodes_of_two_domains_make_one_group_each():
    nodes = (_node("bn", ["x"], "b1"), _node("conv", ["y"], "w1"), _node("bn", ["z"], "b2"), _node("conv", ["b1"], "w2"))
    group = NativeGroup(0, 0, 1, nodes, ("x", "y", "z"), ("b1", "w1", "b2", "w2"))
    assert _domains(group) == [("bn", ["b1", "b2"]), ("conv", ["w1", "w2"])]


def test_a_node_reading_a_later_group_starts_a_new_group_after_it():
    # bn2 reads conv's w1, and w1's group comes after bn1's: bn2 must run after it.
    nodes = (_node("bn", ["x"], "b1"), _node("conv", ["b1"], "w1"), _node("bn", ["w1"], "b2"))
    group = NativeGroup(0, 0, 1, nodes, ("x",), ("b1", "w1", "b2"))
    assert _domains(group) == [("bn", ["b1"]), ("conv", ["w1"]), ("bn", ["b2"])]
    one = NativeGroup(0, 0, 1, nodes[:1], ("x",), ("b1",))
    assert one.by_domain() == [one]


def test_a_node_does_not_move_before_a_reader_of_its_inputs():
    # upd2 may write p2 in place (the fused update): it must not join upd1's group, which runs
    # before elem reads p2.
    nodes = (_node("upd", ["p1"], "q1"), _node("elem", ["p2"], "e"), _node("upd", ["p2"], "q2"))
    group = NativeGroup(0, 0, 1, nodes, ("p1", "p2"), ("q1", "e", "q2"))
    assert _domains(group) == [("upd", ["q1"]), ("elem", ["e"]), ("upd", ["q2"])]


def test_an_onnxruntime_node_read_only_after_a_native_stage_is_computed_there():
    """ReLU's mask (Greater) reads a forward value but only the backward (Where, after the native
    stage) reads it: it goes to Where's segment, not Relu's, so no mask is kept across the stage."""
    from onnx import TensorProto

    from runtime.segments import Segment, cut_graph

    f = TensorProto.FLOAT
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu"),
             helper.make_node("Greater", ["y", "zero"], ["mask"], name="mask"),
             helper.make_node("Op", ["y"], ["z"], name="native", domain="test.native"),
             helper.make_node("Where", ["mask", "z", "zero"], ["out"], name="where")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [4])],
                              [helper.make_tensor_value_info("out", f, [4])],
                              [helper.make_tensor("zero", f, [], [0.0])],
                              value_info=[helper.make_tensor_value_info("z", f, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("test.native", 1)])
    cut = cut_graph(model, 0, "g.onnx", native_domains=["test.native"])
    where = {name: i for i, item in enumerate(cut.items) if isinstance(item, Segment) for name in item.node_names}
    assert [type(item).__name__ for item in cut.items] == ["Segment", "NativeGroup", "Segment"]
    assert where["mask"] == where["where"] == 2 and where["relu"] == 0


def test_the_optimizer_updates_share_the_last_native_stage():
    """Two weight gradients finish in two native stages, with onnxruntime work between them; upd1
    could run right after grad1, but both updates go late, into one group (one multi-tensor launch)."""
    from onnx import TensorProto

    from contract.ops import FUSED_UPDATE_DOMAIN
    from runtime.segments import Segment, cut_graph

    f, grad = TensorProto.FLOAT, "test.grad"
    nodes = [helper.make_node("Op", ["x"], ["g1"], name="grad1", domain=grad),
             helper.make_node("Relu", ["g1"], ["h"], name="relu"),
             helper.make_node("Op", ["h"], ["g2"], name="grad2", domain=grad),
             helper.make_node("Neg", ["g2"], ["loss"], name="neg"),
             helper.make_node("SGD", ["p1", "g1"], ["p1_next"], name="upd1", domain=FUSED_UPDATE_DOMAIN),
             helper.make_node("SGD", ["p2", "g2"], ["p2_next"], name="upd2", domain=FUSED_UPDATE_DOMAIN)]
    info = [helper.make_tensor_value_info(n, f, [4]) for n in ("g1", "g2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, f, [4]) for n in ("x", "p1", "p2")],
                              [helper.make_tensor_value_info(n, f, [4]) for n in ("loss", "p1_next", "p2_next")],
                              value_info=info)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(grad, 1),
                                                    helper.make_opsetid(FUSED_UPDATE_DOMAIN, 1)])
    cut = cut_graph(model, 0, "g.onnx", native_domains=[grad, FUSED_UPDATE_DOMAIN], late_domains=[FUSED_UPDATE_DOMAIN])
    kinds = [[n.name for n in item.nodes] if isinstance(item, NativeGroup) else "segment" for item in cut.items]
    assert kinds == [["grad1"], "segment", ["grad2", "upd1", "upd2"], "segment"], kinds
    assert isinstance(cut.items[-1], Segment)


def test_a_late_update_still_runs_before_an_onnxruntime_node_that_reads_it():
    """upd1's output is read by an onnxruntime node of the same part (neg2): going late, upd1 stops
    at the native stage before that node's, not at the part's last one."""
    from onnx import TensorProto

    from contract.ops import FUSED_UPDATE_DOMAIN
    from runtime.segments import Segment, cut_graph

    f, grad = TensorProto.FLOAT, "test.grad"
    nodes = [helper.make_node("Op", ["x"], ["g1"], name="grad1", domain=grad),
             helper.make_node("SGD", ["p1", "g1"], ["p1_next"], name="upd1", domain=FUSED_UPDATE_DOMAIN),
             helper.make_node("Relu", ["g1"], ["h"], name="relu"),
             helper.make_node("Op", ["h"], ["g2"], name="grad2", domain=grad),
             helper.make_node("Add", ["g2", "p1_next"], ["mix"], name="neg2"),
             helper.make_node("Op", ["mix"], ["g3"], name="grad3", domain=grad),
             helper.make_node("Neg", ["g3"], ["loss"], name="neg3")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, f, [4]) for n in ("x", "p1")],
                              [helper.make_tensor_value_info(n, f, [4]) for n in ("loss", "p1_next")],
                              value_info=[helper.make_tensor_value_info(n, f, [4]) for n in ("g1", "g2", "g3", "p1_next")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(grad, 1),
                                                    helper.make_opsetid(FUSED_UPDATE_DOMAIN, 1)])
    cut = cut_graph(model, 0, "g.onnx", native_domains=[grad, FUSED_UPDATE_DOMAIN], late_domains=[FUSED_UPDATE_DOMAIN])
    order = [[n.name for n in item.nodes] if isinstance(item, NativeGroup) else sorted(item.node_names)
             for item in cut.items]
    position = {name: k for k, names in enumerate(order) for name in names}
    assert position["grad2"] <= position["upd1"] < position["neg2"], order
    assert isinstance(cut.items[position["neg2"]], Segment)
