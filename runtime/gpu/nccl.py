"""NCCL through CuPy: flat-buffer collectives on a communication stream, a host side for bootstrap
and logging, and a watchdog that turns a hang into an error.

The unique id that every rank needs to join the NCCL communicator travels through the host group
(MPI bcast under mpiexec, the TCP bootstrap under torchrun: runtime/bootstrap.py); a world of one
needs none. Every NCCL call is enqueued on ``self.stream`` and returns at once; callers order it
against the compute stream with CUDA events.

Watchdog: the program registers each collective (or step) it enqueues with the time and an event
recorded after it. One not done after ``timeout`` seconds (``transpile run --timeout``; a peer died
or hangs: NCCL kernels spin forever), or an asynchronous NCCL error, and the watchdog aborts the
communicator (which unblocks the kernels), prints the rank and the collective, and exits the
process; under mpiexec the others then exit too (a rank that died outright is named by mpiexec).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

from runtime.bootstrap import HostGroup, MpiHost
from runtime.collectives.base import Communicator, check_reduction
from runtime.errors import RunError
from runtime.gpu.cuda import import_cupy, relax_capture_mode
from runtime.gpu.nccl_lists import ListsOverFlat
from runtime.gpu.nccl_types import bf16_divide, nccl_dtype

DEFAULT_TIMEOUT_S = 300.0  # transpile run's --timeout default, which the rank passes (one knob for every watchdog)
ABORT_WAIT_S = 3.0  # how long a failing rank waits for ncclCommAbort before it exits regardless
DESTROY_WAIT_S = 20.0  # how long close() waits for the device, the sessions' release and ncclCommDestroy


def join_nccl(nccl, host: HostGroup | None, rank: int, size: int, device: int):
    """The NCCL communicator of rank ``rank`` of ``size``: rank 0 makes the unique id, the host group
    (MPI, or the TCP bootstrap under torchrun: runtime/bootstrap.py) carries it to the others."""
    uid = nccl.get_unique_id() if rank == 0 else None
    if host is not None and size > 1:
        uid = host.bcast(uid, root=0)  # CuPy 14: bytes; older CuPy: a tuple of ints
        if isinstance(uid, list):  # through JSON, the older CuPy's tuple arrives as a list
            uid = tuple(uid)
    try:
        return nccl.NcclCommunicator(size, uid, rank)
    except Exception as exc:
        raise RunError(f"rank {rank}: NCCL communicator init failed on device {device}: {exc}") from None


def _within(seconds: float, target: Callable[[], None], name: str) -> bool:
    """Run ``target`` in a daemon thread; whether it returned within ``seconds`` (else it is left
    running: an NCCL call that never returns must not hold the rank)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def _keep_undestroyed(comm) -> None:
    """Never let CuPy's finalizer destroy ``comm``: one more reference that nothing drops. Its
    ncclCommDestroy could spin for ever while a CUDA graph that captured the communicator lives (or
    a peer never joins its last collective); the process's end frees it instead (as PyTorch's
    NCCLComm destructor leaves communicators it was not told to destroy)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(comm))


class NcclCommunicator(ListsOverFlat, Communicator):
    """Rank ``host.rank`` of ``host.size`` on CUDA device ``device``; ``host``: the ranks' host group
    (runtime/bootstrap.py; None for a world of one). ``connect()`` on every rank, then collectives."""

    def __init__(self, host: HostGroup | Communicator | None, device: int, *, timeout: float | None = None):
        self.cp = import_cupy()
        from cupy.cuda import nccl

        self._nccl = nccl
        if host is not None and not isinstance(host, HostGroup):
            host = MpiHost(host)  # an MpiCommunicator (the benchmarks, older callers)
        self.host = host
        self.rank = 0 if host is None else host.rank
        self.size = 1 if host is None else host.size
        self.device = device
        self.cp.cuda.Device(device).use()
        # The highest priority the device offers (as PyTorch's NCCL streams can have): a collective's
        # kernels are scheduled ahead of the backward's queued ones, so it starts as soon as its
        # bucket is ready instead of waiting for free SMs. (The default priority, PyTorch's default,
        # measured the same: GPT-2-small on 4 H200s 31.71 against 31.72 ms, run h200x4-s39.)
        # CUDA clamps a priority outside the device's range to the nearest valid one (Hopper: 0 to
        # -5, lower is higher), so the lowest int asks for the highest there is.
        self.stream = self.cp.cuda.Stream(non_blocking=True, priority=-(2**31))
        self.comm = None
        self.timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        self._inflight: dict[int, tuple[float, object, str]] = {}
        self._stop = threading.Event()
        self._abort_lock, self._inflight_lock = threading.Lock(), threading.Lock()
        self.relaxed: bool | None = None  # whether the watchdog thread runs in relaxed capture mode
        self._relaxed_known = threading.Event()
        self._aborted = False
        # Released before ncclCommDestroy (close), which polls until no CUDA graph that captured our
        # calls lives (left to the GC, it spun for ever: 4 H200s, 2 jobs of 4). Weak: programs may go.
        self._before_destroy: list[weakref.WeakMethod] = []
        self._watchdog: threading.Thread | None = None

    # -- setup ---------------------------------------------------------------------------------
    def connect(self) -> None:
        """Join the NCCL communicator (a collective over all ranks) and start the watchdog. A world
        of one makes none: each of its collectives leaves its buffer as it is (``_call``), and a
        one-rank NCCL communicator held 0.56 GiB of device memory (one H200), a fifth of
        ResNet-18's whole footprint."""
        # NVLink SHARP (multicast) can take a shared host's GPUs out of service: always off.
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        if self.size > 1:
            self.comm = join_nccl(self._nccl, self.host, self.rank, self.size, self.device)
        self._watchdog = threading.Thread(target=self._watch, name="nccl-watchdog", daemon=True)
        self._watchdog.start()
        # Programs decide whether to capture CUDA graphs from ``relaxed`` (GpuProgram): know it first.
        self._relaxed_known.wait(5.0)

    def before_destroy(self, release: Callable[[], None]) -> None:
        """Have ``close`` call ``release`` (a bound method) before it destroys the NCCL communicator."""
        self._before_destroy.append(weakref.WeakMethod(release))

    def close(self) -> None:
        """The end of the run on this rank (every rank calls it after its last collective): stop the
        watchdog; then, in a helper thread, wait for the device, drop what captured NCCL calls
        (``before_destroy``) and destroy the NCCL communicator, at most DESTROY_WAIT_S. Where that
        does not finish (a collective a failed peer never joined) or fails, the rank says so in one
        line and leaves the communicator undestroyed (``_keep_undestroyed``). Idempotent."""
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(ABORT_WAIT_S)  # it reads self.comm: done before the communicator goes
        comm, self.comm = self.comm, None
        if comm is None:
            return
        releases = [release for release in (ref() for ref in self._before_destroy) if release is not None]
        self._before_destroy, failed = [], []

        def destroy() -> None:
            try:
                self._on_own_device().synchronize()
                while releases:
                    releases.pop(0)()
                gc.collect()  # a session held in a reference cycle goes now, before the destroy
                comm.destroy()
            except Exception as exc:  # noqa: BLE001 - said below, in the rank's own words
                failed.append(f"({type(exc).__name__}: {exc})".splitlines()[0])

        if self._watchdog is not None and self._watchdog.is_alive():
            failed.append("(the watchdog did not stop)")  # it may still read the communicator: no destroy
        elif not _within(DESTROY_WAIT_S, destroy, "nccl-destroy"):
            failed.append(f"within {DESTROY_WAIT_S:.0f} s")
        if failed:
            _keep_undestroyed(comm)
            print(f"transpile: warning: rank {self.rank}: the NCCL communicator was not destroyed {failed[0]}; "
                  "it goes with the process", file=sys.stderr, flush=True)

    # -- watchdog ------------------------------------------------------------------------------
    def track(self, key, event, label: str) -> None:
        """``key`` (a collective's position, a step's key) is in flight from now until ``event`` happened."""
        with self._inflight_lock:
            self._inflight[key] = (time.monotonic(), event, label)

    def _on_own_device(self):
        """Make this rank's GPU the calling thread's current device. Every thread of ours that calls
        CUDA does this first: the CUDA runtime binds a thread's first call to the thread's current
        device, device 0 unless set, and creates that device's context for the process if it has
        none: a watchdog thread of rank r > 0 would put a second context (0.5 GiB) of its process on
        GPU 0 with its first event query. (On 2 H200s rank 0's GPU held 0.5 GiB more than rank
        1's and listed another process's 0.506 GiB, run h200x2-s55.) PyTorch's NCCL watchdog sets
        its device for the same reason."""
        device = self.cp.cuda.Device(self.device)
        device.use()
        return device

    def _watch(self) -> None:
        try:
            self._on_own_device()  # before any CUDA call of this thread (the event queries below)
        except Exception as exc:  # noqa: BLE001 - no hang detection without it: end the run, said
            self._fail(f"the NCCL watchdog cannot use device {self.device}: {exc}")
        self.relaxed = relax_capture_mode()  # this thread's event queries must not break a capture
        self._relaxed_known.set()
        while not self._stop.wait(1.0):
            now = time.monotonic()
            pending = []
            for key, entry in list(self._inflight.items()):
                started, event, label = entry
                if not event.done:
                    pending.append((started, label))
                    continue
                with self._inflight_lock:  # not the entry track() put there since (the next step's)
                    if self._inflight.get(key) is entry:
                        del self._inflight[key]
            oldest = min(pending, default=None)
            comm = self.comm  # once: close() may set it to None meanwhile
            try:
                if comm is not None:
                    comm.check_async_error()
            except Exception as exc:
                where = f" (in flight: {oldest[1]})" if oldest else ""
                self._fail(f"NCCL reported an error{where}: {exc}")
            if oldest is not None and now - oldest[0] > self.timeout:
                self._fail(f"{oldest[1]} did not complete within {self.timeout:.0f} s: a peer rank died or hangs "
                           "(see the other ranks' messages)")

    def _fail(self, message: str) -> None:
        print(f"transpile: error: rank {self.rank}: {message}; NCCL communicator aborted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # The exit must not depend on ncclCommAbort returning (on 2 H100s a job whose peer hung ran
        # past 120 s): abort from a helper thread, wait at most ABORT_WAIT_S, then exit; when this
        # process exits, the driver ends any of its kernels still spinning.
        _within(ABORT_WAIT_S, self._abort_quietly, "nccl-abort")
        os._exit(3)

    def _abort_quietly(self) -> None:
        """ncclCommAbort once: the watchdog and the main thread's abort() may both get here, and
        two concurrent aborts of one communicator are not safe."""
        with self._abort_lock:
            if self._aborted or self.comm is None:
                return
            self._aborted = True
            # A helper thread's (_within): not device 0's context. Where CUDA is too broken to
            # set it, the abort is still tried: it unblocks the peers' kernels.
            with contextlib.suppress(Exception):
                self._on_own_device()
            try:
                self.comm.abort()
            except Exception:  # noqa: BLE001 - already broken; the exit follows anyway
                pass

    # -- flat-buffer collectives (Communicator's flat interface), enqueued on self.stream -------
    def _call(self, label: str, method: str, *args) -> None:
        """The NCCL communicator's ``method`` on ``args`` and the communication stream."""
        if not self._launches():
            return  # one rank: the sum, mean, root's value, shard and gather of a buffer are the buffer
        try:
            getattr(self.comm, method)(*args, self.stream.ptr)
        except Exception as exc:  # cupy.cuda.nccl.NcclError, CUDARuntimeError
            raise RunError(f"rank {self.rank}: NCCL failed in {label}: {exc}") from None

    def all_reduce_flat(self, buf, label: str) -> None:
        self._call(label, "allReduce", buf.data.ptr, buf.data.ptr, buf.size,
                   nccl_dtype(self._nccl, buf.dtype), self._nccl.NCCL_SUM)

    # -- direct collectives: one tensor per call, out of place, one NCCL group per bucket ---------
    # (runtime/gpu/session_collectives.py: the session's own buffers, no bucket.) A mean is NCCL's
    # ncclAvg where CuPy has it: each input scaled by 1/size, then summed, which equals sum / size
    # exactly where size is a power of two and within one rounding elsewhere; else the sum, then
    # the division.
    def all_reduce_many(self, sends, recvs, mean: bool, label: str) -> None:
        """``recvs[i] = sum (or mean) over ranks of sends[i]`` on every rank."""
        if self._alone(sends, recvs):
            return
        op, divide = self._reduction(mean)
        self._group(label, "allReduce",
                    [(s.data.ptr, r.data.ptr, s.size, nccl_dtype(self._nccl, s.dtype), op) for s, r in zip(sends, recvs)])
        if divide:
            for recv in recvs:
                self.finish_mean(recv)

    def reduce_many(self, sends, recvs, root: int, mean: bool, label: str) -> None:
        """On ``root``, ``recvs[i] = sum (or mean) over ranks of sends[i]``; elsewhere ``recvs`` is
        empty and ``sends`` are only sent."""
        if self._alone(sends, recvs):
            return
        op, divide = self._reduction(mean)
        targets = recvs if self.rank == root else sends  # a non-root's receive buffer is not read
        self._group(label, "reduce", [(s.data.ptr, r.data.ptr, s.size, nccl_dtype(self._nccl, s.dtype), op, root)
                                      for s, r in zip(sends, targets)])
        if divide and self.rank == root:
            for recv in recvs:
                self.finish_mean(recv)

    def broadcast_many(self, sends, recvs, root: int, label: str) -> None:
        """``recvs[i] = root's sends[i]`` on every rank (only the root has ``sends``)."""
        if self._alone(sends, recvs):
            return
        sources = sends if self.rank == root else recvs  # a non-root's send buffer is not read
        self._group(label, "broadcast", [(s.data.ptr, r.data.ptr, r.size, nccl_dtype(self._nccl, r.dtype), root)
                                         for s, r in zip(sources, recvs)])

    def _reduction(self, mean: bool) -> tuple[int, bool]:
        """(NCCL op, whether a division must follow) for a sum or a mean."""
        avg = getattr(self._nccl, "NCCL_AVG", None) if mean else None
        return (avg, False) if avg is not None else (self._nccl.NCCL_SUM, mean)

    def _launches(self) -> bool:
        """Whether collectives go to NCCL (more than one rank); else a rank's result is its input."""
        return self.size > 1

    def _alone(self, sends, recvs) -> bool:
        """Where nothing launches, each result is the rank's own input (copied where both exist)."""
        if self._launches():
            return False
        for send, recv in zip(sends, recvs):
            with self.stream:
                recv[...] = send
        return True

    def _group(self, label: str, method: str, calls: list[tuple]) -> None:
        """``calls`` of the NCCL communicator's ``method`` as one group on the communication stream."""
        nccl = self._nccl
        try:
            nccl.groupStart()
            try:
                for args in calls:
                    getattr(self.comm, method)(*args, self.stream.ptr)
            finally:
                nccl.groupEnd()
        except Exception as exc:  # cupy.cuda.nccl.NcclError, CUDARuntimeError
            raise RunError(f"rank {self.rank}: NCCL failed in {label}: {exc}") from None

    def reduce_flat(self, buf, root: int, label: str) -> None:
        self._call(label, "reduce", buf.data.ptr, buf.data.ptr, buf.size,
                   nccl_dtype(self._nccl, buf.dtype), self._nccl.NCCL_SUM, root)

    def broadcast_flat(self, buf, root: int, label: str) -> None:
        self._call(label, "broadcast", buf.data.ptr, buf.data.ptr, buf.size,
                   nccl_dtype(self._nccl, buf.dtype), root)

    def reduce_scatter_flat(self, buf, label: str) -> None:
        """In place: rank r's result lands in ``buf[r*S:(r+1)*S]`` (``buf`` holds N*S elements)."""
        shard = buf.size // self.size
        self._call(label, "reduceScatter", buf.data.ptr, buf.data.ptr + self.rank * shard * buf.itemsize,
                   shard, nccl_dtype(self._nccl, buf.dtype), self._nccl.NCCL_SUM)

    def all_gather_flat(self, buf, label: str) -> None:
        """In place: rank r contributes ``buf[r*S:(r+1)*S]``; every rank ends with all N*S."""
        shard = buf.size // self.size
        self._call(label, "allGather", buf.data.ptr + self.rank * shard * buf.itemsize, buf.data.ptr,
                   shard, nccl_dtype(self._nccl, buf.dtype))

    def finish_mean(self, view) -> None:
        """``mean = sum / size`` in the tensor's dtype, on the communication stream (the contract's
        definition, as the CPU communicators compute it)."""
        if view.dtype == np.uint16:  # bfloat16's raw bits (nccl_types.nccl_dtype): divided in float32, rounded once
            with self.stream:
                bf16_divide(self.cp)(view, np.float32(self.size), view)
            return
        if view.dtype.kind != "f":
            raise RunError(f"reduction 'mean' needs a floating dtype, got {view.dtype}")
        with self.stream:
            view /= view.dtype.type(self.size)

    # -- host side -----------------------------------------------------------------------------
    def barrier(self):
        if self.host is not None:
            self.host.barrier()

    def allreduce_scalars(self, values, reduction="mean"):
        if self.host is None:
            check_reduction(reduction)
            return [float(v) for v in values]
        return self.host.allreduce_scalars(values, reduction)

    def abort(self, code):
        self._stop.set()
        self._abort_quietly()  # (already broken: the host abort below still ends every rank)
        if self.host is not None:
            self.host.abort(code)
