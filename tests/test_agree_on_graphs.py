"""The sessions that hold collectives are captured as CUDA graphs on every rank or on none
(runtime/gpu/session.py ``agree_on_graphs``): a rank whose session could not be captured turns the
others' off, since NCCL asks every rank to capture the same calls. The ranks' flags meet in one
host all-reduce, stood in for here."""

from __future__ import annotations

from types import SimpleNamespace

from onnx import helper

from runtime.collectives import COLLECTIVE_DOMAIN
from runtime.gpu.session import OrtCudaSegment, agree_on_graphs


def _step(collective: bool, graphs: bool):
    runner = object.__new__(OrtCudaSegment)  # the two fields agree_on_graphs reads, no device
    runner.session, runner.graphs = object(), graphs
    node = helper.make_node("AllReduce", ["g"], ["m"], domain=COLLECTIVE_DOMAIN) if collective else helper.make_node("Relu", ["x"], ["y"])
    return SimpleNamespace(model=helper.make_model(helper.make_graph([node], "g", [], []))), runner


class _Host:
    """The host all-reduce: this rank's value plus what the other ranks send."""

    def __init__(self, others: float):
        self.others, self.sent = others, []

    def allreduce_scalars(self, values, reduction="mean"):
        assert reduction == "sum"
        self.sent.append(values[0])
        return [values[0] + self.others]


def test_where_every_rank_captures_nothing_changes():
    steps = [_step(True, True), _step(False, True)]
    host = _Host(0.0)
    agree_on_graphs(steps, host, "rank0.onnx")
    assert host.sent == [0.0] and [r.graphs for _, r in steps] == [True, True]


def test_another_rank_that_could_not_capture_turns_the_sessions_with_collectives_off(capsys):
    steps = [_step(True, True), _step(False, True), _step(True, True)]
    agree_on_graphs(steps, _Host(1.0), "rank0.onnx")
    assert [r.graphs for _, r in steps] == [False, True, False]  # a session without collectives keeps its graph
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("transpile: warning: rank0.onnx: no CUDA graphs for the 2 session(s)")


def test_a_rank_that_could_not_capture_tells_the_others():
    steps = [_step(True, False), _step(True, True)]
    host = _Host(0.0)
    agree_on_graphs(steps, host, "rank1.onnx")
    assert host.sent == [1.0] and [r.graphs for _, r in steps] == [False, False]
