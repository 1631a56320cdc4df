"""NcclCommunicator.close, checked without a GPU (stand-ins for CuPy's device and communicator):
the device is waited for, then every session that may have captured NCCL calls is dropped, and only
then is the NCCL communicator destroyed (NCCL will not destroy one that a live CUDA graph captured:
left to the garbage collector, a destroy before the sessions spun for ever); a program that is gone
is not kept alive for it; a destroy that does not return ends the close in bounded time."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from runtime.gpu import nccl as nccl_module
from runtime.gpu.nccl import NcclCommunicator


class _Program:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def release(self) -> None:
        self.log.append(("release", self.name))


def _communicator(log: list, destroy=None):
    device = SimpleNamespace(use=lambda: None, synchronize=lambda: log.append(("synchronize",)))
    comm = object.__new__(NcclCommunicator)  # no device: only what close uses
    comm.rank, comm.device = 1, 0
    comm.cp = SimpleNamespace(cuda=SimpleNamespace(Device=lambda _: device))
    comm.comm = SimpleNamespace(destroy=destroy or (lambda: log.append(("destroy",))))
    comm._stop, comm._watchdog, comm._before_destroy = threading.Event(), None, []
    return comm


def test_sessions_go_after_the_device_and_before_the_destroy():
    log: list = []
    comm = _communicator(log)
    step, init = _Program(log, "step"), _Program(log, "init")
    comm.before_destroy(step.release)
    comm.before_destroy(init.release)
    comm.close()
    assert log == [("synchronize",), ("release", "step"), ("release", "init"), ("destroy",)]
    comm.close()  # idempotent: nothing is released or destroyed twice
    assert len(log) == 4 and comm.comm is None


def test_a_program_that_is_gone_is_neither_kept_nor_called():
    log: list = []
    comm = _communicator(log)
    program = _Program(log, "gone")
    comm.before_destroy(program.release)
    del program
    comm.close()
    assert log == [("synchronize",), ("destroy",)]


def test_a_destroy_that_never_returns_ends_the_close_in_bounded_time(monkeypatch, capsys):
    monkeypatch.setattr(nccl_module, "DESTROY_WAIT_S", 0.2)
    # The helper's gc.collect() holds the interpreter lock for as long as this process's heap takes
    # (2.7 s once, late in the whole suite): the heap's time, not the wait this bounds.
    monkeypatch.setattr(nccl_module.gc, "collect", lambda *args: 0)
    stuck = threading.Event()
    comm = _communicator([], destroy=stuck.wait)
    started = time.monotonic()
    comm.close()
    assert time.monotonic() - started < 2.0
    assert "rank 1: the NCCL communicator was not destroyed within" in capsys.readouterr().err
    stuck.set()


def test_a_release_that_fails_leaves_the_communicator_undestroyed_and_says_why(capsys):
    class Broken(_Program):
        def release(self) -> None:
            raise RuntimeError("cudaErrorIllegalAddress")

    log: list = []
    comm = _communicator(log)
    program = Broken(log, "step")
    comm.before_destroy(program.release)
    comm.close()
    assert ("destroy",) not in log  # a graph may still hold it: NCCL's destroy would spin
    assert "rank 1: the NCCL communicator was not destroyed (RuntimeError: cudaErrorIllegalAddress)" in capsys.readouterr().err


def test_the_destroy_helper_thread_works_on_the_ranks_own_device():
    """close() destroys from a helper thread (bounded wait): that thread makes the rank's device
    current before its first CUDA call, or it would make the process a context on device 0."""
    log: list = []
    comm = _communicator(log)
    comm.device = 1
    comm.cp = SimpleNamespace(cuda=SimpleNamespace(Device=lambda index: SimpleNamespace(
        use=lambda: log.append(("use", index, threading.current_thread().name)),
        synchronize=lambda: log.append(("synchronize", threading.current_thread().name)))))
    comm.close()
    assert log[:2] == [("use", 1, "nccl-destroy"), ("synchronize", "nccl-destroy")] and log[-1] == ("destroy",)
