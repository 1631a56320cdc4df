"""Starting the rank processes: detect an enclosing launcher, or run mpiexec ourselves.

Under mpirun/mpiexec/srun/torchrun every process already is a rank: it reads its rank, the world
size and its local rank from the launcher's environment (``LAUNCHERS``) and must not spawn anything.
Otherwise ``transpile run`` is the parent: it validates once, then runs ``mpiexec -n N python -m
runtime.worker --config FILE`` (with ``--hostfile``/``--hosts``: on those hosts, the configuration
inline) and returns its exit status (mpiexec tears all ranks down when one exits non-zero). What the
ranks need to know of their parent travels in that configuration (runtime/config.py), not in the
environment.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime import variables
from runtime.config import DEFAULT_TIMEOUT_S
from runtime.errors import RunError
from runtime.guard import become_subreaper, set_parent_death_signal
from runtime.launcher_output import Output, relay
from runtime.supervisor import Supervisor, kill_group, listen


# Every launcher we recognise, first match wins. The order settles processes that see the variables
# of several: Open MPI also sets PMIX_RANK; ranks that mpirun/mpiexec starts inside a Slurm
# allocation inherit its SLURM_* variables; torchrun under srun sees SLURM_PROCID = its node. So the
# per-process MPI variables come first, then torchrun's, then Slurm's. Slurm counts only inside an
# srun step (SLURM_STEP_ID): an sbatch script's own shell has SLURM_PROCID=0 too, and there
# `transpile run` must start the ranks itself. A variable left None is not published by that
# launcher (PMIx keeps the size in its server; MPI's local communicator answers instead).
@dataclass(frozen=True)
class Launcher:
    name: str
    rank: str
    size: str | None
    local_rank: str | None
    local_size: str | None
    requires: tuple[str, ...] = ()  # present too, or it is not this launcher
    mpi: bool = True  # its ranks are MPI processes; torchrun's are not (they meet over the TCP bootstrap)


LAUNCHERS = (
    Launcher("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE"),
    Launcher("MPICH/Hydra", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    Launcher("PMIx", "PMIX_RANK", None, None, None),
    Launcher("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", requires=("MASTER_ADDR", "MASTER_PORT"),
             mpi=False),
    Launcher("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None, requires=("SLURM_STEP_ID",)),
)


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str
    rank: int
    size: int | None  # None where the launcher does not publish it
    local_rank: int | None = None  # this rank's index among the ranks of its host: the GPU it drives
    local_size: int | None = None
    mpi: bool = True


def detect_launcher(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The rank, size and local rank an enclosing launcher gave this process, or None when started by hand."""
    environ = os.environ if environ is None else environ
    for launcher in LAUNCHERS:
        if launcher.rank not in environ or any(v not in environ for v in launcher.requires):
            continue
        if launcher.size is not None and launcher.size not in environ:
            continue
        rank, size, local_rank, local_size = (_number(environ, launcher.name, var) for var in (
            launcher.rank, launcher.size, launcher.local_rank, launcher.local_size))
        env = LaunchEnv(launcher.name, rank, size, local_rank, local_size, launcher.mpi)
        if env.size is not None and env.rank >= env.size:
            raise RunError(f"{launcher.name} launcher: {launcher.rank}={env.rank} is not below {launcher.size}={env.size}")
        return env
    return None


def _number(environ: Mapping[str, str], launcher: str, var: str | None) -> int | None:
    if var is None or var not in environ:
        return None
    try:
        value = int(environ[var])
    except ValueError:
        raise RunError(f"{launcher} launcher: {var}={environ[var]!r} in the environment is not an integer") from None
    if value < 0:
        raise RunError(f"{launcher} launcher: {var}={value} in the environment is negative")
    return value


def check_world_size(size: int, world_size: int, launcher: str) -> None:
    """``size`` is the world size this process sees (MPI's, or the launcher's); it must be the plan's."""
    if size != world_size:
        raise RunError(f"the {launcher} launcher started {size} process(es), but the plan was transpiled for "
                       f"world_size {world_size}; launch with -n {world_size}")


def check_mpi_agrees(env: LaunchEnv, rank: int, size: int) -> None:
    """The launcher's rank and size are MPI's: else MPI did not connect to the launcher's process
    manager (srun without --mpi=pmi2/pmix starts N MPI worlds of one) and every rank would train alone."""
    if env.size is not None and (env.size, env.rank) != (size, rank):
        raise RunError(f"the {env.launcher} launcher made this rank {env.rank} of {env.size}, but MPI sees rank {rank} "
                       f"of {size}: MPI is not using {env.launcher}'s process manager (under srun pass --mpi=pmix or "
                       "--mpi=pmi2, or start the ranks with mpirun)")


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


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def _host(text: str, slots: str | None, where: str) -> Host:
    if not text or any(c.isspace() for c in text):
        raise RunError(f"{where}: {text!r} is not a host name")
    try:
        count = 1 if slots is None else int(slots)
    except ValueError:
        count = 0
    if count < 1:
        raise RunError(f"{where}: slots of {text} must be a whole number >= 1, got {slots!r}")
    return Host(text, count)


