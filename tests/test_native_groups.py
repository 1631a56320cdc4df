"""What the GPU program builds from a cut, checked on CPU: where its items' values lie in one block
(runtime/gpu/program.pack_buffers) and the order in which a native group's domains run
(runtime/segments.NativeGroup.by_domain)."""

from __future__ import annotations

import numpy as np
from onnx import helper

from runtime.gpu.program import pack_buffers
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
