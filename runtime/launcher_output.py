"""mpiexec's output as ``transpile run`` passes it on: each rank's lines as they come, MPI's
"BAD TERMINATION" banner (Hydra prints it on stdout) swallowed and read, and mpiexec's own lines
(``[mpiexec@host] ...``, ``[proxy:...]``) held back until the job's end decides whether they say
anything a user needs (runtime/supervisor.py says what failed in one line instead).
"""

from __future__ import annotations

import contextlib
import re
import signal
import sys
import threading


def signal_text(number: int) -> str:
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"



class Banner:
    """What MPICH's (Hydra's) "BAD TERMINATION" banner said. Its pid does not name a rank (with
    several ranks on a host it is not the process that failed): only on several hosts, where no
    heartbeat files exist, does the line fall back on it, as "a rank (pid P on HOST)"."""

    LINES = (re.compile(r"^=+\s*$"), re.compile(r"^=   "), re.compile(r"^YOUR APPLICATION TERMINATED WITH THE EXIT STRING"),
             re.compile(r"^This typically refers to a problem with your application"),
             re.compile(r"^Please see the FAQ page for debugging suggestions"))

    def __init__(self):
        self.pid: int | None = None
        self.host = self.exit_code = self.exit_string = None

    def take(self, line: str) -> bool:
        """True when ``line`` belongs to the banner (and is swallowed)."""
        if not any(p.search(line) for p in self.LINES):
            return False
        if (m := re.search(r"PID (\d+) RUNNING AT (\S+)", line)) and self.pid is None:
            self.pid, self.host = int(m.group(1)), m.group(2)
        if (m := re.search(r"EXIT CODE: (\d+)", line)) and self.exit_code is None:
            self.exit_code = int(m.group(1))
        if (m := re.search(r"EXIT STRING: (.*)$", line)) and self.exit_string is None:
            self.exit_string = m.group(1).strip()
        return True

    def describe(self) -> str:
        how = f"exited with status {self.exit_code}"
        if self.exit_code and not (self.exit_string and "signal" not in self.exit_string.lower()):
            how = f"was killed by {signal_text(self.exit_code)}"
        return f"a rank (pid {self.pid} on {self.host}) {how}; the other ranks were stopped"


class Output:
    """What came through mpiexec's streams: whether a rank printed its error line, the banner, and
    mpiexec's own lines (``[mpiexec@host] ...``, ``[proxy:...]``), held back."""

    LAUNCHER_LINE = re.compile(r"^\[(?:mpiexec|proxy)[@:]")

    def __init__(self):
        self.banner = Banner()
        self.rank_error = False
        self.held: list[str] = []
        self.lock = threading.Lock()

    def take(self, line: str) -> bool:
        """True when ``line`` is not passed on now."""
        with self.lock:
            if self.banner.take(line.rstrip("\n")):
                return True
            if self.LAUNCHER_LINE.match(line):
                self.held.append(line)
                return True
            if line.startswith("transpile: error:"):
                self.rank_error = True
            return False

    def release(self) -> None:
        with self.lock:
            for line in self.held:
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.write(line)
            sys.stderr.flush()
            self.held.clear()


def relay(stream, out, output: Output) -> None:
    """Copy one of mpiexec's streams to ours line by line, without MPI's banner (Hydra prints it
    on stdout) and mpiexec's own lines (held back)."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        if not output.take(line):
            with contextlib.suppress(OSError, ValueError):
                out.write(line)
                out.flush()
    stream.close()
