"""Run plans on the nccl backend and check them against the CPU backend (used by
tests/test_gpu_equivalence.py, and by hand to diagnose).

    mpirun -n N python benchmarks/gpu_diag.py --data DATA.npz --batch B --steps K [--save DIR] [--compare]
        [--backend nccl|cpu] OUT [OUT ...]

For each OUT (a plan for N ranks): the init graph and K steps on the GPUs (TF32 off), or with
``--backend cpu`` on CPU ranks with MPI collectives (the same driver, so CI runs the harness of the
GPU equality test without a GPU). ``--save DIR``
writes every rank's final parameters to DIR/<OUT name>.rank<r>.npz. ``--compare`` also compares, after
every step, every rank's parameters with the CPU backend's in-process simulation of the same number
of steps (slow: one simulation per step) and prints the error and whether the replicas agree. Set
GRAPH_TRANSPILER_DEBUG_SYNC=1 to synchronize the device after every segment and collective.
``--stacks-after S``: every rank writes its threads' Python stacks every S seconds while it runs,
and again when it is sent SIGTERM (faulthandler), to ``--save``/stacks.rank<r>.txt (stderr without
``--save``), so a run that hangs where no watchdog looks (making a session, cuDNN's Find, a host
collective) shows where each rank is when the caller ends it. Each rank dies with its parent
(PR_SET_PDEATHSIG), so a caller's kill of mpiexec leaves no rank holding a GPU.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
import time
from pathlib import Path

import numpy as np

from runtime import simulate
from runtime.collectives.mpi import MpiCommunicator
from runtime.data import Dataset
from runtime.executor import CpuBackend
from runtime.guard import set_parent_death_signal
from runtime.launcher import detect_launcher
from runtime.plan import load_plan
from runtime.trainer import Trainer


def max_rel(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) / (float(np.max(np.abs(b[k]))) or 1.0) for k in b)


def run_plan(host: MpiCommunicator, out: str, data: dict, args: argparse.Namespace) -> None:
    started = time.monotonic()
    plan = load_plan(out)
    dataset = Dataset(data, plan.data_inputs, args.data)
    if args.backend == "nccl":
        from runtime.gpu import GpuBackend, NcclCommunicator

        comm = NcclCommunicator(host, host.rank)
        trainer = Trainer(plan, comm, rank=host.rank, backend=GpuBackend(host.rank, tf32=False))
        comm.connect()
    else:
        comm = host
        trainer = Trainer(plan, comm, rank=host.rank, backend=CpuBackend(threads=1))
    trainer.initialize()
    rows = []
    for step in range(args.steps):
        shard = dataset.shard(step, batch=args.batch, rank=host.rank, world_size=host.size)
        loss = trainer.step(shard, plan.lr)
        if args.compare:
            every = host.comm.gather(trainer.parameters(), root=0)
            if host.rank == 0:
                ref = simulate(out, data, batch=args.batch, steps=step + 1)
                errors = ", ".join(f"{max_rel(p, ref.parameters[0]):.2e}" for p in every)
                same = all(all(np.array_equal(p[k], every[0][k]) for k in p) for p in every)
                rows.append(f"  step {step + 1}: loss gpu {loss:.6f} cpu {ref.losses[-1]:.6f}; "
                            f"max rel err per rank [{errors}]; replicas identical {same}")
    if args.save:
        np.savez(Path(args.save) / f"{Path(out).name}.rank{host.rank}.npz", **trainer.parameters())
    if host.rank == 0:
        where = "GPU(s)" if args.backend == "nccl" else "CPU rank(s)"
        print(f"{out}: {args.steps} steps on {host.size} {where}, final loss {loss:.6f}, "
              f"{time.monotonic() - started:.1f} s", flush=True)
        if rows:
            print("\n".join(rows), flush=True)
    if comm is not host:
        comm.close()
    host.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outs", nargs="+")
    p.add_argument("--data", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save")
    p.add_argument("--compare", action="store_true")
    p.add_argument("--backend", choices=("nccl", "cpu"), default="nccl")
    p.add_argument("--stacks-after", type=float, default=0, help="seconds: dump every thread's stack that often (0: never)")
    args = p.parse_args()
    set_parent_death_signal()
    if args.stacks_after > 0:
        # The rank from the launcher's environment: known before MPI starts (a hang inside it is covered).
        launch = detect_launcher()
        rank = 0 if launch is None else launch.rank
        stacks = open(Path(args.save) / f"stacks.rank{rank}.txt", "w") if args.save else sys.stderr  # noqa: SIM115
        faulthandler.dump_traceback_later(args.stacks_after, repeat=True, file=stacks)
        faulthandler.register(signal.SIGTERM, file=stacks, all_threads=True, chain=True)
    host = MpiCommunicator()
    data = dict(np.load(args.data))
    for out in args.outs:
        run_plan(host, out, data, args)


if __name__ == "__main__":
    main()
