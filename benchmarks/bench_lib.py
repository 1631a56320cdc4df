"""Arithmetic, JSONL records and rendering of `python -m benchmarks compare` (no torch, no GPU).

Imported as ``benchmarks.bench_lib`` by the parent command and as ``bench_lib`` by the worker
script (benchmarks/bench_worker.py runs as a file so that ``--ours-path`` trees come first on
sys.path). Everything here is unit-tested on CPU (tests/test_benchmarks_compare.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

# The keys every record has (extra keys are allowed).
STEP_RANGE = "bench_step"  # the host range bench_worker.kernel_profile puts around each recorded step
RECORD_KEYS = ("run", "date", "host", "system", "variant", "model", "gpus", "step_ms", "p90_ms",
               "kernels_per_step", "gpu_kernel_ms", "peak_mem_gib")
SYSTEMS = ("pytorch", "graph-transpiler")
BASELINE = ("pytorch", "eager")  # the ratio column divides by this row of the same model and gpus
BEGIN = "<!-- benchmarks:results:begin (written by `python -m benchmarks render`) -->"
END = "<!-- benchmarks:results:end -->"


# -- statistics -------------------------------------------------------------------------------

def median(values: Sequence[float]) -> float:
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("median of no values")
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics
    (numpy.percentile's default 'linear' method)."""
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def window_means(window_totals_ms: Sequence[float], steps_per_window: int) -> list[float]:
    """Mean step time of each window from each window's total elapsed time."""
    if steps_per_window < 1:
        raise ValueError("steps_per_window must be >= 1")
    return [t / steps_per_window for t in window_totals_ms]


def summarize(windows_ms: Sequence[float]) -> dict:
    """step_ms: median over windows of the mean step time in the window; p90_ms: its 90th percentile."""
    return {"step_ms": round(median(windows_ms), 4), "p90_ms": round(percentile(windows_ms, 90), 4),
            "windows_ms": [round(float(w), 4) for w in windows_ms]}


def kernel_summary(events: Iterable[tuple[str, float]], steps: int, top: int = 60) -> dict:
    """Per-step kernel statistics from (name, device microseconds) of every device activity
    recorded over ``steps`` steps. Memcpy/Memset activities are counted apart from kernels."""
    if steps < 1:
        raise ValueError("steps must be >= 1")
    kernels = copies = 0
    kernel_us = copy_us = 0.0
    by_name: dict[str, list[float]] = {}
    for name, us in events:
        if name.lower().startswith(("memcpy", "memset")):
            copies += 1
            copy_us += us
            continue
        kernels += 1
        kernel_us += us
        entry = by_name.setdefault(name[:100], [0, 0.0])
        entry[0] += 1
        entry[1] += us
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels_per_step": round(kernels / steps, 1), "gpu_kernel_ms": round(kernel_us / 1e3 / steps, 3),
            "copies_per_step": round(copies / steps, 1), "copy_ms": round(copy_us / 1e3 / steps, 3),
            "top_kernels": [{"name": k, "per_step": round(c / steps, 1), "ms": round(t / 1e3 / steps, 3)}
                            for k, (c, t) in ranked]}


def interval_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def interval_length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def interval_overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length where two sorted, disjoint interval lists overlap."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline_summary(events: Iterable[tuple[str, float, float]], steps: int) -> dict:
    """Where one rank's GPU time goes, per step, from (name, start us, end us) of every device
    activity over ``steps`` steps: the span from the first activity to the last; ``gpu_busy_ms``, the
    time anything runs (the union of the intervals); ``gpu_idle_ms`` = span - busy, the device
    waiting for the host (or, on several ranks, for a peer); ``nccl_ms``, the time NCCL kernels run;
    ``nccl_exposed_ms``, the time they run with nothing else beside them (communication not
    hidden behind compute)."""
    if steps < 1:
        raise ValueError("steps must be >= 1")
    every, comm, compute = [], [], []
    for name, start, end in events:
        every.append((start, end))
        (comm if "nccl" in name.lower() else compute).append((start, end))
    if not every:
        return {}
    busy, comm_u, compute_u = interval_union(every), interval_union(comm), interval_union(compute)
    span = max(b for _, b in every) - min(a for a, _ in every)
    per = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731
    return {"gpu_span_ms": per(span), "gpu_busy_ms": per(interval_length(busy)), "gpu_idle_ms": per(span - interval_length(busy)),
            "nccl_ms": per(interval_length(comm_u)), "nccl_exposed_ms": per(interval_length(comm_u) - interval_overlap(comm_u, compute_u))}


