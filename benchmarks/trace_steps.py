"""``python -m benchmarks steps TRACE [TRACE ...]``: where each recorded step of a rank's Chrome trace
(``compare --traces``) spends its GPU time, step by step.

A step is the GPU work the host enqueued inside one ``bench_step`` range (bench_worker.kernel_profile
marks each recorded step so): the device activities whose correlation id is that of a CUDA runtime
or driver call made inside the range (a replayed session's kernels all carry its graph launch's).
Per step: ``span_ms`` (first activity to last), ``compute_ms`` (the time any non-NCCL activity
runs), ``nccl_ms`` (the time an NCCL kernel runs), ``exposed_ms`` (NCCL with nothing else beside
it: communication not hidden), ``idle_ms`` (nothing runs: the device waits for the host or a peer),
and ``tail_ms``: from the end of the last compute activity before the step's last NCCL kernel to
the end of that kernel (the reduction the backward could not hide). The medians over the steps
show what the rows' step time is made of; docs/benchmarks.md reads GPT-2-small's 4-GPU step so.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from statistics import median

from benchmarks.bench_lib import STEP_RANGE as STEP
from benchmarks.bench_lib import interval_length, interval_overlap, interval_union

DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CALLS = ("cuda_runtime", "cuda_driver")
KEYS = ("span_ms", "compute_ms", "nccl_ms", "exposed_ms", "idle_ms", "tail_ms")


def _is_nccl(event: dict) -> bool:
    return "nccl" in event["name"].lower()


def step_breakdown(events: list[dict]) -> list[dict[str, float]]:
    """One dict of KEYS per ``bench_step`` range of ``events`` (a Chrome trace's traceEvents), in
    order; a step with no device activity is left out."""
    ranges = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == STEP and "dur" in e)
    calls = [e for e in events if e.get("cat") in HOST_CALLS and "correlation" in e.get("args", {})]
    device: dict[int, list[dict]] = {}
    for e in events:
        if e.get("cat") in DEVICE and "dur" in e and "correlation" in e.get("args", {}):
            device.setdefault(e["args"]["correlation"], []).append(e)
    steps = []
    for start, end in ranges:
        mine = [a for c in calls if start <= c["ts"] <= end for a in device.get(c["args"]["correlation"], [])]
        if mine:
            steps.append(_breakdown(mine))
    return steps


def _breakdown(activities: list[dict]) -> dict[str, float]:
    intervals = [(a["ts"], a["ts"] + a["dur"], _is_nccl(a)) for a in activities]
    compute = interval_union([(s, e) for s, e, nccl in intervals if not nccl])
    comm = interval_union([(s, e) for s, e, nccl in intervals if nccl])
    every = interval_union([(s, e) for s, e, _ in intervals])
    first, last = min(s for s, _, _ in intervals), max(e for _, e, _ in intervals)
    tail = 0.0
    if comm:
        last_start, last_end = comm[-1]
        before = [e for s, e in compute if s < last_start]
        tail = max(0.0, last_end - max(before)) if before else last_end - last_start
    ms = lambda us: round(us / 1e3, 4)  # noqa: E731
    return {"span_ms": ms(last - first), "compute_ms": ms(interval_length(compute)), "nccl_ms": ms(interval_length(comm)),
            "exposed_ms": ms(interval_length(comm) - interval_overlap(comm, compute)), "idle_ms": ms(last - first - interval_length(every)),
            "tail_ms": ms(tail)}


def load_events(path: str | Path) -> list[dict]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks steps", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="Chrome traces of compare --traces (.json or .json.gz), one per rank")
    args = p.parse_args(argv)
    print("| trace | steps | " + " | ".join(f"{k} (median)" for k in KEYS) + " |")
    print("|---|---|" + "---|" * len(KEYS))
    status = 0
    for path in args.traces:
        try:
            steps = step_breakdown(load_events(path))
        except (OSError, ValueError, KeyError) as exc:
            print(f"benchmarks steps: {path}: {exc}")
            status = 1
            continue
        if not steps:
            print(f"| {Path(path).name} | 0 | " + " | ".join("-" for _ in KEYS) + " |")
            continue
        print(f"| {Path(path).name} | {len(steps)} | " + " | ".join(f"{median(s[k] for s in steps):.3f}" for k in KEYS) + " |")
    return status
