"""Which state a GPU program writes over the buffer its input is read from
(runtime/gpu/buffers.carried_in_place; GpuProgram._carried_in_place binds them): the rule on small
item lists, and on the steps the transpiler writes, cut as the nccl backend cuts them (collectives
inside the sessions, the fused updates between): under `sharded` and `zero` every parameter is
written in place by the session of its Broadcast or AllGather, under `allreduce` none is (the fused
update already updates them in place)."""

from __future__ import annotations

import onnx
import pytest

from commands.main import main
from contract.ops import FUSED_UPDATE_DOMAIN
from runtime.collectives import CollectiveOp
from runtime.gpu.buffers import carried_in_place
from runtime.plan import load_plan
from runtime.segments import cut_graph


def _readers(items):
    readers: dict[str, list[int]] = {}
    for pos, (inputs, _, _) in enumerate(items):
        for name in inputs:
            readers.setdefault(name, []).append(pos)
    return readers


def _pairs(items, *, carried=None, outputs=None, fed=None, taken=()):
    carried = {"p.next": "p"} if carried is None else carried
    outputs = {"p.next", "loss"} if outputs is None else outputs
    fed = {"p", "x"} if fed is None else fed
    return carried_in_place(items, _readers(items), carried, outputs, fed, set(taken))


# The sharded step of one parameter: forward/backward and the Reduce's session, the root's update,
# the Broadcast's session.
SHARDED = [(["x", "p"], ["loss", "g"], True), (["g", "p"], ["p.new"], True), (["p.new"], ["p.next"], True)]


def test_a_later_item_writes_the_next_value_over_the_input():
    assert _pairs(SHARDED) == {"p.next": "p"}


@pytest.mark.parametrize("items, why", [
    ([(["x", "p"], ["loss", "g"], True), (["g", "p"], ["p.next"], True)], "the computing item reads the input"),
    ([(["x"], ["loss", "g"], True), (["g"], ["p.next"], True), (["p"], ["y"], True)], "a reader comes after it"),
    ([(["x", "p"], ["loss", "g"], True), (["p"], ["h"], False), (["g"], ["p.next"], True)],
     "a collective between sessions reads the input on its own stream"),
])
def test_it_is_refused_where_a_read_could_see_the_next_value(items, why):
    assert _pairs(items) == {}, why


def test_only_fed_state_carried_as_an_output_that_nothing_else_took():
    assert _pairs(SHARDED, fed={"x"}) == {}  # the input is computed in the step
    assert _pairs(SHARDED, outputs={"loss"}) == {}  # not an output of the program
    assert _pairs(SHARDED, carried={}) == {}  # not state
    assert _pairs(SHARDED, taken={"p.next"}) == {}  # a collective slot or the update's own in-place state
    assert _pairs(SHARDED, outputs={"p.next", "p"}) == {}  # the input also leaves the program


def _gpu_items(out, strategy):
    """Rank 0's step as the nccl backend cuts it, as carried_in_place's items, with the plan."""
    plan = load_plan(out)
    files = plan.graphs(0)
    model = onnx.load(str(out / files.step.name))
    cut = cut_graph(model, 0, "step", split_tail=True, native_domains={FUSED_UPDATE_DOMAIN},
                    late_domains={FUSED_UPDATE_DOMAIN}, collectives_inside=True)
    assert not cut.collectives, "the collectives run inside the sessions"
    items = [(list(item.inputs), list(item.outputs), not isinstance(item, CollectiveOp)) for item in cut.items]
    return items, cut, files


@pytest.mark.parametrize("strategy", ["allreduce", "sharded", "zero"])
def test_the_next_parameters_of_sharded_and_zero_are_written_in_place(strategy, model_dir, tmp_path):
    src = model_dir("gpt")
    out = tmp_path / "out"
    assert main(["compile", str(src / "model.onnx"), "--gpus", "2", "--strategy", strategy, "--optimizer", "adamw",
                 "--bucket-mb", "2", "-o", str(out)]) == 0
    items, cut, files = _gpu_items(out, strategy)
    carried = {s.output: s.input for s in files.state}
    pairs = carried_in_place(items, _readers(items), carried, set(cut.outputs), set(cut.inputs), set())
    params = {s.input for s in files.state if s.kind == "param"}
    assert params
    if strategy == "allreduce":
        # the fused update reads each parameter it writes: GpuProgram._in_place takes those
        assert not set(pairs.values()) & params
    else:
        assert set(pairs.values()) >= params, sorted(params - set(pairs.values()))[:5]
        for output, src in pairs.items():  # each written by a later item than every reader of its input
            at = next(pos for pos, (_, outputs, _) in enumerate(items) if output in outputs)
            assert all(pos < at for pos, (inputs, _, _) in enumerate(items) if src in inputs)
