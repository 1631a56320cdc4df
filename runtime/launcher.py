"""Starting the rank processes: detect an enclosing MPI/Slurm launcher, or run mpiexec ourselves.

Under mpirun/mpiexec/srun every process already is a rank: it reads its rank and the world size
from the launcher's environment and must not spawn anything. Otherwise ``transpile run`` is the
parent: it validates once, then runs ``mpiexec -n N python -m runtime.worker <same arguments>`` and
returns its exit status (mpiexec tears all ranks down when one exits non-zero).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import RunError
from runtime.guard import PARENT_ENV, RUN_DIR_ENV, parent_token, read_beats, set_parent_death_signal

# Set in the environment of the ranks we spawn, so a failing rank knows that exiting non-zero is
# enough to tear the others down (no MPI_Abort banner).
SPAWNED_ENV = "GRAPH_TRANSPILER_SPAWNED"

# (launcher, rank variable, size variable or None), first match wins. Open MPI also sets PMIX_RANK,
# so it is checked first. PMIx publishes no size variable: the MPI communicator's size is the
# authority anyway (check_world_size), detection only decides "already a rank, do not spawn".
_LAUNCHERS = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("MPICH/Hydra", "PMI_RANK", "PMI_SIZE"),
    ("PMIx", "PMIX_RANK", None),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS"),
)


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str
    rank: int
    size: int | None  # None where the launcher does not publish it


def detect_launcher(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The rank (and size) an enclosing launcher gave this process, or None when started by hand."""
    environ = os.environ if environ is None else environ
    for name, rank_var, size_var in _LAUNCHERS:
        if rank_var not in environ or (size_var is not None and size_var not in environ):
            continue
        try:
            return LaunchEnv(name, int(environ[rank_var]), None if size_var is None else int(environ[size_var]))
        except ValueError:
            raise RunError(f"{name} launcher: {rank_var} or {size_var} in the environment is not an integer") from None
    return None


def check_world_size(size: int, world_size: int, launcher: str) -> None:
    """``size`` is the MPI world size this process sees; it must be the plan's."""
    if size != world_size:
        raise RunError(f"the {launcher} launcher started {size} process(es), but the plan was transpiled for "
                       f"world_size {world_size}; launch with -n {world_size}")


def find_mpiexec() -> str:
    """mpiexec next to this Python (a venv with the mpich wheel), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return found
    raise RunError(f"mpiexec not found next to {sys.executable} or on PATH; install MPI (pip install mpich) "
                   "or start the ranks with your own launcher")


def mpiexec_flavor(mpiexec: str) -> str:
    """'openmpi', 'mpich' (Hydra, also Intel MPI) or 'unknown', from ``mpiexec --version``."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "Open MPI" in text or "OpenRTE" in text or "open-mpi" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text or "Intel" in text:
        return "mpich"
    return "unknown"


def mpiexec_command(mpiexec: str, flavor: str, n: int, worker_args: Sequence[str]) -> list[str]:
    flags = []
    if flavor == "openmpi":
        # Open MPI refuses more ranks than cores and running as root unless told; both are normal here.
        flags.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--allow-run-as-root")
    return [mpiexec, *flags, "-n", str(n), sys.executable, "-m", "runtime.worker", *worker_args]


def child_environment() -> dict[str, str]:
    env = dict(os.environ)
    env[SPAWNED_ENV] = "1"
    # NVLink SHARP (multicast) is off on the machines we target (docs/runtime.md); harmless on CPU.
    env["NCCL_NVLS_ENABLE"] = "0"
    # The ranks must import this very runtime even when it is run from a checkout, not installed.
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    return env


def spawn(n: int, worker_args: Sequence[str], run_dir: Path | None = None) -> int:
    """Run N rank processes of ``runtime.worker`` under mpiexec; returns the run's exit status.

    mpiexec runs in its own session (process group). Ctrl-C (SIGINT), SIGTERM or SIGHUP on
    ``transpile run`` kills that whole group at once: the ranks, however blocked (a rank waiting in
    a collective for a peer that has gone never runs a Python handler), and mpiexec, whose own
    Ctrl-C handling would print a banner per rank. The run then ends with one line and status
    128 + the signal; nothing is left running. When ``transpile run`` itself is killed (kill -9, the
    OOM killer), the kernel kills mpiexec (PR_SET_PDEATHSIG) and each rank's watchdog sees that its
    parent is gone (runtime/guard.py): no rank outlives it.

    mpiexec's stderr passes through this process: the ranks' lines go on unchanged, MPI's "BAD
    TERMINATION" banner is replaced by one ``transpile:`` line naming the rank that died (its pid is
    in the heartbeat files of ``run_dir``), its host and its exit status or signal.
    """
    mpiexec = find_mpiexec()
    command = mpiexec_command(mpiexec, mpiexec_flavor(mpiexec), n, worker_args)
    env = child_environment()
    if run_dir is not None:
        env[RUN_DIR_ENV] = str(run_dir)
    env[PARENT_ENV] = parent_token()
    me = os.getpid()

    def die_with_me() -> None:  # in the child, before exec: mpiexec dies with transpile run
        set_parent_death_signal()
        if os.getppid() != me:  # transpile run died before the prctl took effect
            os._exit(1)

    try:
        job = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, preexec_fn=die_with_me)
    except OSError as exc:
        raise RunError(f"cannot start {mpiexec}: {exc.strerror or exc}") from None
    banner = _Banner()
    relays = [threading.Thread(target=_relay, args=(pipe, out, banner), daemon=True)
              for pipe, out in ((job.stdout, sys.stdout), (job.stderr, sys.stderr))]
    for relay in relays:
        relay.start()
    received: list[int] = []

    def stop(signum, _frame) -> None:
        received.append(signum)
        _kill_group(job)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = job.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if job.poll() is None:  # an exception in here, not a signal: leave nothing running either
            _kill_group(job)
            job.wait()
    if received or code != 0:
        _kill_group(job)  # stragglers of a failed job, if any
    for relay in relays:
        relay.join(timeout=5)
    if received:
        name = signal.Signals(received[0]).name
        print(f"transpile: interrupted by {name}: the {n} rank(s) were stopped", file=sys.stderr, flush=True)
        return 128 + received[0]
    if banner.pid is not None:
        print(f"transpile: error: {banner.describe(run_dir, n)}; the other ranks were stopped", file=sys.stderr, flush=True)
        return 1
    return code


class _Banner:
    """What MPICH's (Hydra's) "BAD TERMINATION" banner said: the pid, host and exit of a rank."""

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

    def describe(self, run_dir: Path | None, n: int) -> str:
        rank = None
        if run_dir is not None:
            rank = next((r for r, (*_, pid) in read_beats(run_dir, n).items() if pid == self.pid), None)
        who = f"rank {rank}" if rank is not None else "a rank"
        how = f"exited with status {self.exit_code}"
        if self.exit_code is not None and self.exit_code > 0:
            with contextlib.suppress(ValueError):
                how = f"was killed by signal {self.exit_code} ({signal.Signals(self.exit_code).name})"
            if self.exit_string and "signal" not in self.exit_string.lower():
                how = f"exited with status {self.exit_code}"
        return f"{who} (pid {self.pid} on {self.host}) {how}"


def _relay(stream, out, banner: _Banner) -> None:
    """Copy one of mpiexec's streams to ours line by line, without MPI's banner (Hydra prints it
    on stdout)."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        if not banner.take(line.rstrip("\n")):
            with contextlib.suppress(OSError, ValueError):
                out.write(line)
                out.flush()
    stream.close()


def _kill_group(job: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(job.pid, signal.SIGKILL)
