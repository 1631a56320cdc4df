"""The NCCL watchdog's view of a step whose collectives run inside its sessions, checked without a
GPU (stand-ins for the program's device, events and communicator): the step's entry is made
before its work is enqueued, so a host that blocks inside the step (a first call's run waiting
for a peer that died) still times out; the entry is done only once the whole step was enqueued
and the GPU passed its end."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from runtime.gpu import nccl as nccl_module
from runtime.gpu.nccl import NcclCommunicator
from runtime.gpu.program import GpuProgram


class _Event:
    def __init__(self):
        self.recorded, self.done = 0, True  # an event never recorded counts as happened (CUDA's rule)
        self.entry = None  # the watchdog entry that waits for this event, if the test sets it

    def record(self, stream=None) -> None:
        # Recorded before the entry says "enqueued": else, between the two, the entry would read
        # the previous step's record as this step's end.
        assert self.entry is None or not self.entry.enqueued
        self.recorded += 1


class _Comm:
    def __init__(self):
        self.tracked: dict = {}

    def track(self, key, event, label: str) -> None:
        self.tracked[key] = (event, label)


def _program(comm) -> SimpleNamespace:
    """What GpuProgram._watched reads of its program."""
    return SimpleNamespace(session_collectives=object(), comm=comm, step_done=_Event(),
                           device=SimpleNamespace(compute="compute"), cut=SimpleNamespace(where="rank 0's step"))


def test_the_entry_is_made_before_the_step_and_done_only_after_it():
    comm = _Comm()
    program = _program(comm)
    with GpuProgram._watched(program, "a step"):
        ((entry, label),) = comm.tracked.values()
        program.step_done.entry = entry
        assert not entry.done  # the event says done (last step's record), but this step is not enqueued yet
        assert program.step_done.recorded == 0
    assert program.step_done.recorded == 1 and entry.done
    program.step_done.done = False  # the GPU has not passed the step's end
    assert not entry.done
    assert label == "a step of rank 0's step (its collectives run inside its sessions)"


def test_a_cut_step_makes_no_step_entry():
    comm = _Comm()
    program = _program(comm)
    program.session_collectives = None  # its collectives are tracked one by one, between the sessions
    with GpuProgram._watched(program, "a step"):
        pass
    assert comm.tracked == {} and program.step_done.recorded == 0


class _PerThreadDevice:
    """CuPy's ``cuda.Device`` as CUDA keeps it: the current device is each thread's own, None until set."""

    def __init__(self):
        self.current = threading.local()
        self.cuda = SimpleNamespace(Device=self._device)

    def _device(self, index: int):
        return SimpleNamespace(use=lambda: setattr(self.current, "index", index))

    def of_this_thread(self):
        return getattr(self.current, "index", None)


def _watchdog_only(monkeypatch, timeout: float, stop) -> NcclCommunicator:
    """A communicator with no device: only what its watchdog (``_watch``) uses."""
    monkeypatch.setattr(nccl_module, "relax_capture_mode", lambda: True)
    comm = object.__new__(NcclCommunicator)
    comm.cp, comm.device = _PerThreadDevice(), 3
    comm.rank, comm.timeout, comm.comm = 0, timeout, None
    comm._inflight, comm._inflight_lock = {}, threading.Lock()
    comm._stop, comm._relaxed_known = stop, threading.Event()
    return comm


def test_a_done_entry_replaced_meanwhile_is_kept(monkeypatch):
    """The watchdog drops an entry it found done only if it is still the one in place: track() may
    have put the next step's there since (that entry is what watches a host blocked in that step)."""
    comm = _watchdog_only(monkeypatch, 1e9, _StopAfter(1))
    following = _Event()
    following.done = False

    class _Replaced(_Event):  # its query is where the next step's track() lands
        @property
        def done(self):
            comm.track("step", following, "step 2")
            return True

        @done.setter
        def done(self, _value):
            pass

    comm.track("step", _Replaced(), "step 1")
    comm._watch()
    assert comm._inflight["step"][1] is following