# -- records ----------------------------------------------------------------------------------

def make_record(base: dict, measured: dict | None, error: str | None = None) -> dict:
    """One JSONL line: ``base`` (run, date, host, system, variant, model, gpus, ...) plus the
    measurement; every RECORD_KEYS key is present (None when not measured)."""
    record = {k: None for k in RECORD_KEYS}
    record.update(base)
    if measured:
        record.update(measured)
    if error:
        record["error"] = error
    return record


def append_jsonl(path: str | Path, record: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, sort_keys=False) + "\n")


def load_jsonl(paths: Iterable[str | Path]) -> list[dict]:
    records = []
    for path in paths:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not JSON: {exc}") from None
    return records


def latest_run(records: Sequence[dict]) -> str:
    if not records:
        raise ValueError("no records")
    # The run of the newest record ("time", UTC ISO); default run ids start with the UTC time too.
    return max(records, key=lambda r: (r.get("time") or "", r["run"]))["run"]


def select_run(records: Sequence[dict], run: str | None = None) -> list[dict]:
    run = run or latest_run(records)
    chosen = [r for r in records if r["run"] == run]
    if not chosen:
        raise ValueError(f"no records of run {run!r} (runs: {', '.join(sorted({r['run'] for r in records}))})")
    # A row measured again within the run (same --run-id) replaces the earlier one; a row measured
    # in rounds (compare --repeat) is its latest series, shown as its median round (_series).
    rows: dict[tuple, list[dict]] = {}
    for r in chosen:
        rows.setdefault((r["system"], r["variant"], r["model"], r["gpus"]), []).append(r)
    shown = {key: _series(group) for key, group in rows.items()}
    return [shown[key] for key in dict.fromkeys((r["system"], r["variant"], r["model"], r["gpus"]) for r in chosen)]


