"""benchmarks/trace_steps.py: a rank's trace split into its recorded steps (the ``bench_step`` host
ranges, the device activities by correlation id) and each step's GPU time taken apart; and the
``python -m benchmarks steps`` command on a gzipped trace."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.trace_steps import step_breakdown

REPO = Path(__file__).resolve().parents[1]


def _call(ts: float, correlation: int, cat: str = "cuda_runtime") -> dict:
    return {"ph": "X", "cat": cat, "name": "cudaGraphLaunch", "ts": ts, "dur": 5.0, "args": {"correlation": correlation}}


def _kernel(name: str, ts: float, dur: float, correlation: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def _trace() -> list[dict]:
    """Two steps of a session replay (correlation 1, then 3) and an update launched apart (2, then 4):
    step 1: compute 0-100 and 120-200, NCCL 50-90 (hidden) and 180-260 (60 us after the last compute);
    step 2: the same 1000 us later, but its update runs 300-340 after a 40 us gap."""
    events = [{"ph": "X", "name": "bench_step", "ts": 0.0, "dur": 20.0},
              {"ph": "X", "name": "bench_step", "ts": 1000.0, "dur": 20.0},
              _call(1.0, 1), _call(2.0, 2, "cuda_driver"), _call(1001.0, 3), _call(1002.0, 4, "cuda_driver"),
              _call(5000.0, 9)]  # a call outside every step: its kernel belongs to none
    for base, session, update in ((0.0, 1, 2), (1000.0, 3, 4)):
        events += [_kernel("gemm", base + 0, 100, session), _kernel("ncclDevKernel_AllReduce", base + 50, 40, session),
                   _kernel("gemm", base + 120, 80, session), _kernel("ncclDevKernel_AllReduce", base + 180, 80, session)]
        if base:
            events.append(_kernel("fused_adam", base + 300, 40, update))
    events.append(_kernel("stray", 5000.0, 10, 9))
    return events


def test_each_step_is_taken_apart():
    first, second = step_breakdown(_trace())
    assert first == {"span_ms": 0.26, "compute_ms": 0.18, "nccl_ms": 0.12, "exposed_ms": 0.06, "idle_ms": 0.02,
                     "tail_ms": 0.06}
    # the second step's update after a gap: a longer span, more compute, and the gap idle
    assert second == {"span_ms": 0.34, "compute_ms": 0.22, "nccl_ms": 0.12, "exposed_ms": 0.06, "idle_ms": 0.06,
                      "tail_ms": 0.06}


def test_a_trace_without_step_ranges_has_no_steps():
    assert step_breakdown([e for e in _trace() if e.get("name") != "bench_step"]) == []


def test_the_command_prints_the_medians_of_each_trace(tmp_path):
    path = tmp_path / "r0.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    done = subprocess.run([sys.executable, "-m", "benchmarks", "steps", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    row = [line for line in done.stdout.splitlines() if line.startswith("| r0.trace")][0]
    assert row == "| r0.trace.json.gz | 2 | 0.300 | 0.200 | 0.120 | 0.060 | 0.040 | 0.060 |"


def test_a_missing_trace_is_one_line_and_a_non_zero_exit(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks", "steps", str(tmp_path / "nope.json")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "nope.json" in done.stdout and "Traceback" not in done.stderr


@pytest.mark.parametrize("step", [0, 1])
def test_exposed_never_exceeds_nccl_nor_idle_the_span(step):
    s = step_breakdown(_trace())[step]
    assert 0 <= s["exposed_ms"] <= s["nccl_ms"] and 0 <= s["idle_ms"] <= s["span_ms"]
