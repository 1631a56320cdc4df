"""One rank process: ``python -m runtime.worker --config FILE`` (``--config-json JSON`` on other
hosts) under our mpiexec (the RunConfig that ``transpile run`` resolved, runtime/config.py), or
``run_as_rank`` under a foreign launcher (mpirun, srun, torchrun: runtime/launcher.py). The ranks'
host-side agreements go through a host group (runtime/bootstrap.py): MPI, or the TCP bootstrap
under torchrun.

Before it joins the host group a rank knows how it was started and its ``--timeout``: a spawned
rank reads its RunConfig first (a small file: whether it was spawned, its parent's token, the run
directory of its heartbeats), a rank of an outside launcher gets the timeout from its parsed
arguments (runtime/cli.py). The watchdog runs from then on, also through the host group's join and
the setup below.

Failure handling keeps the "one line per error, no hang" promise in two phases:
1. setup (plan, data, world size, building sessions) issues no collective, so every rank finishes
   it, even after an error; then the ranks agree (one allgather) whether anyone failed. On failure
   rank 0 prints each distinct error once and every rank exits with status 2: nobody hangs.
2. training: a rank that fails prints one line naming itself and tears the job down (exit non-zero
   when we spawned mpiexec, which then kills the others; MPI_Abort under a foreign launcher).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from runtime import checkpoint
from runtime.bootstrap import HostGroup, MpiHost, torch_style_host
from runtime.collectives.base import Communicator
from runtime.collectives.mpi import MpiCommunicator
from runtime.config import AGREEMENT, DEFAULT_TIMEOUT_S, RunConfig, agreed_fields
from runtime.cores import allowed_cores, threads_per_rank
from runtime.data import Dataset
from runtime.devices import pick_gpu, resolve_backend
from runtime.errors import PeerFailed, RunError, os_error_text
from runtime.evaluate import make_evaluator
from runtime.executor import CpuBackend
from runtime.guard import Watchdog, set_parent_death_signal
from runtime.launcher import LaunchEnv, check_mpi_agrees, check_world_size, detect_launcher
from runtime.loop import train
from runtime.plan import Plan, load_plan
from runtime.trainer import Trainer

Setup = Callable[[], tuple[Plan, Dataset, RunConfig]]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("graph-transpiler")
    except Exception:  # noqa: BLE001 - not installed (run from a checkout)
        return "unknown"


def _threads_per_rank(comm: MpiCommunicator) -> int:
    """This rank's share of its cores, among the MPI ranks of its host (runtime/cores.py)."""
    own = allowed_cores()
    with _host_ranks(comm) as local:
        return threads_per_rank(own, local.allgather(own))


def _mpi_local(comm: MpiCommunicator) -> tuple[int, int]:
    """This rank's index among the MPI ranks of its host, and their number."""
    with _host_ranks(comm) as local:
        return local.Get_rank(), local.Get_size()


@contextlib.contextmanager
def _host_ranks(comm: MpiCommunicator):
    """The MPI communicator of the ranks on this rank's host, freed after use."""
    from mpi4py import MPI

    local = comm.comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        yield local
    finally:
        local.Free()


def _tear_down(host: HostGroup | None, code: int, spawned: bool, watchdog: Watchdog) -> None:
    """End this rank now with ``code`` (the others are stopped by our mpiexec, or by MPI_Abort)."""
    sys.stdout.flush()
    sys.stderr.flush()
    watchdog.note_exit(code)
    if spawned or host is None:
        os._exit(code)  # our mpiexec kills the other ranks when one exits non-zero
    # An outside launcher's proxy forwards our stderr asynchronously; MPI_Abort tears it down at
    # once, and the line just printed was lost (seen with Hydra): give it a moment to go out.
    time.sleep(0.5)
    host.abort(code)


def _agreed_exit(host: HostGroup) -> int:
    """Every rank knows of the error: each ends normally with status 2 (no MPI_Abort, no banner),
    after a barrier, so the rank that prints the line has printed it before any rank exits (our
    mpiexec kills the others as soon as one exits non-zero). The watchdog bounds the barrier."""
    sys.stdout.flush()
    sys.stderr.flush()
    host.barrier()
    return 2


