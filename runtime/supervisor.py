"""``transpile run``'s watch over the job it started (runtime/launcher.py ``spawn``): mpiexec's
output passed on, with MPI's banner and mpiexec's own lines held back; which process of the job
ended first, and how; the deadlines for what no rank's watchdog (runtime/guard.py) can see (a
rank that never starts, every rank stopped, a stopped mpiexec or proxy, a shutdown that does not
end); and the one line that explains a failure no rank explained itself.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.guard import LIFELINE, proc_stat, read_beats, read_end, read_fault, unix_path
from runtime.launcher_output import Output, signal_text

# How long past --timeout transpile run waits for the ranks' own watchdogs to end a job before it
# ends the job itself (a stage no rank's watchdog covers: every rank stopped, a launcher stopped, a
# rank that never started).
GRACE_S = 5.0
# A rank with no heartbeat at all is given longer: its first one comes once Python has imported the
# runtime (onnxruntime, numpy), which takes a while on a loaded machine. A rank stopped before it is
# still found within --timeout by the others' watchdogs (they wait for it in MPI initialization).
START_GRACE_S = 30.0


def listen(run_dir: Path) -> socket.socket | None:
    """The lifeline socket the spawned ranks connect to (runtime/guard.py), or None."""
    sock, directory = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), None
    try:
        directory = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        sock.bind(unix_path(directory, LIFELINE))
        sock.listen(256)
        sock.setblocking(False)
        return sock
    except OSError:
        sock.close()
        return None
    finally:
        if directory is not None:
            os.close(directory)


def _wait_status(raw: int) -> str:
    """A raw wait status as words: 'was killed by signal 9 (SIGKILL)', 'exited with status 3'."""
    if os.WIFSIGNALED(raw):
        return f"was killed by {signal_text(os.WTERMSIG(raw))}"
    return f"exited with status {os.WEXITSTATUS(raw)}"


def _zombie_status(pid: int) -> int | None:
    """The raw wait status of ``pid`` while it is a zombie (field 52 of /proc/pid/stat: until its
    parent, not us, reaps it), else None."""
    fields = proc_stat(pid)
    if not fields or fields[0] not in ("Z", "X") or len(fields) < 50:
        return None
    try:
        return int(fields[49])
    except ValueError:
        return None


def _orphaned(pid: int) -> bool:
    """Whether the ended rank ``pid`` lost its proxy before it died: it is then this process's
    child (runtime/guard.py ``become_subreaper``), a zombie until ``Supervisor.finish`` reaps it.
    One that died by itself keeps its proxy as its parent until the proxy reaps it."""
    fields = proc_stat(pid)
    return fields is not None and int(fields[1]) == os.getpid()


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or "?"
    except OSError:
        return "?"


@dataclass
class _Death:
    kind: str  # "rank", "proxy" (the process that started the ranks, e.g. hydra_pmi_proxy) or "launcher"
    pid: int
    rank: int | None
    status: int | None  # raw wait status when it was still readable
    name: str


class Supervisor:
    """``transpile run``'s own watch over a job on this host (a thread, every 0.2 s):

    - holds, in one epoll set, each rank's lifeline connection (runtime/guard.py: it ends when the
      rank's files are closed, at the moment its launcher's pipes see the end, so before the
      launcher can react and kill the other ranks), and a pidfd of each rank (its pid from the
      heartbeat file), of the process that started it (the launcher's proxy, e.g.
      hydra_pmi_proxy) and of mpiexec: the kernel queues these ends in the order they happened,
      so the rank that died first is told from the ones the launcher killed after it, however
      late this thread runs;
    - reads a dead process's exit status while it is still a zombie (its parent reaps it soon);
      the ranks' own records (``rank{r}.exit``, ``rank{r}.fault``: runtime/guard.py) say the rest;
    - ends the job itself, with one line and status 1, where no rank's watchdog can: a rank that
      has not started ``timeout`` + START_GRACE_S seconds after the launch, a rank without
      heartbeat for ``timeout`` + GRACE_S seconds (every rank stopped), mpiexec or its proxy stopped for ``timeout`` seconds (the
      ranks' lines and MPI's start-up and shutdown go through them), a job still there
      ``timeout`` + GRACE_S seconds after its first rank ended (shutdown).
    """

    def __init__(self, job: subprocess.Popen, n: int, run_dir: Path, timeout: float, output: Output,
                 launcher_name: str, lifeline: socket.socket | None = None):
        self.job, self.n, self.run_dir, self.timeout, self.output = job, n, run_dir, timeout, output
        self.host = os.uname().nodename
        self.began = time.monotonic()
        self.verdict: str | None = None
        self.deaths: list[_Death] = []
        self.first_end: float | None = None  # when the first rank ended (exited or died)
        self._ranks: dict[int, int] = {}  # rank -> pid
        self._watched: dict[int, tuple[str, int, int | None, str]] = {}  # fd -> (kind, pid, rank, name)
        self._stopped: dict[int, float] = {}  # launcher pid -> since when it is stopped
        self._launchers: dict[int, str] = {job.pid: launcher_name}
        self._proxy_of: dict[int, int] = {}  # rank pid -> the pid of the proxy that started it
        self._lock = threading.Lock()
        self._done = threading.Event()
        try:
            self._epoll = select.epoll()
        except OSError:
            self._epoll = None
        self._lifeline = lifeline
        self._lines: dict[int, tuple[socket.socket, bytes]] = {}  # fd -> (a rank's connection, what it said)
        if lifeline is not None and self._epoll is not None:
            self._epoll.register(lifeline.fileno(), select.EPOLLIN)
        self._watch("launcher", job.pid, None, launcher_name)
        self._thread = threading.Thread(target=self._run, name="graph-transpiler-supervisor", daemon=True)
        self._thread.start()

    # -- watching ---------------------------------------------------------------------------------
    def _watch(self, kind: str, pid: int, rank: int | None, name: str) -> None:
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):  # gone already (or no pidfd): record it now, in this order
            if proc_stat(pid) is None or kind == "rank":
                self._record(kind, pid, rank, name)
            return
        if self._epoll is None:
            os.close(fd)
            return
        self._watched[fd] = (kind, pid, rank, name)
        self._epoll.register(fd, select.EPOLLIN)

    def _record(self, kind: str, pid: int, rank: int | None, name: str, status: int | None = None) -> None:
        """A death, in the order seen; a process seen twice (lifeline, then pidfd) keeps its first
        place and gains the status read the second time."""
        if status is None:
            status = _zombie_status(pid)
        known = next((d for d in self.deaths if d.pid == pid), None)
        if known is not None:
            known.status = known.status if known.status is not None else status
            return
        proxy = self._proxy_of.get(pid) if kind == "rank" else None
        if proxy is not None and not self._dead(proxy) and _orphaned(pid):
            # A rank dies with its proxy (PR_SET_PDEATHSIG, sent while the proxy exits): the
            # proxy died first, however the two ends were queued.
            self._record("proxy", proxy, None, self._launchers[proxy])
        self.deaths.append(_Death(kind, pid, rank, status, name))
        if kind == "rank" and self.first_end is None:
            self.first_end = time.monotonic()

    def _drain(self, wait: float) -> None:
        if self._epoll is None:
            time.sleep(wait)
            return
        events = self._epoll.poll(wait)  # in the order the processes ended
        # Statuses first, before the processes' parents reap them.
        statuses = {fd: _zombie_status(self._watched[fd][1]) for fd, _ in events if fd in self._watched}
        for fd, _ in events:
            if self._lifeline is not None and fd == self._lifeline.fileno():
                self._accept()
            elif fd in self._lines:
                self._hear(fd)
            elif fd in self._watched:
                kind, pid, rank, name = self._watched.pop(fd)
                self._epoll.unregister(fd)
                os.close(fd)
                self._record(kind, pid, rank, name, statuses[fd])

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._lifeline.accept()
            except OSError:  # no more waiting (EAGAIN), or the listener is gone
                return
            conn.setblocking(False)
            self._lines[conn.fileno()] = (conn, b"")
            self._epoll.register(conn.fileno(), select.EPOLLIN | select.EPOLLRDHUP)

    def _hear(self, fd: int) -> None:
        """Read a rank's lifeline: its "rank pid parent" line, or its end (the rank is gone)."""
        conn, said = self._lines[fd]
        ended = False
        while True:
            try:
                data = conn.recv(256)
            except BlockingIOError:
                break
            except OSError:
                ended = True
                break
            if not data:
                ended = True
                break
            said += data
        self._lines[fd] = (conn, said)
        words = said.split()
        known = len(words) >= 3 and b"\n" in said and all(w.isdigit() for w in words[:3])
        if known and int(words[1]) not in self._proxy_of:  # its parent, named while it is alive
            self._adopt(int(words[1]), int(words[2]))
        if not ended:
            return
        self._epoll.unregister(fd)
        del self._lines[fd]
        conn.close()
        if known and 0 <= int(words[0]) < self.n:
            self._record("rank", int(words[1]), int(words[0]), "rank")

    def _adopt(self, pid: int, parent: int | None) -> None:
        """Watch the process that started rank ``pid`` (the launcher's proxy, e.g. hydra_pmi_proxy)."""
        if not parent or parent in (os.getpid(), self.job.pid):
            return
        if parent not in self._launchers:
            self._launchers[parent] = _process_name(parent)
            self._watch("proxy", parent, None, self._launchers[parent])
        self._proxy_of[pid] = parent

    def _discover(self, beats: dict) -> None:
        for rank, (_, _, _, pid) in beats.items():
            if rank in self._ranks:
                continue
            self._ranks[rank] = pid
            fields = proc_stat(pid)
            if pid not in self._proxy_of:
                self._adopt(pid, int(fields[1]) if fields else None)
            self._watch("rank", pid, rank, "rank")

    def _run(self) -> None:
        while not self._done.is_set():
            with self._lock:
                self._drain(0.2)
                if self._done.is_set() or self.verdict is not None:
                    continue
                beats = read_beats(self.run_dir, self.n)
                self._discover(beats)
                self._check(beats)

    def _dead(self, pid: int) -> bool:
        return any(d.pid == pid for d in self.deaths)

    def _check(self, beats: dict) -> None:
        now = time.monotonic()
        late = self.timeout + GRACE_S
        for pid, name in self._launchers.items():
            fields = None if self._dead(pid) else proc_stat(pid)
            if fields and fields[0] in ("T", "t"):
                since = self._stopped.setdefault(pid, now)
                if now - since >= self.timeout:
                    what = "the launcher" if pid == self.job.pid else "the launcher's proxy"
                    return self._end(f"{what} {name} (pid {pid} on {self.host}) has been stopped for {now - since:.0f} s "
                                     f"(SIGSTOP or a debugger): the ranks' output and MPI's start-up and shutdown go "
                                     f"through it; the {self.n} rank(s) were stopped (--timeout {self.timeout:g})")
            else:
                self._stopped.pop(pid, None)
        if now - self.began > self.timeout + START_GRACE_S and len(beats) < self.n:
            missing = [r for r in range(self.n) if r not in beats]
            return self._end(f"{_ranks_text(missing)} never started within {now - self.began:.0f} s (--timeout "
                             f"{self.timeout:g} + {START_GRACE_S:g} s); the {self.n} rank(s) were stopped")
        silent = [(r, age, pid) for r, (age, _, _, pid) in beats.items()
                  if age > late and not self._dead(pid) and read_end(self.run_dir, r) is None]
        if silent:
            said = "; ".join(f"rank {r} (pid {pid} on {self.host}): no sign of life for {age:.0f} s" for r, age, pid in silent)
            return self._end(f"{said} (stopped or hung), and no rank ended the job; the {self.n} rank(s) were stopped "
                             f"(--timeout {self.timeout:g})")
        if self.first_end is not None and now - self.first_end > late:
            ended = next(d for d in self.deaths if d.kind == "rank")
            return self._end(f"the job did not end within {now - self.first_end:.0f} s after rank {ended.rank} ended "
                             f"(shutdown hung); the {self.n} rank(s) were stopped (--timeout {self.timeout:g})")
        return None

    def _end(self, line: str) -> None:
        """End the job from here: one line (unless a rank already said what went wrong), status 1."""
        self.verdict = line
        if not self.output.rank_error:
            print(f"transpile: error: {line}", file=sys.stderr, flush=True)
        kill_group(self.job, self)

    def kill_all(self) -> None:
        """SIGKILL every process of the job still watched (through its pidfd: never a process that
        took a dead one's pid). Hydra's proxy and each rank run in sessions of their own, out of
        mpiexec's process group; a stopped proxy would otherwise outlive the job, holding its
        ranks (they still die when their parent token is gone: runtime/guard.py)."""
        for fd in list(self._watched):
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)

    def finish(self) -> None:
        """The job has ended: stop watching, and take the deaths still queued, in their order."""
        self._done.set()
        self._thread.join(timeout=5)
        with self._lock:
            if self._epoll is not None:
                self._drain(0)
                for fd in self._watched:
                    os.close(fd)
                self._watched.clear()  # closed: kill_all must not signal what reuses the numbers
                for conn, _ in self._lines.values():
                    conn.close()
                self._lines.clear()
                self._epoll.close()
                self._epoll = None
            if self._lifeline is not None:
                self._lifeline.close()
            for pid in self._ranks.values():  # the ranks adopted when their proxy died (_orphaned)
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)

    # -- the verdict ------------------------------------------------------------------------------
    def rank_status(self) -> int | None:
        """The status of the first rank that exited non-zero by itself (it printed its line)."""
        for death in self.deaths:
            if death.kind == "rank":
                end = read_end(self.run_dir, death.rank)
                if end is not None and end[0] == "exit" and end[1] != 0:
                    return end[1]
        return None

    def explain(self, code: int) -> str | None:
        """One line for a job that failed without a rank's line: what died first. mpiexec killed by
        a signal (a negative ``code``: we never kill it before it has ended) is the cause whatever
        the order: its proxy, losing it, may exit before mpiexec's own death is queued."""
        launcher = next((d for d in self.deaths if d.kind == "launcher"), None)
        if code < 0 and launcher is not None:
            return f"the launcher {launcher.name} (pid {launcher.pid}) {_wait_status(_raw_status(code))}; the {self.n} rank(s) were stopped"
        for death in self.deaths:
            if death.kind == "rank":
                end = read_end(self.run_dir, death.rank)
                if end is not None and end[0] == "exit" and end[1] == 0:
                    continue  # it finished its work
                return f"rank {death.rank} (pid {death.pid} on {self.host}) {self._rank_end(death, end)}; the other ranks were stopped"
            if death.kind == "proxy":
                how = _wait_status(death.status) if death.status is not None else "died"
                return (f"the launcher's proxy {death.name} (pid {death.pid} on {self.host}) {how}; the {self.n} "
                        "rank(s) were stopped")
            if death.kind == "launcher":
                how = _wait_status(_raw_status(code))
                return f"the launcher {death.name} (pid {death.pid}) {how}; the {self.n} rank(s) were stopped"
        return None

    def _rank_end(self, death: _Death, end: tuple[str, int] | None) -> str:
        if end is not None and end[0] == "signal":
            return f"was killed by {signal_text(end[1])}"
        if end is not None:
            return f"exited with status {end[1]}"
        if death.status is not None:
            return _wait_status(death.status) + ("" if os.WIFSIGNALED(death.status) else " without a message")
        fault = read_fault(self.run_dir, death.rank)
        if fault is not None:
            return f"was killed by {signal_text(fault)}"
        # It recorded no exit, no signal, no crash: the one signal no process can catch.
        return f"was killed by {signal_text(signal.SIGKILL)}"


def _raw_status(code: int) -> int:
    """Popen's returncode as a raw wait status."""
    return -code if code < 0 else (code & 0xFF) << 8


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def kill_group(job: subprocess.Popen, supervisor: Supervisor | None = None) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(job.pid, signal.SIGKILL)
    if supervisor is not None:
        supervisor.kill_all()
