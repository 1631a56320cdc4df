"""The early update (runtime/variables.py EARLY_UPDATE, an experiment until a 4-GPU run measures it):
with the collectives inside the sessions, the fused updates of every bucket but the last start on a
side stream once the last-but-one collective is finished, beside the last one.

- session_collectives marks the finish of the last-but-one collective ``early`` (with ``late``, the
  last one's order) exactly where only finishes follow it, on the transpiled GPT of two ranks under
  ``allreduce`` and ``sharded``, and never where a plain node follows or fewer than two collectives are;
- FusedUpdateRunner.split runs the updates that read none of the last collective's outputs on the
  side stream after the finish's event and the rest on the compute stream, which then waits for the
  side stream; the outputs equal the unsplit runner's bit for bit (the kernel source compiled on the
  host, tests/test_fused_update_host.py).

The GPU program's use of them (program.py ``_split_update``, the external event record) needs a GPU.
"""

from __future__ import annotations

import types
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from conftest import load_data
from onnx import helper
from test_fused_update_host import host_cupy, library  # noqa: F401 - library is a fixture
from test_gpu_fused_update import SHAPES, _group
from test_optimizer import CASES

import runtime.gpu.cuda as gpu_cuda
from commands.main import main
from contract.ops import FUSED_UPDATE_DOMAIN
from runtime.gpu.buffers import pack_buffers, value_lifetimes
from runtime.gpu.compile import SessionCollectives, Specialize, compile_segment
from runtime.gpu.session_collectives import DOMAIN, FINISH, START, FinishRunner, Registry, _mark_early_finish
from runtime.gpu.update_kernel import FusedUpdateRunner
from runtime.plan import load_plan
from runtime.segments import cut_graph


def _attrs(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: a.i for a in node.attribute}


def _finish(k: int) -> onnx.NodeProto:
    return helper.make_node(FINISH, [f"t{k}"], [f"g{k}"], domain=DOMAIN, bucket=k)


def _plain(name: str) -> onnx.NodeProto:
    return helper.make_node("Relu", [f"{name}.in"], [name])


@pytest.mark.parametrize(("order", "marked"), [
    (["a", "f0", "f1", "f2"], 1),  # only finishes after the last-but-one: marked
    (["a", "f0", "f1", "b", "f2"], None),  # a plain node after it: the updates could race it
    (["a", "f0", "f2", "f1"], 1),  # the last one's finish may come first: still all that follows is finishes
    (["a", "f1", "f0", "f2"], None),  # an earlier collective's finish after it: its bucket not yet final
])
def test_the_last_but_one_finish_is_marked_where_only_finishes_follow(order, marked):
    finishes = [_finish(k) for k in range(3)]
    nodes = {"a": _plain("a"), "b": _plain("b"), **{f"f{k}": f for k, f in enumerate(finishes)}}
    _mark_early_finish([nodes[n] for n in order], finishes, [0, 1, 2], "token2", ["a", "b"])
    early = [k for k, f in enumerate(finishes) if _attrs(f).get("early")]
    assert early == ([] if marked is None else [marked])
    if marked is not None:
        assert _attrs(finishes[marked])["late"] == 2
        # it runs after the last start and after every sink, whatever order onnxruntime picks
        assert list(finishes[marked].input) == [f"t{marked}", "token2", "a", "b"]
    else:
        assert all(len(f.input) == 1 for f in finishes)


def test_one_collective_marks_nothing():
    finish = _finish(0)
    _mark_early_finish([_plain("a"), finish], [finish], [0], "token0", ["a"])
    assert "early" not in _attrs(finish) and list(finish.input) == ["t0"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["allreduce", "sharded"])
