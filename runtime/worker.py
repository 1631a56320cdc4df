"""One rank process under MPI: ``python -m runtime.worker --config FILE`` (the RunConfig that
``transpile run`` resolved, runtime/config.py), or ``run_as_rank`` under a foreign launcher.

Failure handling keeps the "one line per error, no hang" promise in two phases:
1. setup (plan, data, world size, building sessions) issues no collective, so every rank finishes
   it, even after an error; then the ranks agree (one allgather) whether anyone failed. On failure
   rank 0 prints each distinct error once and every rank exits with status 2: nobody hangs.
2. training: a rank that fails prints one line naming itself and tears the job down (exit non-zero
   when we spawned mpiexec, which then kills the others; MPI_Abort under a foreign launcher).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from runtime import checkpoint
from runtime.collectives.mpi import MpiCommunicator
from runtime.config import RunConfig
from runtime.data import Dataset
from runtime.devices import check_gpus, resolve_backend
from runtime.errors import PeerFailed, RunError
from runtime.evaluate import make_evaluator
from runtime.executor import CpuBackend
from runtime.guard import PARENT_ENV, RUN_DIR_ENV, Watchdog, set_parent_death_signal, timeout_from_env
from runtime.launcher import SPAWNED_ENV, check_world_size, detect_launcher
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
    # Ranks on one host share its cores; onnxruntime's default (all cores each) oversubscribes them.
    from mpi4py import MPI

    local = comm.comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return max(1, (os.cpu_count() or 1) // local.Get_size())
    finally:
        local.Free()


def _tear_down(comm: MpiCommunicator, code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get(SPAWNED_ENV) == "1":
        os._exit(code)  # our mpiexec kills the other ranks when one exits non-zero
    # An outside launcher's proxy forwards our stderr asynchronously; MPI_Abort tears it down at
    # once, and the line just printed was lost (seen with Hydra): give it a moment to go out.
    time.sleep(0.5)
    comm.abort(code)


def _agreed_exit(comm: MpiCommunicator) -> int:
    """Every rank knows of the error: each ends normally with status 2 (no MPI_Abort, no banner),
    after a barrier, so the rank that prints the line has printed it before any rank exits (our
    mpiexec kills the others as soon as one exits non-zero). The watchdog bounds the barrier."""
    sys.stdout.flush()
    sys.stderr.flush()
    comm.barrier()
    return 2


def _local_rank(comm: MpiCommunicator) -> tuple[int, int]:
    """This rank's index among the ranks of its host, and their number: the GPU it drives."""
    from mpi4py import MPI

    local = comm.comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.Get_rank(), local.Get_size()
    finally:
        local.Free()


def _make_backend(config: RunConfig, comm: MpiCommunicator):
    """(backend, communicator the trainer uses); for nccl the NCCL communicator is not joined yet."""
    backend = resolve_backend(config.backend)
    if backend == "cpu":
        return CpuBackend(threads=_threads_per_rank(comm)), comm
    from runtime.gpu import GpuBackend, NcclCommunicator

    local_rank, local_size = _local_rank(comm)
    check_gpus(local_size, f"{local_size} rank(s) on this host")
    return GpuBackend(local_rank, tf32=config.tf32), NcclCommunicator(comm, local_rank)


