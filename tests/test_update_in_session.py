"""The fused optimizer updates inside the step's session (runtime/gpu/in_session.py): a bucket's
updates are one custom op that runs after its collective's finish, while later buckets' collectives
are in flight; which of its outputs the program may bind over their inputs (``safe_in_place``); and
the steps whose collectives publish what the updates write (`sharded`, `zero`) keep them between
sessions (GpuBackend.prepare_step_graph). CPU: the ops are built, not run (test_native_plan.py runs
one rank's update inside a CPU session)."""

from __future__ import annotations

from types import SimpleNamespace

import onnx
import pytest
from conftest import one_graph_model
from onnx import TensorProto, helper

from commands.main import main
from contract.ops import FUSED_UPDATE_DOMAIN
from runtime.collectives import LocalGroup, publishes_updates
from runtime.gpu.compile import SessionCollectives, Specialize, TakeNativeNodes, compile_segment
from runtime.gpu.in_session import DOMAIN, grouped_runs, safe_in_place, take_native_nodes
from runtime.gpu.session_collectives import DOMAIN as COLLECTIVES_DOMAIN
from runtime.gpu.session_collectives import FINISH, START, Registry
from runtime.gpu.update_kernel import FusedUpdateRunner
from runtime.plan import load_plan
from runtime.segments import cut_graph
from runtime.specialize import specialize
from runtime.update_reference import UpdateOp

_DEVICE = SimpleNamespace(provider="CUDAExecutionProvider")


class _Updates:
    """A runner of a run of update nodes, as take_native_nodes asks for one: every state output may
    overwrite its input, as FusedUpdateRunner.in_place_pairs says."""

    def __init__(self, group, where):
        self.nodes = group.nodes
        self.ops = [UpdateOp.from_node(node, where) for node in group.nodes]

    in_place_pairs = FusedUpdateRunner.in_place_pairs


def _runner(group, where):
    if group.nodes[0].domain == FUSED_UPDATE_DOMAIN:
        return _Updates(group, where)
    return object()  # a start or a finish: built, not run


def _compiled_step(out, rank: int, world: int):
    """Rank ``rank``'s step segment through the GPU's passes up to the custom ops, the
    collectives and the updates inside (zeros for the data: only the shapes matter)."""
    plan = load_plan(out)
    model = onnx.load(str(out / plan.graphs(rank).step.name))
    cut = cut_graph(model, rank, "step", collectives_inside=True)
    (segment,) = cut.segments  # the updates are no native stage: one session
    feeds = {i.name: tuple(d.dim_value or 4 for d in i.type.tensor_type.shape.dim) for i in model.graph.input}
    registry = Registry()
    registry.comm = LocalGroup(world).communicator(rank)
    passes = [Specialize(registry), SessionCollectives(registry), TakeNativeNodes(_runner, _DEVICE)]
    inside = frozenset({FUSED_UPDATE_DOMAIN, COLLECTIVES_DOMAIN})
    return compile_segment(segment, {n: feeds[n] for n in segment.inputs}, "step", passes, inside)