def test_the_transpiled_step_marks_its_last_but_one_finish(strategy, model_dir, tmp_path):
    src = model_dir("gpt")
    out = tmp_path / "out"
    assert main(["compile", str(src / "model.onnx"), "--gpus", "2", "--strategy", strategy, "--bucket-mb", "2",
                 "-o", str(out)]) == 0
    plan = load_plan(out)
    model = onnx.load(str(out / plan.graphs(0).step.name))
    data = load_data(src / "data.npz")
    feeds = {**{k: v[:4] for k, v in data.items()}, plan.lr_input: np.array(1e-3, np.float32)}
    feeds.update({i.name: np.zeros([d.dim_value for d in i.type.tensor_type.shape.dim], np.float32)
                  for i in model.graph.input if i.name not in feeds})
    # as on a GPU: the fused updates run between the sessions, after the step's one segment
    cut = cut_graph(model, 0, "step", native_domains=[FUSED_UPDATE_DOMAIN], late_domains=[FUSED_UPDATE_DOMAIN],
                    collectives_inside=True)
    segment = cut.segments[0]
    shapes = {name: tuple(np.shape(feeds[name])) for name in segment.inputs}
    plain = compile_segment(segment, shapes, "step", [Specialize(), SessionCollectives(Registry())], frozenset())
    assert not any(_attrs(n).get("early") for n in plain.model.graph.node)  # the variable unset: as before
    registry = Registry()
    registry.record_external = lambda event, stream: None  # as with the variable set on a GPU
    compiled = compile_segment(segment, shapes, "step", [Specialize(), SessionCollectives(registry)], frozenset())
    nodes = list(compiled.model.graph.node)
    orders = sorted(_attrs(n)["bucket"] for n in nodes if n.domain == DOMAIN and n.op_type == START)
    assert len(orders) >= 2, "the bucket cap should have made several buckets"
    early = [i for i, n in enumerate(nodes) if n.domain == DOMAIN and _attrs(n).get("early")]
    assert len(early) == 1
    node = nodes[early[0]]
    assert node.op_type == FINISH and _attrs(node)["bucket"] == orders[-2] and _attrs(node)["late"] == orders[-1]
    assert all(n.domain == DOMAIN and n.op_type == FINISH for n in nodes[early[0] + 1:])
    last_start = next(n for n in nodes if n.domain == DOMAIN and n.op_type == START and _attrs(n)["bucket"] == orders[-1])
    assert last_start.output[0] in node.input  # a data dependency on the last start, not only a place in the order
    loss = [o.name for o in compiled.model.graph.output if "loss" in o.name]
    assert loss and set(loss) <= set(node.input)  # and on the sinks (the loss is computed by plain nodes)