def run_as_rank(setup: Setup) -> int:
    """Run this process as the rank its launcher gave it; returns the exit status. ``setup`` loads
    the plan, the data and the run's configuration (errors in it are agreed on, phase 1 above)."""
    # Ctrl-C ends a rank at once, with no traceback: Python's handler would only run once the call
    # in progress returns, and a rank blocked in a collective whose peer has gone never returns.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    spawned = os.environ.get(SPAWNED_ENV) == "1"
    if spawned:
        set_parent_death_signal()  # the rank dies with its parent (mpiexec's proxy), however it dies
    comm = MpiCommunicator()
    rank_comm = comm  # the communicator training uses (its ``current`` collective names a timeout)
    run_dir = os.environ.get(RUN_DIR_ENV)
    watchdog = Watchdog(comm.rank, comm.size, timeout=timeout_from_env(), exit=lambda code: _tear_down(comm, code),
                        run_dir=Path(run_dir) if run_dir else None,
                        parent=os.environ.get(PARENT_ENV) if spawned else None,
                        activity=lambda: getattr(rank_comm, "current", None)).start()
    watchdog.arm()  # the setup agreement below is a collective too: a rank stopped in setup must not hang the rest
    trainer = evaluator = error = None
    try:
        plan, dataset, config = setup()
        watchdog.timeout = config.timeout
        watchdog.progress(0, "start-up")
        launcher = detect_launcher()
        check_world_size(comm.size, plan.world_size, launcher.launcher if launcher else "MPI")
        backend, rank_comm = _make_backend(config, comm)
        trainer = Trainer(plan, rank_comm, rank=comm.rank, backend=backend)
        evaluator = make_evaluator(trainer, config)
        if comm.rank == 0 and config.checkpoint is not None and os.environ.get(SPAWNED_ENV) != "1":
            # Under an outside launcher no parent holds the checkpoint lock: rank 0 does.
            lock = checkpoint.Lock(config.checkpoint)  # noqa: F841 (held until the process ends)
    except RunError as exc:
        error = str(exc)
    except Exception as exc:  # a bug: keep its traceback, but still reach the agreement below
        traceback.print_exc()
        error = f"internal error: {type(exc).__name__}: {exc}".splitlines()[0]
    if error is None:
        try:
            mine = fingerprint(plan, dataset, config)
        except Exception as exc:  # noqa: BLE001 - reach the agreement whatever happened
            error = f"internal error: fingerprint: {type(exc).__name__}: {exc}".splitlines()[0]
    # One small collective: every rank's setup error (if any) and its fingerprint of the run.
    gathered = comm.comm.allgather((error, None if error else mine))
    errors = [e for e, _ in gathered]
    if not any(errors):
        disagreement = compare_fingerprints([f for _, f in gathered])
        if disagreement:
            errors = [disagreement] * comm.size
    if any(errors):
        if comm.rank == 0:
            distinct = list(dict.fromkeys(e for e in errors if e))
            for message in distinct:
                ranks = [r for r, e in enumerate(errors) if e == message]
                where = "" if len(ranks) == comm.size else f"rank {', '.join(map(str, ranks))}: "
                print(f"transpile: error: {where}{message}", file=sys.stderr, flush=True)
        return 2
    try:
        if rank_comm is not comm:
            rank_comm.connect()  # NCCL init is a collective: only once every rank is known to be set up
        train(trainer, dataset, config, log=lambda line: print(line, flush=True), progress=watchdog.progress,
              evaluator=evaluator)
        watchdog.disarm()
    except PeerFailed:
        # Every rank knows (a host agreement): the rank that failed prints its line; all exit 2.
        return _agreed_exit(comm)
    except RunError as exc:
        print(f"transpile: error: rank {comm.rank}: {exc}", file=sys.stderr, flush=True)
        if getattr(exc, "agreed", False):
            return _agreed_exit(comm)
        _tear_down(comm, 2)
    except Exception as exc:  # a bug, not a user error: keep the traceback
        traceback.print_exc()
        print(f"transpile: error: rank {comm.rank}: internal error: {type(exc).__name__}", file=sys.stderr)
        _tear_down(comm, 1)
    return 0


def fingerprint(plan: Plan, dataset: Dataset, config: RunConfig) -> dict[str, str]:
    """What every rank must agree on before the first collective, as short printable values: the
    plan (its hash covers the collectives of every rank in order), the run configuration, the data
    and the runtime's version. Ranks started by hand or by an outside launcher can differ in any."""
    from dataclasses import asdict

    from runtime import checkpoint as ckpt

    data = ",".join(f"{name}{list(a.shape)}{a.dtype}" for name, a in sorted(dataset.arrays.items()))
    return {
        "lr": f"{config.lr:g}",
        "lr schedule": ",".join(f"{k}={v}" for k, v in asdict(config.schedule).items()),
        "steps": str(config.steps),
        "batch": str(config.batch),
        "data order": f"shuffle={config.shuffle},seed={config.seed if config.shuffle else 0}",
        "data": hashlib.sha256(data.encode()).hexdigest()[:16] if len(data) > 60 else data,
        "resume": str(config.resume),
        "evaluation": (f"every={config.eval_every},batch={config.eval_batch},best={config.export_best}"
                       if config.eval_data is not None else "none"),
        "plan": ckpt.plan_hash(plan)[:16],
        "runtime version": _version(),
    }


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


def load_setup(path: str) -> tuple[Plan, Dataset, RunConfig]:
    """What a spawned rank runs: the configuration ``transpile run`` resolved, and its plan and data."""
    config = RunConfig.load(path)
    plan = load_plan(config.out)
    return plan, Dataset.load(config.data, plan.data_inputs), config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.worker", description="One rank of `transpile run`.")
    parser.add_argument("--config", required=True, metavar="FILE", help="the run configuration 'transpile run' wrote")
    args = parser.parse_args(argv)
    return run_as_rank(lambda: load_setup(args.config))


if __name__ == "__main__":
    sys.exit(main())
