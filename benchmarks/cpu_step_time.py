"""Step time of `transpile run` on CPU ranks (MPI), as a user runs it; writes JSON.

    python3 benchmarks/cpu_step_time.py [--model perceptron] [--steps 2000] [-o benchmarks/results/cpu_step_time.json]

For each world size and strategy: transpile, run `--steps` steps with a metrics record every `--window`
steps (`transpile run --metrics`), and report the median over windows (the first window, with
start-up, is dropped) of the mean step time in that window, as the runtime records it (wall time of
whole steps on rank 0, data slicing, collectives and the loss reduction included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runtime.metrics import read_metrics


def run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"benchmark: '{' '.join(cmd)}' failed: {done.stderr.strip()}")
    return done.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="perceptron")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--window", type=int, default=200)
    p.add_argument("--batch", type=int, default=256, help="global batch")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("-o", "--output", default="benchmarks/results/cpu_step_time.json")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    transpile = [sys.executable, "-m", "transpiler.cli"]
    run([sys.executable, "-m", "models", args.model, "-o", str(tmp / "model")])
    results = []
    for world in [int(w) for w in args.worlds.split(",")]:
        for strategy in ("allreduce", "sharded", "zero") if world > 1 else ("allreduce",):
            out = tmp / f"out-{world}-{strategy}"
            run(transpile + [str(tmp / "model" / "model.onnx"), "--gpus", str(world), "--strategy", strategy,
                             "--optimizer", "adamw", "--lr", "1e-4", "-o", str(out)])
            started = time.perf_counter()
            metrics = out / "metrics.jsonl"
            run(transpile + ["run", str(out), "--data", str(tmp / "model" / "data.npz"), "--batch", str(args.batch),
                             "--steps", str(args.steps), "--log-every", str(args.window), "--metrics", str(metrics)])
            wall = time.perf_counter() - started
            windows = [r["step_time_ms"] for r in read_metrics(metrics)[0]]  # mean over each window
            steady = windows[2:]  # drop step 1 and the first window (start-up, first-touch)
            results.append({
                "world_size": world, "strategy": strategy,
                "median_ms_per_step": round(statistics.median(steady), 4),
                "min_ms_per_step": round(min(steady), 4), "max_ms_per_step": round(max(steady), 4),
                "windows": len(steady), "wall_s_including_startup": round(wall, 2),
            })
            print(json.dumps(results[-1]))
    report = {
        "benchmark": "cpu_step_time", "model": args.model, "optimizer": "adamw", "global_batch": args.batch,
        "steps": args.steps, "window": args.window,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "results": results,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