def _finish(host: HostGroup, comm: MpiCommunicator | None, watchdog: Watchdog, code: int,
            training: Communicator | None = None) -> int:
    """The rank's last collective steps, still under the watchdog: closing the communicator training
    used (``training``: NCCL's goes after the sessions that captured its calls, NcclCommunicator.close),
    the host group and MPI finalization (a peer stopped there would hang this rank for ever
    otherwise); then the exit is recorded for ``transpile run``. Returns ``code``."""
    watchdog.progress(watchdog.step, "shutdown")
    if training is not None:
        training.close()
    host.close()
    if comm is not None:
        finalize_mpi()
    watchdog.disarm()
    sys.stdout.flush()
    sys.stderr.flush()
    watchdog.note_exit(code)
    return code


def _join_hosts(launch: LaunchEnv | None, timeout: float) -> tuple[HostGroup, MpiCommunicator | None]:
    """The ranks' host group, and the MPI communicator where the launcher made MPI processes (our
    own mpiexec, mpirun, srun); torchrun's ranks meet over the TCP bootstrap instead, waiting up to
    ``timeout`` seconds for each other."""
    if launch is not None and not launch.mpi:
        return torch_style_host(os.environ, launch.rank, launch.size, timeout), None
    init_mpi()
    comm = MpiCommunicator()
    if launch is not None:
        check_mpi_agrees(launch, comm.rank, comm.size)
    return MpiHost(comm), comm


def init_mpi() -> None:
    """MPI_Init_thread without holding Python's GIL, so that this rank's watchdog thread keeps
    running (heartbeats, the timeout) while it waits there for a peer that is stopped or never
    comes: mpi4py's own initialization, on import, holds the GIL through the call. The call goes
    through ctypes (which releases the GIL) into the MPI library mpi4py has loaded; mpi4py then
    finds MPI initialized (and still finalizes it at exit if nobody did)."""
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = True
    from mpi4py import MPI

    if MPI.Is_initialized():
        return
    library = _loaded_mpi_library()
    if library is None:
        MPI.Init_thread(MPI.THREAD_MULTIPLE)  # as mpi4py would (with the GIL held)
        return
    provided = ctypes.c_int(0)
    code = library.MPI_Init_thread(None, None, ctypes.c_int(MPI.THREAD_MULTIPLE), ctypes.byref(provided))
    if code != 0:
        raise RunError(f"MPI initialization failed (MPI_Init_thread returned error {code})")


def finalize_mpi() -> None:
    """MPI_Finalize without holding the GIL (see ``init_mpi``): a peer stopped before its own
    finalization can hold this rank there, and the watchdog must still run."""
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    library = _loaded_mpi_library()
    if library is None:
        MPI.Finalize()
    else:
        library.MPI_Finalize()


