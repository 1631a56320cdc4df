"""What the GPU program builds from a cut, checked on CPU: the buffers its items' values share
(runtime/gpu/program.share_buffers) and the order in which a native group's domains run
(runtime/segments.NativeGroup.by_domain)."""

from __future__ import annotations

import numpy as np
from onnx import helper

from runtime.gpu.program import share_buffers
from runtime.segments import NativeGroup


def test_values_share_a_buffer_only_when_their_lifetimes_do_not_overlap():
    rng = np.random.default_rng(0)
    for trial in range(200):
        lifetimes = []
        for i in range(int(rng.integers(1, 40))):
            first = int(rng.integers(0, 30))
            lifetimes.append((f"v{i}", int(rng.integers(0, 5000)), first, first + int(rng.integers(0, 6))))
        slot, sizes = share_buffers(lifetimes)
        assert set(slot) == {name for name, *_ in lifetimes}
        for name, nbytes, first, last in lifetimes:
            assert sizes[slot[name]] >= nbytes, (trial, name)
            for other, _, first2, last2 in lifetimes:
                if other != name and slot[other] == slot[name]:
                    assert last < first2 or last2 < first, (trial, name, other)
        # Never more bytes than one buffer per value, nor fewer than the most bytes alive at once.
        alive = max(sum(n for _, n, a, b in lifetimes if a <= p <= b) for p in range(40))
        assert alive <= sum(sizes) <= sum(n for _, n, _, _ in lifetimes)


def test_a_chain_of_equal_values_reuses_two_buffers():
    # An activation passed from item to item, each read only by the next: two buffers in turn.
    slot, sizes = share_buffers([(f"a{i}", 64, i, i + 1) for i in range(10)])
    assert len(sizes) == 2 and [slot[f"a{i}"] for i in range(4)] == [0, 1, 0, 1]


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