def _series(rows: list[dict]) -> dict:
    """What a table shows of one row's records in a run: the last record, or where it is a round of
    ``compare --repeat`` (it has ``round``), the median round of its series (the records from the
    last round 0 on): that round's record plus every round's step and memory (``rounds_step_ms``,
    ``rounds_peak_mem_gib``), which the table shows as a range. The median record, not the median
    of each figure: its kernels, memory and step are one run's."""
    last = rows[-1]
    if "round" not in last:
        return last
    starts = [i for i, r in enumerate(rows) if r.get("round") == 0]
    series = [r for r in rows[starts[-1] if starts else 0:] if "round" in r]
    measured = sorted((r for r in series if r.get("step_ms") is not None), key=lambda r: r["step_ms"])
    if not measured:
        return last
    shown = dict(measured[(len(measured) - 1) // 2])
    shown["rounds_step_ms"] = [r.get("step_ms") for r in series]
    shown["rounds_peak_mem_gib"] = [r.get("peak_mem_gib") for r in series]
    return shown


def ratios(records: Sequence[dict]) -> dict[tuple, float | None]:
    """step_ms of each record divided by the (pytorch, eager) record of the same model and gpus
    (None when either is missing). Keyed by (system, variant, model, gpus)."""
    base = {(r["model"], r["gpus"]): r.get("step_ms") for r in records
            if (r["system"], r["variant"]) == BASELINE and r.get("step_ms")}
    out = {}
    for r in records:
        b = base.get((r["model"], r["gpus"]))
        s = r.get("step_ms")
        out[(r["system"], r["variant"], r["model"], r["gpus"])] = round(s / b, 3) if (s and b) else None
    return out


def best_ratio(records: Sequence[dict], model: str, gpus: int) -> float | None:
    """Best graph-transpiler step / best pytorch step, for one model and world size."""
    def best(system):
        xs = [r["step_ms"] for r in records if r["system"] == system and r["model"] == model
              and r["gpus"] == gpus and r.get("step_ms")]
        return min(xs) if xs else None
    ours, theirs = best("graph-transpiler"), best("pytorch")
    return round(ours / theirs, 3) if ours and theirs else None


def _order(records: Sequence[dict], models: Sequence[str] | None = None) -> list[dict]:
    model_order = list(models) if models else list(dict.fromkeys(r["model"] for r in records))
    variant_order = list(dict.fromkeys((r["system"], r["variant"]) for r in records))

    def key(r):
        m = model_order.index(r["model"]) if r["model"] in model_order else len(model_order)
        return (m, r["gpus"], SYSTEMS.index(r["system"]) if r["system"] in SYSTEMS else 9,
                variant_order.index((r["system"], r["variant"])))
    return sorted(records, key=key)


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render_table(records: Sequence[dict]) -> str:
    """Markdown table of one run, ordered by model, world size, system."""
    r_of = ratios(records)
    lines = [f"| model | {'GPUs' if _on_gpu(records) else 'ranks'} | system | variant | step ms (median) | p90 ms | vs PyTorch eager | "
             "kernels/step | GPU kernel ms/step | peak mem GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in _order(records):
        ratio = r_of[(r["system"], r["variant"], r["model"], r["gpus"])]
        digits = 3 if (r.get("step_ms") or 99) < 10 else 1
        step = _fmt(r.get("step_ms"), digits) + _spread(r.get("rounds_step_ms"), digits, rounds=True)
        if r.get("error"):
            step = "error: " + str(r["error"]).replace("|", "/").splitlines()[0][:80]
        lines.append(f"| {r['model']} | {r['gpus']} | {r['system']} | {r['variant']} | {step} | "
                     f"{_fmt(r.get('p90_ms'), 3 if (r.get('p90_ms') or 99) < 10 else 1)} | "
                     f"{_fmt(ratio, 2) + 'x' if ratio is not None else '-'} | "
                     f"{_fmt(r.get('kernels_per_step'), 0)} | {_fmt(r.get('gpu_kernel_ms'), 2)} | "
                     f"{_fmt(r.get('peak_mem_gib'), 2)}{_spread(r.get('rounds_peak_mem_gib'), 2)} |")
    return "\n".join(lines)


def _spread(values: Sequence | None, digits: int, rounds: bool = False) -> str:
    """" (low-high, K rounds)" of a row measured in rounds (only the range where it is one value);
    "" for a row measured once."""
    known = [v for v in values or () if v is not None]
    if len(values or ()) < 2 or not known:
        return ""
    low, high = min(known), max(known)
    text = f"{low:.{digits}f}-{high:.{digits}f}" if f"{low:.{digits}f}" != f"{high:.{digits}f}" else ""
    count = f"{len(values)} rounds" if rounds else ""
    return f" ({', '.join(part for part in (text, count) if part)})" if text or count else ""


def render_summary(records: Sequence[dict]) -> str:
    """One line per (model, gpus): best ours / best pytorch."""
    out = []
    for model, gpus in dict.fromkeys((r["model"], r["gpus"]) for r in _order(records)):
        ratio = best_ratio(records, model, gpus)
        out.append(f"- {model}, {gpus} {'GPU(s)' if _on_gpu(records) else 'rank(s)'}: best graph-transpiler / best PyTorch = "
                   f"{_fmt(ratio, 2) + 'x' if ratio is not None else 'n/a'}")
    return "\n".join(out)


def _on_gpu(records: Sequence[dict]) -> bool:
    return any(r.get("device") == "cuda" for r in records)


def render_section(records: Sequence[dict], image: str | None) -> str:
    """The generated part of docs/benchmarks.md for one run."""
    first = dict(records[0])
    for key in ("torch_version", "ort_version", "device_name", "commit"):
        first[key] = next((r[key] for r in records if r.get(key)), None)
    configs = {r["model"]: r.get("config") for r in records if r.get("config")}
    # The code of each ours variant (its source digest, benchmarks/compare.py source_digest): the
    # commit alone may be a stale copy's.
    sources = {r["variant"]: r["ours_source"] for r in records if r.get("ours_source")}
    code = "".join(f", `{variant}` code {digest}" for variant, digest in sources.items())
    lines = [BEGIN, "", f"### Run `{first['run']}`", "",
             f"Host `{first['host']}`, device {first.get('device_name') or first.get('device') or '?'}, "
             f"date {first['date']}, commit {first.get('commit') or '?'}{code}; "
             f"torch {first.get('torch_version') or '?'}, onnxruntime {first.get('ort_version') or '?'}.", ""]
    for model, config in configs.items():
        lines.append(f"- `{model}`: {config}")
    lines += ["", render_table(records), "", render_summary(records), ""]
    if image:
        lines += [f"![step time relative to PyTorch eager]({image})", ""]
    lines.append(END)
    return "\n".join(lines)


def update_doc(doc_text: str, section: str) -> str:
    """Replace the generated section of a doc (between BEGIN and END), or append it."""
    if BEGIN in doc_text and END in doc_text:
        head, rest = doc_text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        return head + section + tail
    return doc_text.rstrip("\n") + "\n\n" + section + "\n"


def plot(records: Sequence[dict], path: str | Path) -> Path:
    """Bar chart: step time of every (system, variant) relative to PyTorch eager, per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in _order(records) if r.get("step_ms")]
    r_of = ratios(records)
    groups = list(dict.fromkeys((r["model"], r["gpus"]) for r in records))
    series = list(dict.fromkeys((r["system"], r["variant"]) for r in records))
    series.sort(key=lambda sv: SYSTEMS.index(sv[0]) if sv[0] in SYSTEMS else 9)  # stable: PyTorch rows first
    unit = "GPU" if _on_gpu(records) else "rank"
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(groups) * max(1, len(series) / 3)), 4))
    for i, (system, variant) in enumerate(series):
        xs, hs, labels = [], [], []
        for g, (model, gpus) in enumerate(groups):
            ratio = r_of.get((system, variant, model, gpus))
            rec = next((r for r in records if (r["system"], r["variant"], r["model"], r["gpus"]) == (system, variant, model, gpus)), None)
            if ratio is None or rec is None:
                continue
            xs.append(g + (i - (len(series) - 1) / 2) * width)
            hs.append(ratio)
            labels.append(f"{rec['step_ms']:.3g}")
        color = ("C0" if system == "pytorch" else "C3") if len(series) <= 2 else f"C{i % 10}"
        hatch = "" if system == "pytorch" else "//"
        bars = ax.bar(xs, hs, width, label=f"{system} {variant}", color=color, hatch=hatch, edgecolor="black", linewidth=0.5)
        for bar, text in zip(bars, labels):
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=7, rotation=90, xytext=(0, 2), textcoords="offset points")
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\n{g} {unit}" + ("s" if g > 1 else "") for m, g in groups])
    ax.set_ylabel("step time / PyTorch eager (lower is faster)")
    ax.set_title("median step time, labels in ms" + (f" ({records[0].get('device_name') or records[0].get('device')})" if records else ""))
    ax.legend(fontsize=7, ncol=2)
    ax.margins(y=0.2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