def _loaded_mpi_library():
    """The MPI library in this process (ctypes), from /proc/self/maps; None where unknown."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
        if "/libmpi" in path and ".so" in path:
            try:
                library = ctypes.CDLL(path)
                library.MPI_Init_thread  # noqa: B018 - present, or try the next one
            except (OSError, AttributeError):
                continue
            return library
    return None


def _make_backend(config: RunConfig, host: HostGroup, comm: MpiCommunicator | None, launch: LaunchEnv | None):
    """(backend, communicator the trainer uses); for nccl the NCCL communicator is not joined yet."""
    if config.backend == "cpu":
        if comm is None:
            raise RunError(f"the cpu backend moves tensors with MPI, and {launch.launcher} starts no MPI processes: "
                           f"start the {host.size} ranks with `mpirun -n {host.size} transpile run ...` (or plain "
                           "`transpile run ...`, which starts them itself); torchrun works for --backend nccl")
        return CpuBackend(threads=_threads_per_rank(comm)), comm
    from runtime.gpu import GpuBackend, NcclCommunicator

    local_rank = launch.local_rank if launch is not None else None
    local_size = launch.local_size if launch is not None else None
    if comm is not None and (local_rank is None or local_size is None):
        mpi_rank, mpi_size = _mpi_local(comm)
        local_rank = mpi_rank if local_rank is None else local_rank
        local_size = mpi_size if local_size is None else local_size
    if local_rank is None:
        raise RunError(f"{launch.launcher} gave this rank no local rank (LOCAL_RANK): cannot tell which GPU it drives")
    device = pick_gpu(local_rank, local_size)
    return (GpuBackend(device, tf32=config.tf32, ep_options=config.ep_options, per_item_timings=config.timings is not None),
            NcclCommunicator(host, device, timeout=config.timeout))


def run_as_rank(setup: Setup, *, timeout: float = DEFAULT_TIMEOUT_S, spawned: bool = False,
                parent: str | None = None, run_dir: Path | None = None) -> int:
    """Run this process as the rank its launcher gave it; returns the exit status. ``setup`` loads
    the plan, the data and the run's configuration (errors in it are agreed on, phase 1 above).

    What is known before ``setup``, from the rank's RunConfig when ``transpile run`` spawned it
    (runtime/config.py), else from its command line: ``timeout`` (``--timeout``, for the watchdog
    and the torch-style bootstrap's wait), ``spawned`` (our mpiexec started this rank: a failing
    rank just exits), ``parent`` (the token of the ``transpile run`` whose end ends this rank) and
    ``run_dir`` (where the heartbeat files go)."""
    # Ctrl-C ends a rank at once, with no traceback: Python's handler would only run once the call
    # in progress returns, and a rank blocked in a collective whose peer has gone never returns.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if spawned:
        set_parent_death_signal()  # the rank dies with its parent (mpiexec's proxy), however it dies
    try:
        launch = detect_launcher()
    except RunError as exc:
        print(f"transpile: error: {exc}", file=sys.stderr, flush=True)
        return 2
    # The watchdog runs, armed, from before the rank joins the others (MPI initialization, a
    # torch-style bootstrap) until after MPI finalization: a peer stopped at any stage ends the job
    # within --timeout. Until the host group exists its rank is the launcher's (the same as MPI's:
    # check_mpi_agrees).
    watchdog = Watchdog(launch.rank if launch else 0, (launch.size or 1) if launch else 1, timeout=timeout,
                        exit=lambda code: _tear_down(None, code, spawned, watchdog), run_dir=run_dir,
                        parent=parent if spawned else None)
    if spawned:
        watchdog.record_endings()  # crashes and signals are written down for transpile run
    watchdog.start().arm()
    try:
        return _rank_life(setup, launch, watchdog, timeout=timeout, spawned=spawned)
    except SystemExit as exc:  # every way out is recorded for transpile run (runtime/supervisor.py)
        watchdog.note_exit(exc.code if isinstance(exc.code, int) else 1)
        raise
    except BaseException:
        watchdog.note_exit(1)
        raise


def _rank_life(setup: Setup, launch: LaunchEnv | None, watchdog: Watchdog, *, timeout: float, spawned: bool) -> int:
    """``run_as_rank`` from joining the other ranks to finalization, under ``watchdog``."""
    try:
        host, comm = _join_hosts(launch, timeout)
    except RunError as exc:  # no agreement is possible without the host group: each rank says why (its rank in it)
        print(f"transpile: error: {exc}", file=sys.stderr, flush=True)
        watchdog.note_exit(2)
        return 2
    watchdog.rank, watchdog.size = host.rank, host.size
    watchdog.exit = lambda code: _tear_down(host, code, spawned, watchdog)
    rank_comm = comm  # the communicator training uses (its ``current`` collective names a timeout)
    watchdog.activity = lambda: getattr(rank_comm, "current", None)
    trainer = evaluator = error = None
    try:
        plan, dataset, config = setup()
        watchdog.timeout = config.timeout
        watchdog.progress(0, "start-up")
        check_world_size(host.size, plan.world_size, launch.launcher if launch else "MPI")
        config = replace(config, backend=resolve_backend(config.backend))
        backend, rank_comm = _make_backend(config, host, comm, launch)
        trainer = Trainer(plan, rank_comm, rank=host.rank, backend=backend, accumulation=config.grad_accumulation)
        evaluator = make_evaluator(trainer, config)
        if host.rank == 0 and config.checkpoint is not None and not spawned:
            # Under an outside launcher no parent holds the checkpoint lock: rank 0 does.
            lock = checkpoint.Lock(config.checkpoint)  # noqa: F841 (held until the process ends)
    except RunError as exc:
        error = str(exc)
    except OSError as exc:  # a file of the run that cannot be read or written: one line naming it
        error = os_error_line(exc)
    except Exception as exc:  # a bug: keep its traceback, but still reach the agreement below
        traceback.print_exc()
        error = f"internal error: {type(exc).__name__}: {exc}".splitlines()[0]
    if error is None:
        try:
            mine = fingerprint(plan, dataset, config, evaluator)
        except Exception as exc:  # noqa: BLE001 - reach the agreement whatever happened
            error = f"internal error: fingerprint: {type(exc).__name__}: {exc}".splitlines()[0]
    # One small exchange: every rank's setup error (if any) and its fingerprint of the run.
    try:
        gathered = host.allgather([error, None if error else mine])
    except RunError as exc:  # the TCP bootstrap lost a rank: no agreement to be had
        print(f"transpile: error: rank {host.rank}: {exc}", file=sys.stderr, flush=True)
        watchdog.note_exit(2)
        return 2
    errors = [e for e, _ in gathered]
    if not any(errors):
        disagreement = compare_fingerprints([f for _, f in gathered])
        if disagreement:
            errors = [disagreement] * host.size
    if any(errors):
        if host.rank == 0:
            distinct = list(dict.fromkeys(e for e in errors if e))
            for message in distinct:
                ranks = [r for r, e in enumerate(errors) if e == message]
                where = "" if len(ranks) == host.size else f"rank {', '.join(map(str, ranks))}: "
                print(f"transpile: error: {where}{message}", file=sys.stderr, flush=True)
        # No rank exits (and has its launcher stop rank 0) before the line is out.
        return _finish(host, comm, watchdog, _agreed_exit(host))
    if host.rank == 0 and launch is not None and not spawned:
        print(f"launcher: {launch.launcher} ({host.size} rank(s), backend {config.backend})", flush=True)
    try:
        if rank_comm is not comm:
            rank_comm.connect()  # NCCL init is a collective: only once every rank is known to be set up
        train(trainer, dataset, config, log=lambda line: print(line, flush=True), progress=watchdog.progress,
              evaluator=evaluator)
    except PeerFailed:
        # Every rank knows (a host agreement): the rank that failed prints its line; all exit 2.
        return _finish(host, comm, watchdog, _agreed_exit(host), rank_comm)
    except RunError as exc:
        print(f"transpile: error: rank {host.rank}: {exc}", file=sys.stderr, flush=True)
        if getattr(exc, "agreed", False):
            return _finish(host, comm, watchdog, _agreed_exit(host), rank_comm)
        _tear_down(host, 2, spawned, watchdog)
    except OSError as exc:  # a write the loop does not handle itself (stdout closed, ...): one line
        print(f"transpile: error: rank {host.rank}: {os_error_line(exc)}", file=sys.stderr, flush=True)
        _tear_down(host, 2, spawned, watchdog)
    except Exception as exc:  # a bug, not a user error: keep the traceback
        traceback.print_exc()
        print(f"transpile: error: rank {host.rank}: internal error: {type(exc).__name__}", file=sys.stderr)
        _tear_down(host, 1, spawned, watchdog)
    return _finish(host, comm, watchdog, 0, rank_comm)


def os_error_line(exc: OSError) -> str:
    """An OSError as the one-line message: the path and the error."""
    where = exc.filename if exc.filename is not None else "I/O"
    return f"{where}: {os_error_text(exc)}"


def fingerprint(plan: Plan, dataset: Dataset, config: RunConfig, evaluator=None) -> dict[str, str]:
    """What every rank must agree on before the first collective, as short printable values keyed
    by how the user names them: each AGREED field of the RunConfig (runtime/config.py ``AGREEMENT``,
    the one place that decides), the plan (its hash covers the collectives of every rank in order)
    and the data as their signatures, and the runtime's version. Ranks started by hand or by an
    outside launcher can differ in any."""
    values = {}
    for name in agreed_fields():
        label = AGREEMENT[name][1]
        value = getattr(config, name)
        if name == "out":
            values[label] = checkpoint.plan_hash(plan)[:16]
        elif name == "data":
            values[label] = _data_signature(dataset)
        elif name == "eval_data":
            values[label] = "none" if value is None else _data_signature(evaluator.dataset if evaluator else None)
        elif name == "seed":
            values[label] = str(value if config.shuffle else 0)
        elif name == "schedule":
            values[label] = ",".join(f"{k}={v}" for k, v in dataclasses.asdict(value).items())
        elif isinstance(value, float):
            values[label] = f"{value:g}"
        else:
            values[label] = str(value)
    values["runtime version"] = _version()
    return values


def _data_signature(dataset: Dataset | None) -> str:
    if dataset is None:
        return "unknown"
    data = ",".join(f"{name}{list(shape)}{dtype}" for name, (shape, dtype) in sorted(dataset.layouts.items()))
    return hashlib.sha256(data.encode()).hexdigest()[:16] if len(data) > 60 else data


def compare_fingerprints(prints: list[dict[str, str]]) -> str | None:
    """One line naming every field the ranks disagree on, with each value and its ranks."""
    parts = []
    for field in prints[0]:
        values = [p.get(field) for p in prints]
        if len(set(values)) > 1:
            groups: dict[str | None, list[int]] = {}
            for rank, value in enumerate(values):
                groups.setdefault(value, []).append(rank)
            said = "; ".join(f"rank {', '.join(map(str, ranks))}: {value}" for value, ranks in groups.items())
            parts.append(f"{field} ({said})")
    if not parts:
        return None
    return (f"the ranks disagree on {', '.join(parts)}; every rank must run the same plan and options "
            "(refused before any training collective)")


def load_setup(config: RunConfig) -> tuple[Plan, Dataset, RunConfig]:
    """What a spawned rank runs: the configuration ``transpile run`` resolved, and its plan and data."""
    plan = load_plan(config.out)
    return plan, Dataset.load(config.data, plan.data_inputs), config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.worker", description="One rank of `transpile run`.")
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--config", metavar="FILE", help="the run configuration 'transpile run' wrote")
    # Inline, as ranks on other hosts cannot read a file of the launching host's /tmp.
    given.add_argument("--config-json", metavar="JSON", help="the same, as JSON text")
    args = parser.parse_args(argv)
    # The configuration first (it is small): how this rank was started and its timeout are needed
    # before the host group is joined; plan and data are loaded in setup, under the watchdog.
    try:
        config = RunConfig.load(args.config) if args.config else _parse_config(args.config_json)
    except RunError as exc:
        unreadable = exc

        def refuse() -> tuple[Plan, Dataset, RunConfig]:  # still one line, through the ranks' agreement
            raise unreadable

        return run_as_rank(refuse)
    return run_as_rank(lambda: load_setup(config), timeout=config.timeout, spawned=config.spawned,
                       parent=config.parent, run_dir=config.run_dir)


def _parse_config(text: str) -> RunConfig:
    try:
        return RunConfig.from_json(json.loads(text))
    except (ValueError, TypeError) as exc:
        raise RunError(f"--config-json: not a run configuration written by 'transpile run' ({exc})".splitlines()[0]) from None


if __name__ == "__main__":
    sys.exit(main())
