"""Ranks that never outlive their job and never hang: parent-death signals, a parent-liveness
check and a collective timeout for every backend (the GPU one has its own NCCL watchdog as well,
bounded by the same ``--timeout``).

- ``set_parent_death_signal``: prctl(PR_SET_PDEATHSIG, SIGKILL) through libc (Linux; a no-op
  elsewhere). ``transpile run`` sets it in mpiexec, each rank we spawn in itself: when the parent
  dies, however it dies (kill -9, the OOM killer), the kernel kills the child.
- ``Watchdog`` (a daemon thread per rank), started before the rank joins the others (MPI
  initialization, the torch-style bootstrap) and armed until after MPI finalization, so a peer
  that stops at any stage of the rank's life (start-up, a step, a checkpoint, evaluation, export,
  shutdown) cannot hang it:
  - kills the rank when the ``transpile run`` that spawned it is gone (its pid and start time, the
    ``parent`` token of the rank's RunConfig: runtime/config.py), so no rank outlives it even if
    mpiexec's process tree does not pass the death on;
  - writes a heartbeat file (``run_dir``/rank{r}.beat, the RunConfig's run directory: pid, step,
    phase) once every half second, from its first moment, from which a rank that times out, and
    ``transpile run`` (runtime/supervisor.py), name the rank that stopped or died;
  - stops the job when the rank has made no progress (no step, no checkpoint phase, no stage of
    start-up or shutdown) for ``timeout`` seconds (``--timeout``): a collective whose peer stopped
    (SIGSTOP), died under an outside launcher, or runs another number of steps never returns. The
    lowest rank still alive prints the one line naming the ranks that did not arrive; every rank
    then exits with status 1 (MPI_Abort under an outside launcher). The check costs nothing per
    step (the loop stores an int and a float).
- How a spawned rank ends is written into ``run_dir`` for ``transpile run``, which cannot wait for
  processes that are not its children: ``rank{r}.exit`` (``exit CODE`` before the rank exits by
  itself, ``signal N`` when a terminating signal reached it: the signal is recorded, then the rank
  dies of it as it would have) and ``rank{r}.fault`` (Python's faulthandler: a crash in native
  code). A rank that ends with neither was killed by SIGKILL, the one signal nothing can record.
  Each spawned rank also keeps a connection to ``run_dir``/lifeline.sock open: its end tells
  ``transpile run`` of the rank's death before the launcher can kill the others.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import fcntl
import os
import resource
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

LIFELINE = "lifeline.sock"  # in run_dir: transpile run listens, each spawned rank keeps a connection open
STALE_S = 3.0  # a heartbeat older than this: the rank is not running (stopped, hung in C, dead)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# Terminating signals a spawned rank records before dying of them (SIGKILL cannot be caught; the
# crashes, SIGSEGV and the like, are faulthandler's).
RECORDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                    signal.SIGALRM)


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only)."""
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants (PR_SET_CHILD_SUBREAPER, Linux >= 3.4). The kernel
    gives a dying process's children their new parent before it sends them their parent-death
    signal, so a rank killed by its proxy's death is then this process's child (a zombie until
    this process reaps it), while a rank that died by itself has its proxy as its parent
    (runtime/supervisor.py tells the two apart by that)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/pid/stat from the third on (state, ppid, ...), or None (gone, no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (field 22 of /proc/pid/stat), to tell it from a later
    process that reuses its pid; None where there is no /proc."""
    fields = proc_stat(pid)
    return fields[19] if fields else None


def parent_token() -> str:
    """This process's token, ``<pid>:<start time>``: what its ranks' watchdogs check (``alive``)."""
    pid = os.getpid()
    return f"{pid}:{start_time(pid) or ''}"


def alive(token: str) -> bool:
    pid_text, _, started = token.partition(":")
    try:
        pid = int(pid_text)
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return not started or start_time(pid) in (None, started)


def unix_path(directory_fd: int, name: str) -> str:
    """A short path to ``name`` in the directory open as ``directory_fd`` (through /proc/self/fd):
    a socket's path must fit in 108 bytes, a run directory under a long $TMPDIR may not."""
    return f"/proc/self/fd/{directory_fd}/{name}"


def connect_lifeline(run_dir: Path, rank: int) -> socket.socket | None:
    """A connection to transpile run's lifeline socket, saying which rank, pid and parent this is. Kept
    open for the life of the process: the kernel closes it when the process ends, however it ends,
    at the same moment as the process's pipes to its launcher, so transpile run learns of the
    death before the launcher can react to it (and kill the other ranks)."""
    directory = None
    try:
        directory = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(unix_path(directory, LIFELINE))
            sock.sendall(f"{rank} {os.getpid()} {os.getppid()}\n".encode())
        except OSError:
            sock.close()
            return None
        return _highest_descriptor(sock)
    except OSError:
        return None
    finally:
        if directory is not None:
            os.close(directory)


def _highest_descriptor(sock: socket.socket) -> socket.socket:
    """``sock`` moved to a file descriptor above every other of this process. A dying process's
    files are released last-opened-number first (the kernel queues each release as task work and
    runs that list newest first, rescheduling between them): from the top, the lifeline's end is
    seen before the end of any connection to the other ranks or of the pipes to the launcher, so
    before anything that could get another rank killed (seen under load, 1 kill in 30, when the
    lifeline had a low number)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    top = min(soft if soft != resource.RLIM_INFINITY else 4096, 4096) - 1
    for target in range(top, max(top - 64, sock.fileno()), -1):
        try:
            fd = fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD_CLOEXEC, target)
        except OSError:
            continue
        if fd != target:  # taken: the next free one above it was given
            os.close(fd)
            continue
        moved = socket.socket(fileno=fd)
        sock.close()
        return moved
    return sock


def read_beats(run_dir: Path, size: int) -> dict[int, tuple[float, int, str, int]]:
    """rank -> (age in seconds, step, phase, pid) of the heartbeats on disk."""
    beats = {}
    now = time.time()
    for rank in range(size):
        path = run_dir / f"rank{rank}.beat"
        try:
            pid, step, phase = path.read_text().split(maxsplit=2)
            beats[rank] = (now - path.stat().st_mtime, int(step), phase.strip(), int(pid))
        except (OSError, ValueError):
            continue
    return beats


def read_end(run_dir: Path, rank: int) -> tuple[str, int] | None:
    """How rank ``rank`` said it ended: ("exit", code) or ("signal", number), or None."""
    try:
        kind, value = (run_dir / f"rank{rank}.exit").read_text().split()
        return kind, int(value)
    except (OSError, ValueError):
        return None


# faulthandler's first line for each fatal signal it handles.
_FAULTS = {"Segmentation fault": signal.SIGSEGV, "Floating point exception": signal.SIGFPE, "Aborted": signal.SIGABRT,
           "Bus error": signal.SIGBUS, "Illegal instruction": signal.SIGILL}


def read_fault(run_dir: Path, rank: int) -> int | None:
    """The fatal signal that faulthandler recorded for rank ``rank``, or None."""
    try:
        text = (run_dir / f"rank{rank}.fault").read_text(errors="replace")
    except OSError:
        return None
    return next((int(sig) for words, sig in _FAULTS.items() if f"Fatal Python error: {words}" in text), None)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")  # two threads may write one file
    tmp.write_text(text)
    os.replace(tmp, path)


# Where a phase is, for the timeout's line.
_WHERE = {"start-up": "start-up (joining the other ranks, loading, setup)",
          "shutdown": "shutdown after step {step} (MPI finalization)"}


class Watchdog:
    def __init__(self, rank: int, size: int, *, timeout: float, exit: Callable[[int], None],
                 run_dir: Path | None = None, parent: str | None = None, period: float = 0.5,
                 activity: Callable[[], str | None] | None = None):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.activity = activity  # what the rank is blocked in (the collective), for the message
        self.run_dir, self.parent, self.period = run_dir, parent, period
        self.exit = exit  # how the rank ends after a timeout (may change once the rank joined the others)
        self.step, self.phase = 0, "start-up"
        self._last = time.monotonic()
        self._armed = False
        self._stop = threading.Event()
        self._signals: int | None = None  # read end of the wakeup pipe of the recorded signals
        self._fault = None  # faulthandler's file, kept open
        self._lifeline: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="graph-transpiler-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._beat_file()
        self._thread.start()
        return self

    def record_endings(self) -> None:
        """Spawned ranks with a run directory: record fatal crashes (faulthandler) and terminating
        signals in it for ``transpile run`` (``rank{r}.fault``, ``rank{r}.exit``). Call from the
        main thread, before ``start``. Each recorded signal still ends the rank at once, even when
        its main thread is blocked in a collective: the signal's byte wakes this thread (Python's
        C-level handler writes it to the wakeup pipe), which records it and dies of it."""
        if self.run_dir is None:
            return
        self._lifeline = connect_lifeline(self.run_dir, self.rank)
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            self._fault = open(self.run_dir / f"rank{self.rank}.fault", "w")  # noqa: SIM115 - lives with the process
            faulthandler.enable(file=self._fault, all_threads=False)
        try:
            read, write = os.pipe()
            for fd in (read, write):
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            for sig in RECORDED_SIGNALS:
                signal.signal(sig, self._die_of)
            self._signals = read
        except (OSError, ValueError):
            return

    def _die_of(self, signum: int, _frame=None) -> None:
        """Record ``signum`` and die of it (its default action)."""
        if self.run_dir is not None:
            with contextlib.suppress(OSError):
                _write_atomic(self.run_dir / f"rank{self.rank}.exit", f"signal {int(signum)}\n")
        # libc's signal(): Python's signal.signal() works in the main thread only, and this may be
        # the watchdog's thread (the main one blocked in a collective).
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).signal(int(signum), ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), signum)
        time.sleep(1.0)  # delivered at once to this thread or another one
        os._exit(128 + int(signum))

    def note_exit(self, code: int) -> None:
        """This rank is about to exit by itself with ``code`` (for ``transpile run``)."""
        if self.run_dir is None:
            return
        self.phase = "exit"
        with contextlib.suppress(OSError):
            _write_atomic(self.run_dir / f"rank{self.rank}.exit", f"exit {int(code)}\n")

    def arm(self) -> None:
        """From now on, no progress for ``timeout`` seconds stops the job."""
        self._last = time.monotonic()
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def progress(self, step: int, phase: str = "step") -> None:
        changed = phase != self.phase
        self.step, self.phase = step, phase
        self._last = time.monotonic()
        if changed:  # rare (start-up, checkpoint, evaluation, shutdown): the heartbeat says it at once
            self._beat_file()

    def stop(self) -> None:
        self._armed = False
        self._stop.set()

    def _beat_file(self) -> None:
        if self.run_dir is None:
            return
        with contextlib.suppress(OSError):
            _write_atomic(self.run_dir / f"rank{self.rank}.beat", f"{os.getpid()} {self.step} {self.phase}\n")

    def _wait(self) -> bool:
        """Wait one period; True when stopped. A recorded signal's byte ends the rank."""
        if self._signals is None:
            return self._stop.wait(self.period)
        ready, _, _ = select.select([self._signals], [], [], self.period)
        if ready:
            with contextlib.suppress(OSError):
                for byte in os.read(self._signals, 64):
                    if byte in {int(s) for s in RECORDED_SIGNALS}:
                        self._die_of(byte)
        return self._stop.is_set()

    def _run(self) -> None:
        while not self._wait():
            if self.parent is not None and not alive(self.parent):
                # `transpile run` is gone (kill -9, a closed terminal): nobody reads our output.
                os.kill(os.getpid(), signal.SIGKILL)
            self._beat_file()
            if self._armed and time.monotonic() - self._last > self.timeout:
                # The line names the limit, not the measured idle time: on a loaded host this thread
                # wakes late, and "6 s" for --timeout 5 would read as a wrong limit.
                self._fire()
                return

    def _where(self) -> str:
        if self.phase == "step":
            return f"step {self.step + 1}"
        return _WHERE.get(self.phase, f"{self.phase} at step {{step}}").format(step=self.step)

    def _fire(self) -> None:
        where = self._where()
        inside = self.activity() if self.activity is not None else None
        if inside:
            where = f"{inside} of {where}"
        absent, speaker = "a rank did not arrive (stopped, dead, or running other steps or another plan)", True
        if self.run_dir is not None:
            beats = read_beats(self.run_dir, self.size)
            live = [r for r, (age, *_) in beats.items() if age < STALE_S]
            speaker = self.rank == min(live, default=self.rank)
            # A rank that ended by itself (its exit recorded: it finished, or failed and said so) did not stop.
            gone = [r for r in range(self.size) if r not in live and read_end(self.run_dir, r) is None]
            if gone:
                parts = []
                for r in gone:
                    if r in beats:
                        age, step, phase, pid = beats[r]
                        last = f"{phase} {step + 1}" if phase == "step" else f"{phase} at step {step}"
                        parts.append(f"rank {r} (pid {pid}) did not arrive: no sign of life for {age:.0f} s "
                                     f"(last heartbeat in {last}: stopped, hung or dead)")
                    else:
                        parts.append(f"rank {r} did not arrive: it never started")
                absent = "; ".join(parts)
            else:
                behind = sorted(beats.items(), key=lambda kv: kv[1][1])
                if behind and behind[0][1][1] != behind[-1][1][1]:
                    absent = "ranks are at different steps: " + ", ".join(
                        f"rank {r} {phase} {step}" for r, (_, step, phase, _) in behind)
        if speaker:
            print(f"transpile: error: rank {self.rank}: collective timeout: no progress for {self.timeout:g} s in {where}; "
                  f"{absent} (--timeout)", file=sys.stderr, flush=True)
        else:
            # Let the speaker's line out before this exit tears the job down: the speaker's own check
            # may come a watchdog period later, and later still on a loaded host. Bounded well inside
            # the supervisor's grace after a rank ends (supervisor.GRACE_S).
            time.sleep(self.period + 2.0)
        self.exit(1)
