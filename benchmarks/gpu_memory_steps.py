"""Device memory after each of the first steps of one GPU run: where the runtime's footprint comes
from (the init graph, the first uncaptured steps, the CUDA-graph captures). docs/benchmarks.md.

    python benchmarks/gpu_memory_steps.py OUT DATA.npz ROWS [--steps 8] [--pretend-world]
        [--profile K [--trace T.json]] [--ep-option prefer_nhwc=1]

Prints one JSON line: device memory in use (cudaMemGetInfo, GiB, the whole device) before the
runtime starts, after the init graph, after each step (synchronized), and at the end the parts
the runtime knows of: CuPy's pool (the state, the collectives' buckets, the block of values passed
between items, ``block``), the rest (onnxruntime's arenas, cuBLAS/cuDNN workspaces, NCCL), the
step program's sessions and whether they share one arena, and the mean step time of a few more
steps (host enqueue included, not synchronized per step); with ``--profile K`` the kernels of K
steps (torch.profiler, as `benchmarks compare` records them).

``--pretend-world``: OUT was transpiled for N > 1 ranks; run its rank 0 (``--rank R``: rank R) alone
on this one GPU with a communicator that launches no collective (every bucket keeps its own
values). The program is the N-rank one, so its buffers, sessions, arenas and captures are the ones
that rank would have; what is missing is NCCL's own memory and the communication. This measures
the N-rank footprint on a one-GPU machine. GRAPH_TRANSPILER_NATIVE_OFF applies (docs/cli.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from runtime.config import parse_ep_options
from runtime.gpu import GpuBackend, NcclCommunicator
from runtime.gpu.session import OrtCudaSegment
from runtime.plan import load_plan
from runtime.trainer import Trainer

GIB = 2**30


class PretendWorld(NcclCommunicator):
    """Rank ``rank`` of a world of ``size`` with no peers: connects to none and launches no collective;
    the list calls (init graphs, first step) return the caller's values or fresh buffers."""

    def __init__(self, size: int, device: int, rank: int = 0):
        super().__init__(None, device)
        self.size, self.rank = size, rank

    def connect(self) -> None:
        import threading

        threading.Thread(target=self._watch, name="nccl-watchdog", daemon=True).start()
        self._relaxed_known.wait(5.0)

    def _launches(self) -> bool:  # every collective as one rank's: each result is the input
        return False


def _world_one(device: int) -> NcclCommunicator:
    return NcclCommunicator(None, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("data")
    parser.add_argument("rows", type=int, help="per-step batch of this rank (rows of DATA)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--pretend-world", action="store_true", help="run rank 0 of an N-rank OUT alone (see above)")
    parser.add_argument("--rank", type=int, default=0, help="with --pretend-world: run this rank instead of rank 0 "
                        "(under `sharded` the ranks hold different state)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also record the kernels of STEPS steps (torch.profiler; bench_worker.kernel_profile)")
    parser.add_argument("--trace", default=None, help="with --profile: write the Chrome trace here")
    parser.add_argument("--ep-option", action="append", metavar="KEY=VALUE",
                        help="an onnxruntime CUDA EP option, as `transpile run --ep-option` takes it")
    args = parser.parse_args()
    plan = load_plan(args.out)
    backend = GpuBackend(0, tf32=True, ep_options=parse_ep_options(args.ep_option))
    cp = backend.device.cp

    def used() -> float:
        free, total = cp.cuda.runtime.memGetInfo()
        return round((total - free) / GIB, 3)

    result = {"out": args.out, "world": plan.world_size, "rank": args.rank, "before": used()}
    if plan.world_size > 1 and not args.pretend_world:
        parser.error(f"{args.out} is transpiled for {plan.world_size} ranks: pass --pretend-world")
    if not 0 <= args.rank < plan.world_size:
        parser.error(f"--rank {args.rank}: {args.out} has ranks 0..{plan.world_size - 1}")
    comm = PretendWorld(plan.world_size, 0, args.rank) if plan.world_size > 1 else _world_one(0)
    trainer = Trainer(plan, comm, rank=args.rank if plan.world_size > 1 else None, backend=backend)
    comm.connect()
    trainer.initialize()
    backend.device.compute.synchronize()
    result["after_init"] = used()
    data = {k: v[:args.rows] for k, v in np.load(args.data).items()}
    pool = cp.get_default_memory_pool()
    result["steps"], result["pool_steps"] = [], []
    for _ in range(args.steps):
        trainer.step_async(data, args.lr)
        backend.device.compute.synchronize()
        result["steps"].append(used())
        result["pool_steps"].append((round(pool.used_bytes() / GIB, 3), round(pool.total_bytes() / GIB, 3)))
    start = time.perf_counter()
    for _ in range(args.timed_steps):
        trainer.step_async(data, args.lr)
    backend.device.compute.synchronize()
    result["step_ms"] = round((time.perf_counter() - start) * 1e3 / max(args.timed_steps, 1), 3)
    if args.profile:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_worker imports its siblings by name
        from bench_worker import kernel_profile

        profile = kernel_profile(lambda: trainer.step_async(data, args.lr), backend.device.compute.synchronize, args.profile,
                                 trace=args.trace)
        result["profile"] = {k: v for k, v in profile.items() if not isinstance(v, list)}
        result["profile"]["top"] = [(k["name"][:60], k["per_step"], k["ms"]) for k in profile.get("top_kernels", [])[:12]]
    losses = trainer.collect_losses()
    program = trainer.step_program
    sessions = [r for _, r in program.steps if isinstance(r, OrtCudaSegment)]
    state = sum(int(v.nbytes) for v in trainer.state.values())
    slots = sum(int(b.nbytes) for s in program.slots.values() for b in s.buffers)
    registry = program.session_collectives  # the in-session collectives' flat buckets (ReduceScatter, AllGather)
    buckets = sum(int(b.flat.nbytes) for b in registry.buckets.values() if b.flat is not None and not b.staged) \
        if registry else 0  # a staged bucket (a ReduceScatter's) is onnxruntime's, counted in not_cupy
    result.update({
        "end": used(),
        "cupy_pool_used": round(pool.used_bytes() / GIB, 3),
        "cupy_pool_total": round(pool.total_bytes() / GIB, 3),
        "state": round(state / GIB, 3),
        "slots": round(slots / GIB, 3),
        "buckets": round(buckets / GIB, 3),  # a parameter bound to its AllGather view counts in state too
        "block": round(program.block_bytes / GIB, 3),
        # the workspace every cuDNN runner of the device shares (conv_grad.py), in CuPy's pool
        "cudnn_workspace": round(backend.device.cudnn_workspace_bytes / GIB, 3),
        "not_cupy": round(used() - result["before"] - pool.total_bytes() / GIB, 3),
        "sessions": len(sessions),
        "captured": sum(all(r.captured) for r in sessions),
        "shared_arena": any(r.shared_arena for r in sessions),
        "items": len(program.steps),
        "losses": [float(x) for x in (*losses[:4], *losses[-1:])],  # an A/B of two trees must agree (pretend-world too)
    })
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