def parse_hostfile(path: str | Path) -> list[Host]:
    """Hosts of an Open MPI (``host slots=N``) or MPICH (``host:N``) hostfile; ``#`` starts a
    comment, a host without a count has one slot. Other keys (max_slots=...) are refused, not ignored."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise RunError(f"--hostfile {path}: {exc.strerror or exc}") from None
    hosts = []
    for number, line in enumerate(lines, start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--hostfile {path}, line {number}"
        name, colon, count = words[0].partition(":")
        if len(words) == 1:
            hosts.append(_host(name, count if colon else None, where))
        elif len(words) == 2 and words[1].startswith("slots=") and not colon:
            hosts.append(_host(name, words[1][len("slots="):], where))
        else:
            raise RunError(f"{where}: expected 'host slots=N' or 'host:N', got {line.strip()!r}")
    if not hosts:
        raise RunError(f"--hostfile {path}: names no host")
    return hosts


def parse_hosts(spec: str) -> list[Host]:
    """``--hosts h1:4,h2:4`` (a host without ``:N`` has one slot)."""
    hosts = []
    for item in spec.split(","):
        name, colon, count = item.strip().partition(":")
        hosts.append(_host(name, count if colon else None, f"--hosts {spec}"))
    return hosts


def check_slots(hosts: Sequence[Host], world_size: int, option: str) -> None:
    total = sum(h.slots for h in hosts)
    if total != world_size:
        listed = ", ".join(f"{h.name}:{h.slots}" for h in hosts)
        raise RunError(f"{option}: {total} slot(s) in all ({listed}), but the plan was transpiled for world_size "
                       f"{world_size}; the slots must add up to it (one rank per slot)")


def hostfile_text(hosts: Sequence[Host], flavor: str) -> str:
    """The hostfile as ``flavor``'s mpiexec reads it (the two formats are not interchangeable)."""
    if flavor == "openmpi":
        return "".join(f"{h.name} slots={h.slots}\n" for h in hosts)
    return "".join(f"{h.name}:{h.slots}\n" for h in hosts)


# Variables the ranks on other hosts must see as they are here: NCCL's, UCX's, PYTHONPATH and the
# runtime's debugging aids (runtime/variables.py); everything else a rank needs is in its RunConfig.
# Hydra passes the whole environment on (-genvall, its default); Open MPI passes only what -x names
# to remote hosts.
PASS_PREFIXES = ("NCCL_", "UCX_")
PASS_NAMES = ("PYTHONPATH", *variables.ALL)


def passed_variables(env: Mapping[str, str]) -> list[str]:
    return sorted(k for k in env if k.startswith(PASS_PREFIXES) or k in PASS_NAMES)


