"""`python -m benchmarks chart` (benchmarks/chart.py): which row becomes which point (the run named
later wins, our `default` rows as the strategy they ran), efficiency from the same series' 1-GPU row,
points without one skipped and said so; the same rows give the same bytes; and docs/images/scaling.svg
is what the command docs/benchmarks.md gives makes from the committed rows."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import bench_lib, chart  # noqa: E402

KERNELS = {  # the NCCL kernel names the runtime's collectives show in a row's top_kernels
    "allreduce": ["ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"],
    "sharded": ["ncclDevKernel_Reduce_Sum_f32_RING_LL(x)", "ncclDevKernel_Broadcast_RING_LL(x)"],
    "zero": ["ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)", "ncclDevKernel_AllGather_RING_LL(x)"],
}


def row(run, system, variant, model, gpus, step, *, flags=None, kernels=None, p90=None, **extra):
    r = {"run": run, "date": "2026-11-28", "host": "h", "system": system, "variant": variant, "model": model,
         "gpus": gpus, "step_ms": step, "p90_ms": p90, "batch": 8, "device": "cuda"}
    if system == "graph-transpiler":
        r.update(transpile_flags=list(flags or []), ours_path=None)
    if kernels:
        r["top_kernels"] = [{"name": k, "per_step": 1.0, "ms": 0.1} for k in KERNELS[kernels]]
    r.update(extra)
    return r


def ours(run, label, model, gpus, step, **kw):
    flags = kw.pop("flags", ["--strategy", label] if label in chart.STRATEGIES else [])
    return row(run, "graph-transpiler", label, model, gpus, step, flags=flags, **kw)


def ddp(run, variant, model, gpus, step, **kw):
    return row(run, "pytorch", variant, model, gpus, step, **kw)


def by_key(points):
    return {(p.model, p.system, p.series, p.gpus): p for p in points}


# -- which row is which point ------------------------------------------------------------------

def test_the_run_named_later_wins_whatever_the_file_order():
    old, new = 20.0, 17.0
    rows = [ours("new", "allreduce", "resnet18", 4, new), ours("old", "allreduce", "resnet18", 4, old),
            ours("old", "allreduce", "resnet18", 1, 10.0)]
    key = ("resnet18", "graph-transpiler", "allreduce", 4)
    p = by_key(chart.select(rows, ["old", "new"]))[key]
    assert (p.run, p.step_ms) == ("new", new)
    p = by_key(chart.select(rows, ["new", "old"]))[key]
    assert (p.run, p.step_ms) == ("old", old)
    # rows of runs not named are not drawn
    assert {p.run for p in chart.select(rows, ["old"])} == {"old"}


def test_efficiency_is_the_same_series_1_gpu_step_over_its_n_gpu_step():
    one_ours, four_ours, one_ddp, four_ddp = 10.0, 12.5, 20.0, 32.0
    rows = [ours("a", "allreduce", "gpt2_small", 1, one_ours), ddp("a", "fused", "gpt2_small", 1, one_ddp),
            ddp("b", "fused", "gpt2_small", 4, four_ddp), ours("b", "allreduce", "gpt2_small", 4, four_ours),
            ours("b", "zero", "gpt2_small", 4, 11.0),  # no 1-GPU zero row: ours at one GPU is one plan
            ddp("b", "sdpa", "gpt2_small", 4, 30.0),  # no 1-GPU sdpa row: another PyTorch series must not stand in
            ddp("b", "fused", "resnet18", 1, 99.0), ours("b", "zero", "resnet18", 4, 9.0)]  # nor another model's
    pts = by_key(chart.select(rows, ["a", "b"]))
    assert pts[("gpt2_small", "graph-transpiler", "allreduce", 4)].efficiency == pytest.approx(one_ours / four_ours)
    assert pts[("gpt2_small", "pytorch", "fused", 4)].efficiency == pytest.approx(one_ddp / four_ddp)
    assert pts[("gpt2_small", "graph-transpiler", "allreduce", 1)].efficiency == pytest.approx(1.0)
    assert pts[("gpt2_small", "graph-transpiler", "zero", 4)].efficiency == pytest.approx(one_ours / 11.0)
    assert [(p.model, p.series, p.gpus) for p in chart.no_baseline(list(pts.values()))] == [
        ("gpt2_small", "sdpa", 4), ("resnet18", "zero", 4)]


def test_the_1_gpu_baseline_is_the_winning_1_gpu_row():
    rows = [ours("a", "zero", "perceptron", 1, 0.5), ours("b", "zero", "perceptron", 1, 0.25),
            ours("a", "zero", "perceptron", 4, 1.0)]
    p = by_key(chart.select(rows, ["a", "b"]))[("perceptron", "graph-transpiler", "zero", 4)]
    assert p.efficiency == pytest.approx(0.25 / 1.0)
    p = by_key(chart.select(rows, ["b", "a"]))[("perceptron", "graph-transpiler", "zero", 4)]
    assert p.efficiency == pytest.approx(0.5 / 1.0)


def test_missing_baselines_are_skipped_and_named_in_the_footnote(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [ddp("x2", "eager", "resnet18", 2, 15.0), ours("x4", "allreduce", "resnet18", 1, 13.0),
            ours("x4", "allreduce", "resnet18", 4, 14.0)]
    points = chart.select(rows, ["x2", "x4"])
    lonely = chart.no_baseline(points)
    assert [(p.system, p.series, p.gpus, p.run) for p in lonely] == [("pytorch", "eager", 2, "x2")]
    note = " ".join(chart.caption(points, ["x2", "x4"], {}))
    assert "No 1-GPU row, so no efficiency point: resnet18 PyTorch eager at 2 GPUs (A)" in note
    svg = chart.plot(points, ["x2", "x4"], tmp_path / "c.svg").read_text()
    assert "No 1-GPU row" in svg
    data = chart.data_in_svg(svg)
    assert "resnet18 | PyTorch eager | 2 | 15.0000 | - | - | x2" in data
    # every run is named in the picture, with its letter
    assert "A = x2" in svg and "B = x4" in svg


def test_a_full_series_has_no_footnote():
    rows = [ours("r", "zero", "resnet18", 1, 13.0), ours("r", "zero", "resnet18", 4, 14.0)]
    points = chart.select(rows, ["r"])
    assert chart.no_baseline(points) == []
    assert not any("No 1-GPU row" in line for line in chart.caption(points, ["r"], {}))


def test_default_rows_are_drawn_as_the_strategy_they_ran():
    rows = [ours("s24", "default", "gpt2_small", 1, 33.0), ours("s24", "default", "gpt2_small", 4, 38.8, kernels="sharded"),
            ours("s25", "default", "gpt2_small", 1, 32.9), ours("s25", "default", "gpt2_small", 4, 37.2, kernels="allreduce"),
            ours("s26", "default", "gpt2_small", 4, 36.0, kernels="zero"),
            ours("s27", "default", "resnet18", 1, 13.0)]  # nothing tells its strategy
    pts = by_key(chart.select(rows, ["s24", "s25", "s26", "s27"]))
    assert {k[2:]: (p.run, p.how) for k, p in pts.items() if k[0] == "gpt2_small"} == {
        ("sharded", 1): ("s24", "run"), ("sharded", 4): ("s24", "kernels"),
        ("allreduce", 1): ("s25", "run"), ("allreduce", 4): ("s25", "kernels"), ("zero", 4): ("s26", "kernels")}
    assert pts[("resnet18", "graph-transpiler", "default", 1)].how == "unknown"
    # a later run's default (allreduce) does not overwrite an earlier run's default (sharded)
    assert pts[("gpt2_small", "graph-transpiler", "sharded", 4)].step_ms == 38.8


def test_a_one_gpu_run_takes_the_default_the_other_runs_agree_on():
    rows = [ours("one", "default", "resnet18", 1, 12.0),  # its run has no multi-GPU row
            ours("four", "default", "resnet18", 4, 13.0, kernels="allreduce"),
            ours("four", "sharded", "resnet18", 4, 15.0)]  # no 1-GPU sharded row: ours at one GPU is one plan
    pts = by_key(chart.select(rows, ["one", "four"]))
    assert pts[("resnet18", "graph-transpiler", "allreduce", 1)].how == "run"
    assert pts[("resnet18", "graph-transpiler", "allreduce", 4)].efficiency == pytest.approx(12.0 / 13.0)
    assert pts[("resnet18", "graph-transpiler", "sharded", 4)].efficiency == pytest.approx(12.0 / 15.0)


def test_strategy_from_flags_beats_the_label_and_the_kernels():
    r = ours("r", "mine", "gpt2_small", 4, 1.0, flags=["--strategy", "zero"], kernels="allreduce")
    assert chart.series_of(r, {}, chart.PYTORCH_VARIANTS) == ("zero", "flags")
    assert chart.strategy_of_kernels(ours("r", "default", "m", 4, 1.0, kernels="sharded")) == "sharded"
    assert chart.strategy_of_kernels(ours("r", "default", "m", 1, 1.0)) is None


def test_rows_not_drawn():
    rows = [ours("r", "allreduce", "gpt2_small", 1, 30.0),
            ours("r", "allreduce", "gpt2_small", 4, None, error="boom"),  # failed: no point
            ours("r", "bf16", "gpt2_small", 4, 31.0, flags=["--precision", "bf16"]),  # other flags
            ours("r", "base", "gpt2_small", 4, 40.0, ours_path="/old/tree"),  # another source tree
            ddp("r", "fused-bf16", "gpt2_small", 4, 44.0),  # a PyTorch variant not asked for
            ddp("r", "fused", "unknown_model", 4, 44.0)]
    points = chart.select(rows, ["r"])
    assert [(p.series, p.gpus) for p in points] == [("allreduce", 1)]
    # a failed row of the later run leaves the earlier run's measurement
    rows.append(ours("q", "allreduce", "gpt2_small", 4, 35.0))
    p = by_key(chart.select(rows, ["q", "r"]))[("gpt2_small", "graph-transpiler", "allreduce", 4)]
    assert (p.run, p.step_ms) == ("q", 35.0)


def test_an_unknown_run_is_a_one_line_error(tmp_path, capsys):
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text(json.dumps(ours("r", "zero", "resnet18", 1, 13.0)) + "\n")
    assert chart.main(["--runs", "r,nope", "--results", str(jsonl), "-o", str(tmp_path / "c.svg")]) == 2
    assert "no rows of run(s) nope" in capsys.readouterr().err
    assert not (tmp_path / "c.svg").exists()


# -- the picture -------------------------------------------------------------------------------

SYNTH = [ours("a", "default", "resnet18", 1, 13.7), ours("a", "default", "resnet18", 4, 14.9, kernels="sharded", p90=15.2),
         ours("b", "allreduce", "resnet18", 1, 13.6), ours("b", "allreduce", "resnet18", 4, 14.0),
         ddp("a", "fused", "resnet18", 1, 14.4), ddp("b", "fused", "resnet18", 4, 15.7),
         ours("b", "zero", "perceptron", 4, 0.5), ddp("b", "eager", "perceptron", 2, 1.4)]


def test_the_same_rows_give_the_same_bytes_through_the_command(tmp_path):
    pytest.importorskip("matplotlib")
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in SYNTH))
    outs = []
    for name in ("one.svg", "two.svg"):
        done = subprocess.run([sys.executable, "-m", "benchmarks", "chart", "--runs", "a,b", "--results", str(jsonl),
                               "-o", str(tmp_path / name)], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        outs.append((tmp_path / name).read_bytes())
    assert outs[0] == outs[1]
    text = outs[0].decode()
    assert "<dc:date>" not in text and "Date" not in text.split("<metadata>")[1].split("</metadata>")[0]
    # another measurement is another picture
    jsonl.write_text("".join(json.dumps(dict(r, step_ms=r["step_ms"] * 1.5) if r["gpus"] == 4 else r) + "\n"
                             for r in SYNTH))
    assert chart.main(["--runs", "a,b", "--results", str(jsonl), "-o", str(tmp_path / "three.svg")]) == 0
    assert (tmp_path / "three.svg").read_bytes() != outs[0]


COMMITTED = REPO / "docs" / "images" / "scaling.svg"


def _doc_chart(tmp_path) -> Path:
    args = chart.doc_command()
    assert "--runs" in args and args[args.index("-o") + 1] == "docs/images/scaling.svg"
    args[args.index("-o") + 1] = str(tmp_path / "scaling.svg")
    assert chart.main(args) == 0
    return tmp_path / "scaling.svg"


def test_the_doc_embeds_the_chart_and_names_its_runs():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert "](images/scaling.svg)" in text
    runs = chart.doc_command()[chart.doc_command().index("--runs") + 1].split(",")
    svg = COMMITTED.read_text()
    for run in runs:
        assert f"= {run} (" in svg, run  # the caption maps its letter to it


def test_the_committed_chart_shows_the_committed_rows(tmp_path):
    """Whatever matplotlib version draws it: the points written into the SVG are those the rows give."""
    pytest.importorskip("matplotlib")
    fresh = _doc_chart(tmp_path)
    committed = chart.data_in_svg(COMMITTED.read_text())
    assert committed is not None, "docs/images/scaling.svg has no points: made by python -m benchmarks chart?"
    assert chart.data_in_svg(fresh.read_text()) == committed, (
        "docs/images/scaling.svg is stale: run the `python -m benchmarks chart` command of docs/benchmarks.md")
    # and the points are the rows': a 4-GPU point's efficiency recomputed straight from the JSONL
    records = bench_lib.load_jsonl(sorted((REPO / "benchmarks" / "results").glob("*.jsonl")))
    lines = [line.split(" | ") for line in committed.splitlines() if line.count(" | ") == 8][1:]
    assert lines
    for model, series, gpus, step, _p90, eff, run, label, _how in lines:
        mine = [r for r in records if r["run"] == run and r["model"] == model and r["variant"] == label
                and r["gpus"] == int(gpus) and r.get("step_ms")]
        assert mine and float(step) == pytest.approx(mine[-1]["step_ms"], abs=5e-5)
        if eff != "-" and int(gpus) > 1:
            one = [x for x in lines if x[:2] == [model, series] and x[2] == "1"]
            if not one and series.startswith("ours "):  # a strategy with no 1-GPU row: our one-GPU plan's
                one = [x for x in lines if x[0] == model and x[1].startswith("ours ") and x[2] == "1"]
            assert float(eff) == pytest.approx(float(one[0][3]) / float(step), abs=1e-4)


def test_the_committed_chart_is_what_the_doc_command_makes(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    drawn_by = re.search(r"Matplotlib v([^,<\s]+)", COMMITTED.read_text())
    if drawn_by is None or drawn_by.group(1) != matplotlib.__version__:
        pytest.skip(f"docs/images/scaling.svg was drawn by matplotlib {drawn_by and drawn_by.group(1)}, this is "
                    f"{matplotlib.__version__}: bytes not compared (its points are, above)")
    assert _doc_chart(tmp_path).read_bytes() == COMMITTED.read_bytes(), (
        "docs/images/scaling.svg is stale: run the `python -m benchmarks chart` command of docs/benchmarks.md")
