"""`transpile` at scale: wall time, peak memory and the size of OUT against world size; writes JSON.

    python3 benchmarks/transpile_scale.py --model gpt --worlds 1,8,64,512 \
        -o benchmarks/results/transpile_scale_gpt.json                  # OUT vs N (docs/scale.md)
    python3 benchmarks/transpile_scale.py --model gpt2_small --worlds 1,4 --strategies sharded \
        -o benchmarks/results/transpile_memory_gpt2_small.json          # peak RSS vs the model's size

Each row runs the `transpile` command as a user does (a child process from this tree), and reads
its peak resident memory from the kernel (``wait4``'s ru_maxrss: file pages it mapped count, so
memory-mapped weights are included). ``ratio`` is that peak over the model file's bytes. OUT is
described by its total bytes, plan.json's bytes and its files (``graph_files``: the rank graphs
written, ``rank_entries``: the ranks that run them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _command(args: list[str]) -> tuple[float, int]:
    """Run ``transpile ARGS``; (wall seconds, peak RSS bytes of that process)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "commands", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"benchmark: transpile {' '.join(args)} failed: {stderr.strip().splitlines()[-1:]}")
    return seconds, usage.ru_maxrss * 1024  # Linux reports KiB


def _describe(out: Path) -> dict:
    plan = json.loads((out / "plan.json").read_text())
    ranks = plan["graphs"]["ranks"]
    files = {r[k] for r in ranks for k in ("step", "init", "accum") if k in r}
    return {
        "out_bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
        "plan_bytes": (out / "plan.json").stat().st_size,
        "rank_graph_files": len(files),
        "rank_graph_bytes": sum((out / f).stat().st_size for f in files),
        "files": sum(1 for p in out.rglob("*") if p.is_file()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", help="a built-in model (python3 -m models --help)")
    p.add_argument("--model-path", type=Path, help="--model's model.onnx, already exported (python3 -m models)")
    p.add_argument("--worlds", default="1,8,64,512")
    p.add_argument("--strategies", default="allreduce,sharded,zero")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--work", type=Path, help="where OUT dirs go (default: a temporary directory, removed)")
    p.add_argument("-o", "--output", type=Path, required=True)
    args = p.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-transpile-"))
    model = args.model_path
    if model is None:
        subprocess.run([sys.executable, "-m", "models", args.model, "-o", str(work / "model"), "--rows", "16"],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        model = work / "model" / "model.onnx"
    model_bytes = model.stat().st_size
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        for strategy in args.strategies.split(","):
            out = work / f"out-{world}-{strategy}"
            seconds, peak = _command([str(model), "--gpus", str(world), "--strategy", strategy,
                                      "--optimizer", args.optimizer, "-o", str(out)])
            row = {"world_size": world, "strategy": strategy, "seconds": round(seconds, 2), "peak_rss_bytes": peak,
                   "ratio": round(peak / model_bytes, 3), **_describe(out)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            shutil.rmtree(out)
    result = {"benchmark": "transpile_scale", "model": args.model,
              "model_bytes": model_bytes, "optimizer": args.optimizer, "host": platform.node(),
              "cpus": os.cpu_count(), "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
