"""Median step time of the GPU runtime on a GPT-2-small-shaped model; writes JSON.

    python3 benchmarks/gpu_step_time.py [-o benchmarks/results/gpu_step_time.json] [--gpus 4]
            [--strategies allreduce,sharded,zero] [--steps 30] [--warmup 8] [--window 5]

Model: benchmarks/gpu_gpt.py at GPT-2-small shape (12 layers, width 768, 12 heads, vocabulary 50304,
sequence 512, tied embedding: 124M parameters), batch 8 x 512 per GPU, AdamW, TF32 on, 25 MiB
buckets (DDP's, this script's results' since its start). For each strategy the model is transpiled for ``--gpus`` ranks (in parallel) and
run under mpiexec through the runtime's API: ``--warmup`` steps, then ``--steps`` steps timed in
windows of ``--window`` steps (host clock around each window, the compute stream synchronized at
both ends), median over windows of the mean step time. The same is then timed with the collectives
skipped (no NCCL call enqueued), so the communication left exposed is the difference. One GPU is
the single-device graph (train.onnx, no collectives, identical for every strategy).

Reference (PyTorch DDP, docs: /work/shared/design-brief.md): 30.2 ms on 1 GPU, 31.9 ms on 4.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

PER_GPU_BATCH = 8


def _timed(trainer, data: dict, lr: float, steps: int, window: int, compute) -> list[float]:
    times = []
    for _ in range(steps // window):
        compute.synchronize()
        started = time.perf_counter()
        for _ in range(window):
            trainer.step_async(data, lr)
        compute.synchronize()
        times.append((time.perf_counter() - started) * 1e3 / window)
    trainer.collect_losses()
    return times


def worker(args) -> int:
    """One rank: build the trainer once, time with collectives, then with them skipped."""
    from mpi4py import MPI

    from benchmarks.skipping import skippable_nccl, skips
    from runtime.collectives.mpi import MpiCommunicator
    from runtime.gpu import GpuBackend
    from runtime.plan import load_plan
    from runtime.trainer import Trainer

    host = MpiCommunicator(MPI.COMM_WORLD)
    backend = GpuBackend(host.rank, tf32=True)
    comm = skippable_nccl(host, host.rank)
    plan = load_plan(args.worker)
    built = time.perf_counter()
    trainer = Trainer(plan, comm, rank=None if args.single else host.rank, backend=backend)
    setup_s = time.perf_counter() - built
    comm.connect()
    trainer.initialize()
    rows = PER_GPU_BATCH
    data = dict(np.load(Path(args.worker).parent.parent / "data.npz"))  # OUT/plan.json -> work dir
    data = {k: v[host.rank * rows:(host.rank + 1) * rows] for k, v in data.items()}
    lr = 1e-4
    for _ in range(args.warmup):
        trainer.step_async(data, lr)
    losses = trainer.collect_losses()
    with_comm = _timed(trainer, data, lr, args.steps, args.window, backend.device.compute)
    skipped = None  # where skipping cannot take effect (skipping.skips)
    if skips(backend):
        comm.skip = True
        for _ in range(2):
            trainer.step_async(data, lr)
        skipped = _timed(trainer, data, lr, args.steps, args.window, backend.device.compute)
    import cupy

    peak = cupy.get_default_memory_pool().total_bytes()
    result = {"median_ms": statistics.median(with_comm), "windows_ms": with_comm,
              "skipped_median_ms": statistics.median(skipped) if skipped else None, "skipped_windows_ms": skipped,
              "first_losses": losses[:3], "session_setup_s": round(setup_s, 1), "cupy_pool_bytes": int(peak)}
    results = host.comm.gather(result, root=0)
    if host.rank == 0:
        worst = max(range(len(results)), key=lambda r: results[r]["median_ms"])
        Path(args.result).write_text(json.dumps({"per_rank": results, "slowest_rank": worst}, indent=1))
    comm.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", default=str(HERE / "results" / "gpu_step_time.json"))
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--strategies", default="allreduce,sharded,zero")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--work", default=None, help="directory for the model and OUTs (default: a temp dir)")
    p.add_argument("--prepare-only", action="store_true", help="build and transpile, time nothing (CPU only)")
    p.add_argument("--model", choices=("basic", "pytorch"), default="basic",
                   help="basic: benchmarks/gpu_gpt.py (basic ops, one-hot embedding; the model measured so far); "
                        "pytorch: models/gpt.py's GPT-2-small exported from PyTorch (Gather embedding, "
                        "LayerNorm, Softmax: the layout behind the DDP reference; needs torch)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    import tempfile

    import gpu_gpt
    import onnx

    from runtime.launcher import child_environment, find_mpiexec, mpiexec_command, mpiexec_flavor

    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    shape = gpu_gpt.GPT2_SMALL
    if not (work / "model.onnx").exists():
        if args.model == "pytorch":
            import models

            models.generate("gpt2_small", work, seed=0, rows=PER_GPU_BATCH * args.gpus)
        else:
            onnx.save(gpu_gpt.build(**shape), work / "model.onnx")
            np.savez(work / "data.npz", **gpu_gpt.make_data(shape["vocab"], shape["seq"], PER_GPU_BATCH * args.gpus))
    strategies = args.strategies.split(",")
    # Transpiling a 500 MB model takes minutes on one core: all strategies at once.
    jobs = {}
    for s in strategies:
        out = work / f"out-{s}-{args.gpus}"
        if not (out / "plan.json").exists():
            cmd = [sys.executable, "-m", "transpiler.cli", str(work / "model.onnx"), "-o", str(out), "--gpus",
                   str(args.gpus), "--strategy", s, "--optimizer", "adamw", "--lr", "1e-4",
                   "--bucket-mb", "25"]  # the cap its earlier results ran with (the default is now the model's)
            jobs[s] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    errors = {}
    for s, job in jobs.items():
        _, err = job.communicate()
        if job.returncode != 0:
            errors[s] = err.strip().splitlines()[-1] if err.strip() else f"exit {job.returncode}"
    if args.prepare_only:
        print(json.dumps({"prepared": str(work), "transpile_errors": errors}))
        return 0
    mpiexec = find_mpiexec()
    flavor = mpiexec_flavor(mpiexec)
    # Same shape either way; the PyTorch model's LM head is not tied to the embedding (162.7M vs 124M).
    report = {"model": {"kind": args.model, "shape": shape,
                        "tied_embedding": args.model == "basic", "per_gpu_batch": PER_GPU_BATCH,
                        "optimizer": "adamw", "tf32": True, "bucket_mb": 25},
              "reference_pytorch_ddp_ms": {"1": 30.2, "4": 31.9}, "results": [], "not_run": errors}

    def run(out: Path, world: int, single: bool, label: str) -> None:
        result = work / f"{label}.json"
        cmd = mpiexec_command(mpiexec, flavor, world, [])
        cmd = cmd[:cmd.index("-m")] + [__file__, "--worker", str(out / "plan.json"), "--result", str(result),
                                        "--steps", str(args.steps), "--warmup", str(args.warmup),
                                        "--window", str(args.window)] + (["--single"] if single else [])
        started = time.perf_counter()
        done = subprocess.run(cmd, env=child_environment(), capture_output=True, text=True)
        entry = {"label": label, "gpus": world, "wall_s": round(time.perf_counter() - started, 1)}
        if done.returncode != 0:
            entry["error"] = (done.stderr.strip() or done.stdout.strip())[-1500:]
        else:
            data = json.loads(result.read_text())
            slow = data["per_rank"][data["slowest_rank"]]
            skipped = slow["skipped_median_ms"]  # None where skipping cannot take effect
            entry.update(median_ms=round(slow["median_ms"], 3),
                         collectives_skipped_median_ms=None if skipped is None else round(skipped, 3),
                         exposed_comm_ms=None if skipped is None else round(slow["median_ms"] - skipped, 3), detail=data)
        report["results"].append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "detail"}), flush=True)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=1))

    done_single = False
    for s in strategies:
        out = work / f"out-{s}-{args.gpus}"
        if s in errors:
            continue
        if not done_single:  # one GPU: the single-device graph, the same for every strategy
            run(out, 1, True, "1gpu-single-device")
            done_single = True
        run(out, args.gpus, False, f"{args.gpus}gpu-{s}")
    print(json.dumps({"not_run": errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