class _Stream:
    """A stand-in stream: what is asked of it, in order, in ``log``."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append((self.name, "wait", event.name))

    def __enter__(self):
        self.log.append((self.name, "enter"))
        return self

    def __exit__(self, *exc):
        self.log.append((self.name, "exit"))


class _Event:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def record(self, stream):
        self.log.append((stream.name, "record", self.name))


@pytest.mark.parametrize("late_count", [2, 0])  # 0: a rank none of whose updates reads the last collective
def test_split_updates_run_early_on_the_side_stream_and_compute_the_same(late_count, library, monkeypatch):  # noqa: F811
    monkeypatch.setattr(gpu_cuda, "_MODULES", {})  # never mix the host module with a real GPU's
    cp = host_cupy(library)
    config = CASES["adamw"].validate()
    group, ops = _group(config)
    log: list = []
    compute = _Stream("compute", log)
    plain = FusedUpdateRunner(group, "test", types.SimpleNamespace(cp=cp))
    split = FusedUpdateRunner(group, "test", types.SimpleNamespace(cp=cp, compute=compute))
    late = {op.grad for op in ops[len(ops) - late_count:]}  # the last collective's outputs
    every = {op.grad for op in ops}
    events = lambda: (_Event("ready", log), _Stream("side", log), _Event("done", log))  # noqa: E731
    assert "every update reads" in split.split(every, *events())  # none early
    assert split.early_outputs() == set()
    assert split.split(late, *events()) is None
    cut = len(ops) - late_count
    assert split.early_outputs() == {name for op in ops[:cut] for name in op.outputs}
    assert [op.param for launch in split.early for op in launch.ops] == [op.param for op in ops[:cut]]
    assert [op.param for launch in split.launches for op in launch.ops] == [op.param for op in ops[cut:]]
    rng = np.random.default_rng(0)
    host = {}
    for op, shape in zip(ops, SHAPES):
        host[op.param] = rng.standard_normal(shape).astype(np.float32)
        host[op.grad] = rng.standard_normal(shape).astype(np.float32)
        for slot in op.slots:
            host[slot] = rng.standard_normal(shape).astype(np.float32) ** 2
    host["lr"] = np.array(np.float32(1e-3))
    host[ops[0].step] = np.array(np.float32(3))
    results = []
    for runner in (plain, split):
        feeds = {name: cp.asarray(host[name]) for name in group.inputs}
        outs = {name: cp.empty_like(feeds[src]) for op in ops for src, name in zip((op.param, *op.slots), op.outputs)}
        runner.prepare(1, outs)
        log.clear()
        runner.run_bound(1, feeds)
        results.append({name: np.array(v) for name, v in outs.items()})
    assert log == [("side", "wait", "ready"), ("side", "enter"), ("side", "exit"), ("side", "record", "done"),
                   ("compute", "enter"), ("compute", "exit"), ("compute", "wait", "done")]
    for name, value in results[0].items():
        np.testing.assert_array_equal(results[1][name], value, err_msg=name)


def test_an_early_output_in_the_block_never_shares_bytes_with_the_session_it_runs_beside():
    """The block of values between items (buffers.value_lifetimes, pack_buffers): an update at
    position 2 whose output ``u`` the session at 3 reads. Run after session 1, ``u`` may take the
    bytes of ``h`` (session 0 -> session 1, dead after 1); split to run beside session 1 it must not
    (under `sharded`/`zero` such outputs are the new parameters on their way to the Broadcasts)."""
    items = [(["h"], True), (["g"], True), (["u"], True), (["loss"], True)]
    readers = {"h": [1], "g": [2], "u": [3]}
    nbytes = {"h": 1024, "g": 1024, "u": 1024, "loss": 4}
    for early, apart in (({}, False), ({2: {"u"}}, True)):
        lifetimes = value_lifetimes(items, readers, nbytes, {"loss"}, {}, early)
        assert ("u", 1024, 1 if early else 2, 3) in lifetimes
        offsets, _ = pack_buffers(lifetimes)
        assert (offsets["u"] != offsets["h"]) is apart


def test_an_early_finish_registers_under_its_session_and_only_with_the_variable():
    """Under sharded both the Reduces' session and the Broadcasts' mark one: the program pairs each
    with the update right after its own session (program.py ``_split_update``), so they are kept apart."""
    device = SimpleNamespace(cp=SimpleNamespace(cuda=SimpleNamespace(Event=lambda disable_timing: object())), compute=None)
    early = helper.make_node(FINISH, ["t1"], [], domain=DOMAIN, bucket=1, direct=1, early=1, late=2)
    other = helper.make_node(FINISH, ["t4"], [], domain=DOMAIN, bucket=4, direct=1, early=1, late=5)
    plain = helper.make_node(FINISH, ["t0"], [], domain=DOMAIN, bucket=0, direct=1)
    off = Registry()
    assert off.record_external is None  # the variable unset
    FinishRunner(early, "step: segment 0", device, off)
    assert off.early == {}
    on = Registry()
    on.record_external = lambda event, stream: None
    for node, where in ((early, "step: segment 0"), (other, "step: segment 2"), (plain, "step: segment 0")):
        FinishRunner(node, where, device, on)
    assert {where: e.late for where, e in on.early.items()} == {"step: segment 0": 2, "step: segment 2": 5}


@pytest.mark.parametrize(("status", "flags"), [(1, 1), (0, 0)])
def test_the_event_is_recorded_external_only_while_its_stream_is_capturing(status, flags, monkeypatch):
    """CU_EVENT_RECORD_EXTERNAL is invalid outside a capture: the first, uncaptured runs record plainly."""
    import ctypes

    calls = []

    class _Driver:
        def cuStreamIsCapturing(self, stream, out):  # noqa: N802 - the driver's name
            ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = status
            return 0

        def cuEventRecordWithFlags(self, event, stream, flags):  # noqa: N802
            calls.append((event, stream, flags))
            return 0

    driver = _Driver()
    for name in ("cuStreamIsCapturing", "cuEventRecordWithFlags"):
        setattr(driver, name, _Callable(getattr(driver, name)))
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver)
    record = gpu_cuda.external_record()
    record(SimpleNamespace(ptr=11), SimpleNamespace(ptr=22))
    assert calls == [(11, 22, flags)]


def test_a_failed_record_is_an_error_not_a_silent_race(monkeypatch):
    import ctypes

    driver = SimpleNamespace(cuStreamIsCapturing=_Callable(lambda stream, out: 0),
                             cuEventRecordWithFlags=_Callable(lambda event, stream, flags: 1))
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver)
    with pytest.raises(RuntimeError, match="CUresult 1"):
        gpu_cuda.external_record()(SimpleNamespace(ptr=1), SimpleNamespace(ptr=2))


class _Callable:
    """A stand-in ctypes function: takes argtypes/restype like one, calls ``fn`` with the raw arguments."""

    def __init__(self, fn):
        self.fn, self.argtypes, self.restype = fn, None, None

    def __call__(self, *args):
        return self.fn(*args)