@pytest.fixture(scope="module")
def allreduce_out(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("update_inside") / "out"
    # A small bucket cap: the 4-layer GPT's gradients in several buckets.
    assert main(["compile", str(model_dir("gpt") / "model.onnx"), "--gpus", "2", "--strategy", "allreduce",
                 "--bucket-mb", "0.05", "-o", str(path)]) == 0
    return path


def test_each_buckets_updates_are_one_op_after_its_finish_and_after_the_last_start(allreduce_out):
    compiled = _compiled_step(allreduce_out, 0, 2)
    nodes = list(compiled.model.graph.node)
    kinds = {op.name: op for op in compiled.custom_ops}
    fused = [i for i, n in enumerate(nodes) if n.domain == DOMAIN and n.op_type in kinds
             and isinstance(kinds[n.op_type].compute.runner, _Updates)]
    finishes = [i for i, n in enumerate(nodes) if n.domain == DOMAIN and n.op_type.startswith(FINISH)]
    starts = [i for i, n in enumerate(nodes) if n.domain == DOMAIN and n.op_type.startswith(START)]
    assert len(finishes) > 2, "the bucket cap should give several buckets"
    # One op per bucket: each fused node reads the outputs of exactly one finish, the one just before it.
    assert len(fused) == len(finishes)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    last_token = nodes[starts[-1]].output[0]
    updated = set()
    for i in fused:
        read_finishes = {producer[n] for n in nodes[i].input if producer.get(n) in finishes}
        assert read_finishes == {i - 1}, nodes[i].name
        # After every start: every gradient (and every reader of a weight in the backward) comes first.
        assert last_token in nodes[i].input and i > starts[-1]
        updated.update(n.input[0] for n in kinds[nodes[i].op_type].compute.runner.nodes)
    assert not [n for n in nodes if n.domain == FUSED_UPDATE_DOMAIN]
    # Every parameter and slot may be updated in place: the token makes each reader an ancestor.
    pairs = {out: src for i in fused for out, src in kinds[nodes[i].op_type].compute.in_place.items()}
    state = [i.name for i in compiled.model.graph.input if i.name.endswith(("weight", "bias")) or i.name == "wpe"]
    assert set(state) <= updated and set(state) <= set(pairs.values())


def _weight_read_twice(token: bool):
    """W read by the forward (y = x W, whose gradient dW the update reads) and by the backward of
    the layer before (dx = dy W^T, which no update needs): the shape of a bucket's boundary."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="forward"),
             helper.make_node("Mul", ["y", "y"], ["dW"], name="grad"),
             helper.make_node("Transpose", ["W"], ["Wt"], name="dx.t"),
             helper.make_node("MatMul", ["dy", "Wt"], ["dx"], name="dx")]
    if token:
        nodes.append(helper.make_node("Identity", ["dx"], ["token"], name="start"))
    update_inputs = ["W", "dW"] + (["token"] if token else [])
    nodes.append(helper.make_node("Update", update_inputs, ["W.next"], name="update", domain=FUSED_UPDATE_DOMAIN))
    value = lambda n: helper.make_tensor_value_info(n, f, [2, 2])  # noqa: E731
    return one_graph_model(nodes, [value("x"), value("W"), value("dy")], [value("W.next"), value("dx")]), update_inputs


@pytest.mark.parametrize("token", [False, True])
def test_a_weight_the_backward_reads_after_its_update_could_run_is_not_updated_in_place(token):
    model, inputs = _weight_read_twice(token)
    nodes = list(model.graph.node)
    got = safe_in_place(nodes, {len(nodes) - 1}, inputs, {"W.next": "W"}, {"x", "W", "dy"})
    # Without the token nothing orders dx before the update; with it, dx is an ancestor.
    assert got == ({"W.next": "W"} if token else {})


def test_only_a_graph_input_is_written_over():
    model, inputs = _weight_read_twice(True)
    nodes = list(model.graph.node)
    assert safe_in_place(nodes, {len(nodes) - 1}, inputs, {"W.next": "dW"}, {"x", "W", "dy"}) == {}


@pytest.mark.parametrize("strategy,publishes", [("allreduce", False), ("sharded", True), ("zero", True)])
def test_the_steps_that_publish_the_updates_are_known_alike_on_every_rank(model_dir, tmp_path, strategy, publishes):
    out = tmp_path / "out"
    assert main(["compile", str(model_dir("gpt") / "model.onnx"), "--gpus", "4", "--strategy", strategy,
                 "-o", str(out)]) == 0
    plan = load_plan(out)
    got = [publishes_updates(onnx.load(str(out / plan.graphs(r).step.name), load_external_data=False))
           for r in range(4)]
    assert got == [publishes] * 4


def _fp16_like_updates():
    """Two updates, each followed by a Where that reads its output (--precision fp16's skip of an
    overflowing step), then a finish, then a third update of the finish's gradient."""
    f = TensorProto.FLOAT
    upd = lambda p, g: helper.make_node("SGD", [p, g, "lr"], [f"{p}.next"], name=f"{p}.sgd",  # noqa: E731
                                        domain=FUSED_UPDATE_DOMAIN, weight_decay=0.0)
    skip = lambda p: helper.make_node("Where", ["skipped", p, f"{p}.next"], [f"{p}.kept"], name=f"{p}.where")  # noqa: E731
    nodes = [upd("a", "ga"), skip("a"), upd("b", "gb"), skip("b"),
             helper.make_node("Identity", ["gc0"], ["gc"], name="finish"), upd("c", "gc"), skip("c")]
    value = lambda n: helper.make_tensor_value_info(n, f, [2])  # noqa: E731
    model = one_graph_model(nodes, [value(n) for n in ("a", "b", "c", "ga", "gb", "gc0", "lr")]
                            + [helper.make_tensor_value_info("skipped", TensorProto.BOOL, [])],
                            [value(f"{p}.kept") for p in "abc"])
    model.graph.value_info.extend(value(f"{p}.next") for p in "abc")  # the updates' outputs, typed
    model.opset_import.append(helper.make_opsetid(FUSED_UPDATE_DOMAIN, 1))
    return model


def test_a_run_of_updates_passes_over_nodes_that_only_read_it_and_ends_where_an_input_is_made():
    nodes = list(_fp16_like_updates().graph.node)
    updates = [k for k, n in enumerate(nodes) if n.domain == FUSED_UPDATE_DOMAIN]
    # The Wheres between read the run's outputs (they follow the fused op); the third update's
    # gradient is made after the run began (by the finish): a run of its own.
    assert grouped_runs(updates, nodes) == [[0, 2], [5]]


def _view_read_late(aliasing: str):
    """W's view (``aliasing`` of it) read by the gradient (an ancestor of the update) and by a node
    that is not an ancestor."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node(aliasing, ["W"], ["W.view"], name="view"),
             helper.make_node("MatMul", ["x", "W.view"], ["dW"], name="grad"),
             helper.make_node("Neg", ["W.view"], ["late"], name="late"),
             helper.make_node("Update", ["W", "dW"], ["W.next"], name="update", domain=FUSED_UPDATE_DOMAIN)]
    value = lambda n: helper.make_tensor_value_info(n, f, [2, 2])  # noqa: E731
    return list(one_graph_model(nodes, [value("x"), value("W")], [value("W.next"), value("late")]).graph.node)


@pytest.mark.parametrize("aliasing,in_place", [("Identity", False), ("Transpose", False), ("Neg", True)])
def test_a_reader_of_a_view_of_the_weight_counts_as_a_reader(aliasing, in_place):
    # Through an Identity (a view of W's buffer on the CUDA EP) or a Transpose (onnxruntime may fuse
    # it into its reader, which then reads W), the late Neg reads W after the update could write it;
    # through a Neg, a copy, it does not.
    nodes = _view_read_late(aliasing)
    got = safe_in_place(nodes, {3}, ["W", "dW"], {"W.next": "W"}, {"x", "W"})
    assert got == ({"W.next": "W"} if in_place else {})


@pytest.mark.parametrize("finish_is_ancestor", [False, True])
def test_a_collective_start_reads_its_input_until_its_finish(finish_is_ancestor):
    f = TensorProto.FLOAT
    start = helper.make_node(START, ["W"], ["token"], name="start", domain=COLLECTIVES_DOMAIN, bucket=0)
    finish = helper.make_node(FINISH, ["token"], ["sent"], name="finish", domain=COLLECTIVES_DOMAIN, bucket=0)
    grad = helper.make_node("Neg", ["token"] + (["sent"] if finish_is_ancestor else []), ["dW"], name="grad")
    update = helper.make_node("Update", ["W", "dW"], ["W.next"], name="update", domain=FUSED_UPDATE_DOMAIN)
    nodes = [start, finish, grad, update] if finish_is_ancestor else [start, grad, update, finish]
    value = lambda n: helper.make_tensor_value_info(n, f, [2])  # noqa: E731
    nodes = list(one_graph_model(nodes, [value("W")], [value("W.next"), value("sent")]).graph.node)
    got = safe_in_place(nodes, {nodes.index(update)}, ["W", "dW"], {"W.next": "W"}, {"W"})
    assert got == ({"W.next": "W"} if finish_is_ancestor else {})


def test_updates_whose_outputs_a_node_of_the_session_reads_are_fused_but_never_in_place():
    model = specialize(_fp16_like_updates(), {**{n: (2,) for n in ("a", "b", "c", "ga", "gb", "gc0", "lr")}, "skipped": ()})
    rewritten, ops = take_native_nodes(model, {FUSED_UPDATE_DOMAIN}, _runner, _DEVICE, "step", (0, 0, 0))
    assert [len(op.compute.runner.nodes) for op in ops] == [2, 1] and all(op.compute.in_place == {} for op in ops)
    made = set(i.name for i in rewritten.graph.input)
    for node in rewritten.graph.node:  # still a topological order
        assert set(node.input) <= made, node.name
        made.update(node.output)


@pytest.mark.parametrize("launches", [0, 1, 2])
def test_a_capture_call_must_capture_each_in_place_update_once(launches):
    """onnxruntime runs a parity's first graph run several times in one call; an op that writes state
    in place launches only while capturing, and anything but one such launch is an error."""
    from runtime.errors import RunError
    from runtime.gpu.in_session import capture_call

    kernel = SimpleNamespace(in_place={"W.next": "W"}, node_name="W.sgd", capture_call=False, captured_launches=0)
    other = SimpleNamespace(in_place={}, capture_call=False)  # computes its outputs again: not gated
    ops = [SimpleNamespace(compute=kernel), SimpleNamespace(compute=other)]

    def run():
        with capture_call(ops, "rank0.onnx: segment 0: step parity 1"):
            assert kernel.capture_call and not other.capture_call
            kernel.captured_launches += launches
    if launches == 1:
        run()
    else:
        with pytest.raises(RunError, match=rf"step parity 1: onnxruntime's capture ran 'W.sgd' {launches} times"):
            run()
    assert not kernel.capture_call