def mpiexec_command(mpiexec: str, flavor: str, n: int, worker_args: Sequence[str], hostfile: Path | None = None,
                    env: Mapping[str, str] | None = None) -> list[str]:
    flags = []
    if flavor == "openmpi":
        # Open MPI refuses more ranks than cores and running as root unless told; both are normal here.
        # Unbound, as Horovod runs it: unasked, Open MPI binds each of 1 or 2 ranks to one core (its
        # documented default), so all of a rank's threads (onnxruntime's intra-op pool, NCCL's
        # proxy, the watchdogs) share that core. Two CPU ranks of the built-in GPT, 16 onnxruntime
        # threads each, did not finish 20 steps in 300 s on a 32-core host with 2 H200s (6 s on a
        # 2-core machine under MPICH, which does not bind). Each rank sizes its own thread pool.
        flags += ["--oversubscribe", "--bind-to", "none"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--allow-run-as-root")
        if hostfile is not None:
            flags += ["--hostfile", str(hostfile)]
            for name in passed_variables(env or {}):
                flags += ["-x", name]
    elif hostfile is not None:
        if flavor != "mpich":
            raise RunError(f"{mpiexec} is neither Open MPI nor MPICH/Hydra (from its --version): cannot tell its "
                           "hostfile format; start the ranks with your own launcher (docs/multi-node.md)")
        flags += ["-f", str(hostfile), "-genvall"]
    return [mpiexec, *flags, "-n", str(n), sys.executable, "-m", "runtime.worker", *worker_args]


def child_environment() -> dict[str, str]:
    """The environment of the processes we start (mpiexec and the ranks): ours, with NCCL's NVLS off
    and this runtime first on PYTHONPATH. This process's own environment is left as it is."""
    env = dict(os.environ)
    # NVLink SHARP (multicast) is off on the machines we target (docs/runtime.md); harmless on CPU.
    env["NCCL_NVLS_ENABLE"] = "0"
    # The ranks must import this very runtime even when it is run from a checkout, not installed.
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    return env


def spawn(n: int, worker_args: Sequence[str], run_dir: Path | None = None, hosts: Sequence[Host] | None = None,
          timeout: float = DEFAULT_TIMEOUT_S) -> int:
    """Run N rank processes of ``runtime.worker`` under mpiexec (on ``hosts``, else here); returns
    the run's exit status. ``worker_args`` name the ranks' RunConfig, which tells them they were
    spawned, and (on this host only) this process's token and ``run_dir`` for their heartbeats.

    mpiexec runs in its own session (process group). Ctrl-C (SIGINT), SIGTERM or SIGHUP on
    ``transpile run`` kills that whole group at once: the ranks, however blocked (a rank waiting in
    a collective for a peer that has gone never runs a Python handler), and mpiexec, whose own
    Ctrl-C handling would print a banner per rank. The run then ends with one line and status
    128 + the signal; nothing is left running. When ``transpile run`` itself is killed (kill -9, the
    OOM killer), the kernel kills mpiexec (PR_SET_PDEATHSIG) and each rank's watchdog sees that its
    parent is gone (runtime/guard.py): no rank outlives it.

    mpiexec's output passes through this process: the ranks' lines go on unchanged; MPI's "BAD
    TERMINATION" banner and mpiexec's own ``[mpiexec@host]`` lines are held back. Every fault ends
    with exactly one line: the failing rank's own, else one from here naming what died first, as
    the kernel ordered the deaths (runtime/supervisor.py: the ranks' pids come from their heartbeat files
    in ``run_dir``, never from the banner), or what stopped; the held-back lines come out only
    when nothing else explains a failure.
    """
    mpiexec = find_mpiexec()
    flavor = mpiexec_flavor(mpiexec)
    env = child_environment()
    hostfile = None
    if hosts is not None:
        # The ranks' heartbeats (in run_dir) and parent check mean nothing on another host: their
        # RunConfig leaves both out (runtime/cli.py), and so does the supervision below.
        if run_dir is None:
            raise ValueError("spawn on hosts needs run_dir (for the hostfile)")
        hostfile = run_dir / "hostfile"
        hostfile.write_text(hostfile_text(hosts, flavor))
        run_dir = None
    command = mpiexec_command(mpiexec, flavor, n, worker_args, hostfile, env)
    me = os.getpid()

    def die_with_me() -> None:  # in the child, before exec: mpiexec dies with transpile run
        set_parent_death_signal()
        if os.getppid() != me:  # transpile run died before the prctl took effect
            os._exit(1)

    lifeline = listen(run_dir) if run_dir is not None else None  # before any rank can connect
    if run_dir is not None:
        become_subreaper()  # what died first, a rank or its proxy (runtime/supervisor.py)
    try:
        job = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, preexec_fn=die_with_me)
    except OSError as exc:
        if lifeline is not None:
            lifeline.close()
        raise RunError(f"cannot start {mpiexec}: {exc.strerror or exc}") from None
    output = Output()
    relays = [threading.Thread(target=relay, args=(pipe, out, output), daemon=True)
              for pipe, out in ((job.stdout, sys.stdout), (job.stderr, sys.stderr))]
    for thread in relays:
        thread.start()
    supervisor = (Supervisor(job, n, run_dir, timeout, output, Path(mpiexec).name, lifeline)
                  if run_dir is not None else None)
    received: list[int] = []

    def stop(signum, _frame) -> None:
        received.append(signum)
        kill_group(job, supervisor)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = job.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if job.poll() is None:  # an exception in here, not a signal: leave nothing running either
            kill_group(job, supervisor)
            job.wait()
    if received or code != 0:
        kill_group(job, supervisor)  # stragglers of a failed job (a dead mpiexec leaves its proxy and ranks), if any
    if supervisor is not None:
        supervisor.finish()
    for thread in relays:
        thread.join(timeout=5)
    if received:
        name = signal.Signals(received[0]).name
        print(f"transpile: interrupted by {name}: the {n} rank(s) were stopped", file=sys.stderr, flush=True)
        return 128 + received[0]
    if supervisor is not None and supervisor.verdict is not None:
        return 1  # the supervisor ended the job, with its line (or after a rank's)
    if code == 0:
        return 0
    if output.rank_error:
        # A rank said what went wrong: its line is the one line; its own status is the run's.
        return (supervisor.rank_status() if supervisor is not None else None) or (code if 0 < code < 128 else 1)
    line = supervisor.explain(code) if supervisor is not None else None
    if line is None and output.banner.pid is not None:
        line = output.banner.describe()
    if line is None:
        output.release()  # nothing here explains it: mpiexec's own lines may
        return code if 0 < code < 128 else 1
    print(f"transpile: error: {line}", file=sys.stderr, flush=True)
    return 1
