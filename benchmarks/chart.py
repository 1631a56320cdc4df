"""`python -m benchmarks chart`: step time and scaling efficiency against the number of GPUs.

    python -m benchmarks chart --runs RUN[,RUN...] [--results FILE[,FILE...]] -o docs/images/scaling.svg
        [--models gpt2_small,resnet18,perceptron] [--pytorch-variants fused,sdpa,eager]

Drawn from the rows `python -m benchmarks compare` wrote (benchmarks/results/*.jsonl), nothing
measured here. Per model two panels: the median step (a bar up to its p90) against the number of
GPUs for every series, and the efficiency, the series' own 1-GPU step divided by its N-GPU step,
with a dashed line at 1.0. A series is one PyTorch variant (DDP at N > 1) or one of our strategies.

Which row is a point: only rows of the runs named by --runs, with a measured step; when several
of those runs measured the same (model, series, GPUs) the one named later in --runs wins (within a
run the later row, as `render` does). Each point carries the letter of its run; the caption maps
letters to runs, so a chart made of several runs cannot pass for one.

Our rows are drawn as the strategy they ran, not under their label: `--strategy X` in the row's
transpile flags says it; a `default` row says nothing (the default changed from sharded to allreduce
on 2026-11-27), so its NCCL kernels do (AllReduce: allreduce; Reduce and Broadcast: sharded;
ReduceScatter and AllGather: zero), and a 1-GPU `default` row, which runs no collective, is the
strategy its run's multi-GPU `default` rows ran (on one GPU every strategy is the same program).
Rows of another source tree (`LABEL@DIR`) or with other transpile flags (bf16, placement) are not
drawn.

The SVG is the same bytes for the same rows and matplotlib version (no date, fixed hash salt, text
as text); the points themselves are written into its description (``DATA_BEGIN``), which
tests/test_benchmarks_chart.py compares with the rows whatever matplotlib draws.
"""

from __future__ import annotations

import argparse
import html
import re
import shlex
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from benchmarks import bench_lib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DOC = ROOT / "docs" / "benchmarks.md"
MODELS = ("gpt2_small", "resnet18", "perceptron")
STRATEGIES = ("allreduce", "sharded", "zero")
PYTORCH_VARIANTS = ("fused", "sdpa", "eager")
OURS, TORCH = "graph-transpiler", "pytorch"
DATA_BEGIN, DATA_END = "scaling points:", "end of points"
# The collectives each strategy launches (runtime/gpu: the NCCL kernel names in a row's top_kernels).
COLLECTIVES = {"allreduce": {"AllReduce"}, "sharded": {"Reduce", "Broadcast"}, "zero": {"ReduceScatter", "AllGather"}}
STYLE = {  # series -> (colour, marker, line style); the same in every panel
    (OURS, "allreduce"): ("C3", "o", "-"), (OURS, "sharded"): ("C1", "s", "-"), (OURS, "zero"): ("C2", "^", "-"),
    (OURS, "default"): ("C5", "D", "-"),
    (TORCH, "fused"): ("C0", "v", "-."), (TORCH, "sdpa"): ("C9", "P", "-."), (TORCH, "eager"): ("C7", "X", "-."),
}
RC = {"svg.hashsalt": "benchmarks-chart", "svg.fonttype": "none", "font.family": "DejaVu Sans", "font.size": 8,
      "axes.titlesize": 8.5, "legend.fontsize": 8}


@dataclass
class Point:
    model: str
    system: str  # OURS or TORCH
    series: str  # our strategy (or "default" when no row tells it), or the PyTorch variant
    gpus: int
    step_ms: float
    p90_ms: float | None
    run: str
    label: str  # the row's variant label (ours: "default", "allreduce", ...)
    how: str  # how the series was told: "flags", "label", "kernels", "run", "variant" or "unknown"
    efficiency: float | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.model, self.system, self.series)


# -- which series a row belongs to -----------------------------------------------------------

