"""Ranks that never outlive their job and never hang: parent-death signals, a parent-liveness
check and a collective timeout for every backend (the GPU one has its own NCCL watchdog as well,
bounded by the same ``--timeout``).

- ``set_parent_death_signal``: prctl(PR_SET_PDEATHSIG, SIGKILL) through libc (Linux; a no-op
  elsewhere). ``transpile run`` sets it in mpiexec, each rank we spawn in itself: when the parent
  dies, however it dies (kill -9, the OOM killer), the kernel kills the child.
- ``Watchdog`` (a daemon thread per rank):
  - kills the rank when the ``transpile run`` that spawned it is gone (its pid and start time, the
    ``parent`` token of the rank's RunConfig: runtime/config.py), so no rank outlives it even if
    mpiexec's process tree does not pass the death on;
  - writes a heartbeat file (``run_dir``/rank{r}.beat, the RunConfig's run directory: pid, step,
    phase) once a second, from which a rank that times out, and the launcher, name the rank that
    stopped or died;
  - stops the job when the training loop has made no progress (no step, no checkpoint phase) for
    ``timeout`` seconds (``--timeout``): a collective whose peer stopped (SIGSTOP), died under an
    outside launcher, or runs another number of steps never returns. The lowest rank still alive
    prints the one line naming the ranks that did not arrive; every rank then exits with status 1
    (MPI_Abort under an outside launcher). The check costs nothing per step (the loop stores an int
    and a float).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

STALE_S = 3.0  # a heartbeat older than this: the rank is not running (stopped, hung in C, dead)
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (field 22 of /proc/pid/stat), to tell it from a later
    process that reuses its pid; None where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


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


class Watchdog:
    def __init__(self, rank: int, size: int, *, timeout: float, exit: Callable[[int], None],
                 run_dir: Path | None = None, parent: str | None = None, period: float = 0.5,
                 activity: Callable[[], str | None] | None = None):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.activity = activity  # what the rank is blocked in (the collective), for the message
        self.run_dir, self.parent, self.period = run_dir, parent, period
        self._exit = exit
        self.step, self.phase = 0, "start-up"
        self._last = time.monotonic()
        self._armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="graph-transpiler-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._beat_file()
        self._thread.start()
        return self

    def arm(self) -> None:
        """From now on, no progress for ``timeout`` seconds stops the job."""
        self._last = time.monotonic()
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def progress(self, step: int, phase: str = "step") -> None:
        self.step, self.phase = step, phase
        self._last = time.monotonic()

    def stop(self) -> None:
        self._armed = False
        self._stop.set()

    def _beat_file(self) -> None:
        if self.run_dir is None:
            return
        path = self.run_dir / f"rank{self.rank}.beat"
        try:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(f"{os.getpid()} {self.step} {self.phase}\n")
            os.replace(tmp, path)
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            if self.parent is not None and not alive(self.parent):
                # `transpile run` is gone (kill -9, a closed terminal): nobody reads our output.
                os.kill(os.getpid(), signal.SIGKILL)
            self._beat_file()
            if self._armed and time.monotonic() - self._last > self.timeout:
                self._fire()
                return

    def _fire(self) -> None:
        idle = time.monotonic() - self._last
        where = f"step {self.step + 1}" if self.phase == "step" else f"{self.phase} at step {self.step}"
        inside = self.activity() if self.activity is not None else None
        if inside:
            where = f"{inside} of {where}"
        absent, speaker = "a rank did not arrive (stopped, dead, or running other steps or another plan)", True
        if self.run_dir is not None:
            beats = read_beats(self.run_dir, self.size)
            live = [r for r, (age, *_) in beats.items() if age < STALE_S]
            speaker = self.rank == min(live, default=self.rank)
            gone = [r for r in range(self.size) if r not in live]
            if gone:
                parts = []
                for r in gone:
                    if r in beats:
                        age, step, phase, pid = beats[r]
                        parts.append(f"rank {r} (pid {pid}) did not arrive: no sign of life for {age:.0f} s "
                                     f"(last heartbeat in {phase} {step + 1 if phase == 'step' else step}: stopped, hung or dead)")
                    else:
                        parts.append(f"rank {r} did not arrive: it never started")
                absent = "; ".join(parts)
            else:
                behind = sorted(beats.items(), key=lambda kv: kv[1][1])
                if behind and behind[0][1][1] != behind[-1][1][1]:
                    absent = "ranks are at different steps: " + ", ".join(
                        f"rank {r} {phase} {step}" for r, (_, step, phase, _) in behind)
        if speaker:
            print(f"transpile: error: rank {self.rank}: collective timeout: no progress for {idle:.0f} s in {where}; "
                  f"{absent} (--timeout)", file=sys.stderr, flush=True)
        else:
            time.sleep(1.0)  # let the speaker's line out before the job is torn down
        self._exit(1)