class _StopAfter:
    """A stop event whose wait() lets the watchdog loop run ``n`` times."""

    def __init__(self, n: int):
        self.n = n

    def wait(self, _seconds: float) -> bool:
        self.n -= 1
        return self.n < 0


def test_a_step_that_blocks_the_host_times_out(monkeypatch):
    """The watchdog fails a step whose enqueueing never returns, within its timeout."""
    failed: list[str] = []
    comm = _watchdog_only(monkeypatch, 0.2, threading.Event())
    comm._fail = failed.append
    watchdog = threading.Thread(target=comm._watch, daemon=True)
    watchdog.start()
    program = _program(comm)
    stuck = threading.Event()

    def step() -> None:
        with GpuProgram._watched(program, "the first step"):
            stuck.wait(10)  # a run that waits for NCCL kernels a dead peer never joins

    host = threading.Thread(target=step, daemon=True)
    started = time.monotonic()
    host.start()
    while not failed and time.monotonic() - started < 5:
        time.sleep(0.05)
    comm._stop.set()
    stuck.set()
    assert failed and failed[0].startswith("the first step of rank 0's step (its collectives run inside its "
                                           "sessions) did not complete within 0 s")
    assert time.monotonic() - started < 4.5  # the watchdog looks once a second; the loop above gives up at 5


def test_the_watchdog_thread_calls_cuda_on_the_ranks_own_device(monkeypatch):
    """Its first CUDA call (the capture mode) and its event queries run with the rank's device
    current in the watchdog's own thread: a thread's first CUDA call on no device set binds device
    0 and makes the process a context there (0.5 GiB of GPU 0's memory per rank)."""
    comm = _watchdog_only(monkeypatch, 1e9, _StopAfter(1))
    seen: list = []
    monkeypatch.setattr(nccl_module, "relax_capture_mode", lambda: seen.append(comm.cp.of_this_thread()) or True)

    class _Queried(_Event):
        @property
        def done(self):
            seen.append(comm.cp.of_this_thread())
            return False

        @done.setter
        def done(self, _value):
            pass

    comm.track("step", _Queried(), "step 1")
    watchdog = threading.Thread(target=comm._watch, daemon=True)
    watchdog.start()
    watchdog.join(5)
    assert seen == [3, 3]
    assert comm.cp.of_this_thread() is None  # set in the watchdog's thread, not this one's


class _BrokenDevice:
    """CuPy whose device cannot be made current (CUDA broken, as on the way to an abort)."""

    def __init__(self):
        self.cuda = SimpleNamespace(Device=self._device)

    def _device(self, index: int):
        def use():
            raise RuntimeError(f"cudaErrorLaunchFailure on device {index}")
        return SimpleNamespace(use=use)


def test_the_abort_runs_where_the_device_cannot_be_set():
    """The abort unblocks the peers' kernels: a device that cannot be made current skips nothing."""
    aborted: list[bool] = []
    comm = object.__new__(NcclCommunicator)
    comm.cp, comm.device, comm._aborted = _BrokenDevice(), 1, False
    comm._abort_lock = threading.Lock()
    comm.comm = SimpleNamespace(abort=lambda: aborted.append(True))
    comm._abort_quietly()
    assert aborted == [True] and comm._aborted
    comm._abort_quietly()  # once only
    assert aborted == [True]


def test_a_watchdog_that_cannot_use_its_device_ends_the_run_saying_so(monkeypatch):
    failed: list[str] = []
    comm = _watchdog_only(monkeypatch, 1e9, _StopAfter(0))
    comm.cp = _BrokenDevice()
    comm._fail = failed.append
    comm._watch()
    assert failed == ["the NCCL watchdog cannot use device 3: cudaErrorLaunchFailure on device 3"]