def collectives(row: dict) -> set[str]:
    """The NCCL collectives among a row's top kernels (``ncclDevKernel_AllReduce_Sum_f32_RING_LL``
    -> ``AllReduce``; older NCCL: ``ncclKernel_...``)."""
    found = set()
    for k in row.get("top_kernels") or []:
        m = re.match(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", str(k.get("name", "")))
        if m:
            found.add(m.group(1))
    return found


def strategy_of_kernels(row: dict) -> str | None:
    """The strategy whose collectives a multi-GPU row launched, or None (no profile, one GPU, a mix)."""
    seen = collectives(row)
    if not seen:
        return None
    hits = [s for s, names in COLLECTIVES.items() if seen <= names]
    return hits[0] if len(hits) == 1 else None


def flags_strategy(row: dict) -> tuple[bool, str | None]:
    """(drawn, strategy from flags): a row with flags other than one ``--strategy X`` is not drawn."""
    flags = list(row.get("transpile_flags") or [])
    if not flags:
        return True, None
    if len(flags) == 2 and flags[0] == "--strategy":
        return True, flags[1]
    if len(flags) == 1 and flags[0].startswith("--strategy="):
        return True, flags[0].split("=", 1)[1]
    return False, None


def run_defaults(rows: list[dict]) -> dict[str, str]:
    """run -> the strategy its multi-GPU ``default`` rows launched, where they agree."""
    seen: dict[str, set[str]] = {}
    for r in rows:
        if r["system"] == OURS and r["variant"] == "default" and not r.get("ours_path") and r["gpus"] > 1:
            s = strategy_of_kernels(r)
            if s:
                seen.setdefault(r["run"], set()).add(s)
    return {run: next(iter(s)) for run, s in seen.items() if len(s) == 1}


def series_of(row: dict, defaults: dict[str, str], pytorch_variants) -> tuple[str, str] | None:
    """(series, how) of a row, or None when it is not drawn."""
    if row["system"] == TORCH:
        return (row["variant"], "variant") if row["variant"] in pytorch_variants else None
    if row["system"] != OURS or row.get("ours_path"):
        return None
    drawn, strategy = flags_strategy(row)
    if not drawn:
        return None
    if strategy:
        return strategy, "flags"
    if row["variant"] in STRATEGIES:
        return row["variant"], "label"
    if row["variant"] != "default":
        return None
    if row["gpus"] > 1 and strategy_of_kernels(row):
        return strategy_of_kernels(row), "kernels"
    if row["run"] in defaults:
        return defaults[row["run"]], "run"
    return "default", "unknown"


# -- the points ------------------------------------------------------------------------------

def select(records: list[dict], runs: list[str], models=MODELS, pytorch_variants=PYTORCH_VARIANTS) -> list[Point]:
    """The chart's points: rows of ``runs`` with a measured step, the run named later winning a
    (model, series, GPUs) measured twice, each point with its efficiency (its series' 1-GPU step /
    its step; None without a 1-GPU point)."""
    missing = [r for r in runs if not any(row["run"] == r for row in records)]
    if missing:
        known = ", ".join(sorted({row["run"] for row in records}))
        raise ValueError(f"no rows of run(s) {', '.join(missing)} (runs: {known})")
    rows = [r for r in records if r["run"] in runs and r.get("step_ms") and r["model"] in models]
    defaults = run_defaults(rows)
    # A run with no multi-GPU default row (one GPU only) takes the strategy the other runs agree on.
    agreed = set(defaults.values())
    if len(agreed) == 1:
        defaults = {r["run"]: defaults.get(r["run"], next(iter(agreed))) for r in rows}
    chosen: dict[tuple, Point] = {}
    for run in runs:  # later runs overwrite earlier ones; within a run, later rows earlier ones
        for r in (r for r in rows if r["run"] == run):
            s = series_of(r, defaults, pytorch_variants)
            if s is None:
                continue
            p = Point(model=r["model"], system=r["system"], series=s[0], gpus=int(r["gpus"]),
                      step_ms=float(r["step_ms"]), p90_ms=r.get("p90_ms"), run=run, label=r["variant"], how=s[1])
            chosen[(*p.key, p.gpus)] = p
    points = sorted(chosen.values(), key=_order_key(models, pytorch_variants))
    base = {p.key: p.step_ms for p in points if p.gpus == 1}
    # On one GPU every strategy transpiles to the same plan (no collective): a strategy measured
    # only on N > 1 takes our one-GPU point of its model (the default's) as its baseline.
    ours_one = {p.model: p.step_ms for p in points if p.gpus == 1 and p.system == OURS and p.series in STRATEGIES}
    for p in points:
        one = base.get(p.key, ours_one.get(p.model) if p.system == OURS and p.series in STRATEGIES else None)
        if one is not None:
            p.efficiency = one / p.step_ms
    return points


def _order_key(models, pytorch_variants):
    def key(p: Point):
        if p.system == OURS:
            rank = (0, STRATEGIES.index(p.series) if p.series in STRATEGIES else len(STRATEGIES))
        else:
            variants = list(pytorch_variants)
            rank = (1, variants.index(p.series) if p.series in variants else len(variants))
        return (list(models).index(p.model), rank, p.series, p.gpus)
    return key


def series_name(system: str, series: str) -> str:
    if system == OURS:
        return f"ours {series}" + (" (strategy not recorded)" if series == "default" else "")
    return f"PyTorch {series}"


def no_baseline(points: list[Point]) -> list[Point]:
    """N-GPU points whose series has no 1-GPU point: no efficiency."""
    return [p for p in points if p.gpus > 1 and p.efficiency is None]


def letters(runs: list[str]) -> dict[str, str]:
    return {run: chr(ord("A") + i) if i < 26 else f"R{i}" for i, run in enumerate(runs)}


def data_text(points: list[Point], runs: list[str]) -> str:
    """The points as text (the SVG's description): what the picture shows, independent of how
    matplotlib draws it."""
    lines = [DATA_BEGIN, "runs (later wins): " + ", ".join(runs),
             "model | series | GPUs | step ms | p90 ms | efficiency | run | row label | series told by"]
    for p in points:
        eff = "-" if p.efficiency is None else f"{p.efficiency:.4f}"
        p90 = "-" if p.p90_ms is None else f"{p.p90_ms:.4f}"
        lines.append(f"{p.model} | {series_name(p.system, p.series)} | {p.gpus} | {p.step_ms:.4f} | {p90} | {eff} | "
                     f"{p.run} | {p.label} | {p.how}")
    lines.append(DATA_END)
    return "\n".join(lines)


def data_in_svg(svg_text: str) -> str | None:
    """The data_text written into an SVG by ``plot`` (None if it has none)."""
    m = re.search(re.escape(DATA_BEGIN) + r".*?" + re.escape(DATA_END), html.unescape(svg_text), re.S)
    return m.group(0) if m else None


# -- the picture -----------------------------------------------------------------------------

def caption(points: list[Point], runs: list[str], run_info: dict[str, str]) -> list[str]:
    tag = letters(runs)
    used = [r for r in runs if any(p.run == r for p in points)]
    out = ["Runs (the letter at each point is the run of its row; where runs measured the same point, the one "
           "named later wins): " + "; ".join(f"{tag[r]} = {r}" + (f" ({run_info[r]})" if run_info.get(r) else "")
                                             for r in used) + "."]
    out.append("Efficiency = the series' 1-GPU step / its N-GPU step, both drawn on the left (their runs may "
               "differ: see the letters). PyTorch: one process on 1 GPU, DDP at N > 1. Median step over windows; "
               "the bar reaches the p90.")
    told = sorted({p.how for p in points if p.system == OURS and p.label == "default"})
    if told:
        out.append("Our `default` rows are drawn as the strategy they ran (" + ", ".join(
            {"kernels": "told by their NCCL kernels", "run": "1 GPU: their run's multi-GPU default",
             "unknown": "not recorded: drawn as 'default'"}.get(h, h) for h in told) + ").")
    lacking = no_baseline(points)
    if lacking:
        out.append("No 1-GPU row, so no efficiency point: " + "; ".join(
            f"{p.model} {series_name(p.system, p.series)} at {p.gpus} GPUs ({tag[p.run]})" for p in lacking) + ".")
    return out


def plot(points: list[Point], runs: list[str], path: str | Path, run_info: dict[str, str] | None = None,
         batch: dict[str, int] | None = None) -> Path:
    """Write the SVG: per model, step time and efficiency against GPUs; the caption names the runs
    (``run_info``: run -> where its rows are), ``batch`` the per-GPU batch of each model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_info, batch = run_info or {}, batch or {}
    tag = letters(runs)
    models = list(dict.fromkeys(p.model for p in points))
    if not models:
        raise ValueError("no points to draw")
    series = list(dict.fromkeys((p.system, p.series) for p in points))
    notes = [line for para in caption(points, runs, run_info) for line in textwrap.wrap(para, 150)]
    with matplotlib.rc_context(RC):
        panel_h, head_h, note_h = 2.9, 0.75, 0.16 * len(notes) + 0.3
        height = panel_h * len(models) + head_h + note_h
        fig, axes = plt.subplots(len(models), 2, figsize=(11, height), squeeze=False)
        fig.subplots_adjust(left=0.07, right=0.98, hspace=0.42, wspace=0.18, top=1 - head_h / height,
                            bottom=(note_h + 0.45) / height)
        handles = {}
        for row, model in enumerate(models):
            ax_t, ax_e = axes[row]
            mine = [p for p in points if p.model == model]
            ns = sorted({p.gpus for p in mine})
            present = [s for s in series if any((p.system, p.series) == s for p in mine)]
            for i, (system, name) in enumerate(present):
                colour, marker, line = STYLE.get((system, name), (f"C{(4 + i) % 10}", "o", "-"))
                pts = sorted((p for p in mine if (p.system, p.series) == (system, name)), key=lambda p: p.gpus)
                dodge = 2 ** (0.045 * (i - (len(present) - 1) / 2))  # side by side at one N, on the log axis
                xs = [p.gpus * dodge for p in pts]
                ys = [p.step_ms for p in pts]
                up = [max(0.0, (p.p90_ms or p.step_ms) - p.step_ms) for p in pts]
                h = ax_t.errorbar(xs, ys, yerr=[[0.0] * len(pts), up], color=colour, marker=marker, linestyle=line,
                                  linewidth=1.2, markersize=5, capsize=0, elinewidth=0.8)
                handles.setdefault((system, name), h)
                for x, p in zip(xs, pts):
                    ax_t.annotate(tag[p.run], (x, p.step_ms), xytext=(3.5, -2), textcoords="offset points", fontsize=6,
                                  color=colour, va="top")
                eff = [(x, p.efficiency) for x, p in zip(xs, pts) if p.efficiency is not None]
                if eff:
                    ax_e.plot([x for x, _ in eff], [e for _, e in eff], color=colour, marker=marker, linestyle=line,
                              linewidth=1.2, markersize=5)
            ax_e.axhline(1.0, color="gray", linewidth=0.9, linestyle="--")
            top = max([1.0] + [p.efficiency for p in mine if p.efficiency is not None])
            ax_e.set_ylim(0, max(1.15, top * 1.08))
            ax_t.set_ylim(0, max((p.p90_ms or p.step_ms) for p in mine) * 1.12)
            per_gpu = f" (batch {batch[model]} per GPU)" if batch.get(model) else ""
            ax_t.set_title(f"{model}{per_gpu}: step time (ms)")
            ax_e.set_title(f"{model}: efficiency = 1-GPU step / N-GPU step")
            for ax in (ax_t, ax_e):
                ax.set_xscale("log", base=2)
                ax.set_xticks(ns)
                ax.set_xticklabels([str(n) for n in ns])
                ax.minorticks_off()
                ax.set_xlim(ns[0] / 1.35, ns[-1] * 1.35)
                ax.grid(True, axis="y", linewidth=0.4, alpha=0.5)
                ax.set_xlabel("GPUs")
            ax_t.set_ylabel("median step, ms")
            ax_e.set_ylabel("efficiency")
        order = [s for s in series if s in handles]
        fig.legend([handles[s] for s in order], [series_name(*s) for s in order], loc="upper center", ncol=min(len(order), 7),
                   frameon=False, bbox_to_anchor=(0.5, 1 - 0.05 / height))
        fig.text(0.07, 0.3 / height + 0.16 * len(notes) / height, "\n".join(notes), fontsize=7, va="top", ha="left",
                 linespacing=1.35)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="svg", metadata={"Date": None, "Title": "Scaling: step time and efficiency "
                                                  "against GPUs", "Description": data_text(points, runs)})
        plt.close(fig)
    return path


# -- the command -----------------------------------------------------------------------------

def _split(values) -> list[str]:
    return [v.strip() for value in values or [] for v in value.split(",") if v.strip()]


def chart(runs: list[str], files: list[Path], out: Path, models=MODELS, pytorch_variants=PYTORCH_VARIANTS) -> list[Point]:
    records = []
    run_info: dict[str, str] = {}
    for f in files:
        rows = bench_lib.load_jsonl([f])
        records += rows
        try:
            shown = Path(f).resolve().relative_to(ROOT).as_posix()
        except ValueError:
            shown = Path(f).name
        for r in rows:
            if r["run"] in runs:
                run_info.setdefault(r["run"], f"host {r.get('host')}, {shown}")
    points = select(records, runs, models, pytorch_variants)
    batch = {r["model"]: r["batch"] for r in records if r["run"] in runs and r.get("batch")}
    plot(points, runs, out, run_info, batch)
    return points


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks chart", description=__doc__.splitlines()[0])
    p.add_argument("--runs", required=True, action="append",
                   help="run ids, comma-separated; a point measured by several is the later one's")
    p.add_argument("--results", action="append", help="JSONL files, comma-separated (default: every "
                                                      "benchmarks/results/*.jsonl)")
    p.add_argument("-o", "--output", required=True, help="the SVG to write (e.g. docs/images/scaling.svg)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated (default {','.join(MODELS)})")
    p.add_argument("--pytorch-variants", default=",".join(PYTORCH_VARIANTS),
                   help=f"PyTorch rows drawn (default {','.join(PYTORCH_VARIANTS)})")
    args = p.parse_args(argv)
    runs = list(dict.fromkeys(_split(args.runs)))
    files = [Path(f) for f in _split(args.results)] or sorted((HERE / "results").glob("*.jsonl"))
    try:
        points = chart(runs, files, Path(args.output), _split([args.models]), _split([args.pytorch_variants]))
    except (OSError, ValueError) as exc:
        print(f"python -m benchmarks chart: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {len(points)} points from {', '.join(runs)}; "
          f"{len(no_baseline(points))} without a 1-GPU baseline")
    return 0


def doc_command(doc: Path = DOC, output: str = "docs/images/scaling.svg") -> list[str]:
    """The arguments of the `python -m benchmarks chart ... -o OUTPUT` command that
    docs/benchmarks.md says made that chart (tests and docs/images/make_images.py run it again)."""
    text = re.sub(r"\s*\n\s*", " ", doc.read_text())
    m = re.search(rf"`python3? -m benchmarks chart ([^`]*-o {re.escape(output)}(?:\s[^`]*)?)`", text)
    if not m:
        raise ValueError(f"{doc}: no `python -m benchmarks chart ... -o {output}` command")
    return shlex.split(m.group(1))


if __name__ == "__main__":
    sys.exit(main())

