"""`python -m benchmarks compare`: its arithmetic (median, p90, ratios, kernel counts), records and
rendering from recorded JSON fixtures, option parsing, and one end-to-end run on CPU (perceptron)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import bench_lib  # noqa: E402
from benchmarks.compare import main, parse_ours_variant, transpile_flags  # noqa: E402

# Recorded lines in the JSONL format (GPU numbers of the shape, a failed row, an older run).
FIXTURE = [
    {"run": "20261124T060000Z-h200", "date": "2026-11-24", "host": "h200", "system": "pytorch", "variant": "eager",
     "model": "gpt2_small", "gpus": 1, "step_ms": 50.5, "p90_ms": 50.9, "kernels_per_step": 2717.0,
     "gpu_kernel_ms": 44.1, "peak_mem_gib": 9.87, "device": "cuda", "device_name": "NVIDIA H200",
     "torch_version": "2.11.0", "config": "GPT 12x768", "commit": "abc1234567"},
    {"run": "20261124T060000Z-h200", "date": "2026-11-24", "host": "h200", "system": "pytorch", "variant": "sdpa",
     "model": "gpt2_small", "gpus": 1, "step_ms": 31.5, "p90_ms": 31.7, "kernels_per_step": 1500.0,
     "gpu_kernel_ms": 29.0, "peak_mem_gib": 6.5, "device": "cuda"},
    {"run": "20261124T060000Z-h200", "date": "2026-11-24", "host": "h200", "system": "graph-transpiler",
     "variant": "default", "model": "gpt2_small", "gpus": 1, "step_ms": 65.5, "p90_ms": 66.2,
     "kernels_per_step": 6021.0, "gpu_kernel_ms": 52.3, "peak_mem_gib": 12.25, "device": "cuda",
     "ort_version": "1.31.1"},
    {"run": "20261124T060000Z-h200", "date": "2026-11-24", "host": "h200", "system": "graph-transpiler",
     "variant": "flat-update", "model": "gpt2_small", "gpus": 1, "step_ms": None, "p90_ms": None,
     "kernels_per_step": None, "gpu_kernel_ms": None, "peak_mem_gib": None, "device": "cuda",
     "error": "transpile failed (exit 1): boom | here"},
    {"run": "20261124T060000Z-h200", "date": "2026-11-24", "host": "h200", "system": "pytorch", "variant": "eager",
     "model": "perceptron", "gpus": 1, "step_ms": 0.65, "p90_ms": 0.7, "kernels_per_step": 30.0,
     "gpu_kernel_ms": 0.1, "peak_mem_gib": 0.01, "device": "cuda"},
    {"run": "20261124T060000Z-h200", "date": "2026-11-24", "host": "h200", "system": "graph-transpiler",
     "variant": "default", "model": "perceptron", "gpus": 1, "step_ms": 0.42, "p90_ms": 0.45,
     "kernels_per_step": 64.0, "gpu_kernel_ms": 0.12, "peak_mem_gib": 0.02, "device": "cuda"},
    {"run": "20261123T010000Z-h200", "date": "2026-11-23", "host": "h200", "system": "pytorch", "variant": "eager",
     "model": "perceptron", "gpus": 1, "step_ms": 0.9, "p90_ms": 1.0, "kernels_per_step": None,
     "gpu_kernel_ms": None, "peak_mem_gib": None, "device": "cuda"},
]
RUN = "20261124T060000Z-h200"


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in FIXTURE))
    return path


# -- arithmetic -------------------------------------------------------------------------------

def test_median_odd_even_and_unsorted():
    assert bench_lib.median([3.0, 1.0, 2.0]) == 2.0
    assert bench_lib.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError):
        bench_lib.median([])


@pytest.mark.parametrize("values", [[10, 11, 12, 13, 14, 100], [5.0], [1, 2], [7, 3, 9, 1, 4, 4, 8]])
@pytest.mark.parametrize("q", [0, 50, 90, 100])
def test_percentile_matches_numpy_linear(values, q):
    assert bench_lib.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_p90_of_six_windows_interpolates():
    # 6 windows: position 0.9 * 5 = 4.5, halfway between the 5th (14) and the 6th (100) value
    s = bench_lib.summarize([12, 10, 100, 11, 14, 13])
    assert s["step_ms"] == 12.5
    assert s["p90_ms"] == 57.0
    assert s["windows_ms"] == [12, 10, 100, 11, 14, 13]


def test_window_means_divide_by_steps():
    assert bench_lib.window_means([50.0, 55.0], 5) == [10.0, 11.0]
    with pytest.raises(ValueError):
        bench_lib.window_means([1.0], 0)


def test_kernel_summary_per_step_and_copies_apart():
    events = [("ampere_sgemm", 1000.0), ("ampere_sgemm", 1000.0), ("elementwise_add", 10.0),
              ("Memcpy HtoD (Pageable -> Device)", 5.0), ("Memset (Device)", 1.0), ("elementwise_add", 10.0)] * 2
    s = bench_lib.kernel_summary(events, steps=2)
    assert s["kernels_per_step"] == 4.0  # 8 kernels over 2 steps; the 4 copies are not kernels
    assert s["gpu_kernel_ms"] == 2.02
    assert s["copies_per_step"] == 2.0
    assert s["copy_ms"] == 0.006
    assert s["top_kernels"][0] == {"name": "ampere_sgemm", "per_step": 2.0, "ms": 2.0}


# -- records ----------------------------------------------------------------------------------

def test_make_record_has_every_key_and_the_error():
    r = bench_lib.make_record({"run": "x", "system": "pytorch"}, {"step_ms": 1.5, "extra": 1}, None)
    assert set(bench_lib.RECORD_KEYS) <= set(r) and r["step_ms"] == 1.5 and r["extra"] == 1 and r["gpus"] is None
    r = bench_lib.make_record({"run": "x"}, None, "failed")
    assert r["error"] == "failed" and r["step_ms"] is None


def test_load_and_select_latest_run(jsonl, tmp_path):
    records = bench_lib.load_jsonl([jsonl])
    assert len(records) == len(FIXTURE)
    chosen = bench_lib.select_run(records)
    assert {r["run"] for r in chosen} == {RUN} and len(chosen) == 6
    assert len(bench_lib.select_run(records, "20261123T010000Z-h200")) == 1
    with pytest.raises(ValueError, match="no records of run"):
        bench_lib.select_run(records, "nope")
    again = dict(FIXTURE[0], step_ms=49.0)  # the same row measured again in the run replaces it
    chosen = bench_lib.select_run(records + [again])
    assert len(chosen) == 6 and [r["step_ms"] for r in chosen if r["variant"] == "eager" and r["model"] == "gpt2_small"] == [49.0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"run": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        bench_lib.load_jsonl([bad])


def test_a_row_measured_in_rounds_shows_its_median_round_and_the_range():
    base = {"run": RUN, "system": "graph-transpiler", "variant": "bf16", "model": "resnet18", "gpus": 1, "device": "cuda"}
    rounds = [dict(base, round=k, step_ms=step, p90_ms=step, peak_mem_gib=mem, kernels_per_step=376.0 + k)
              for k, (step, mem) in enumerate([(6.25, 1.195), (5.96, 1.074), (6.01, 1.074)])]
    once = dict(base, variant="base", step_ms=6.30, p90_ms=6.31, peak_mem_gib=1.262)
    (shown, other) = bench_lib.select_run(rounds + [once])
    # the median round's own record (its kernels too), with every round's step and memory
    assert shown["step_ms"] == 6.01 and shown["kernels_per_step"] == 378.0
    assert shown["rounds_step_ms"] == [6.25, 5.96, 6.01] and shown["rounds_peak_mem_gib"] == [1.195, 1.074, 1.074]
    assert other is once and "rounds_step_ms" not in other
    row = next(line for line in bench_lib.render_table([shown, other]).splitlines() if "| bf16 |" in line).split(" | ")
    assert row[4] == "6.010 (5.960-6.250, 3 rounds)" and row[9] == "1.07 (1.07-1.20) |"
    # a later series (round 0 again, the same --run-id) replaces the earlier one; a failed round counts
    again = [dict(base, round=0, step_ms=7.0), dict(base, round=1, step_ms=None, error="timed out")]
    (shown,) = bench_lib.select_run(rounds + again)
    assert shown["step_ms"] == 7.0 and shown["rounds_step_ms"] == [7.0, None]


def test_append_jsonl_appends(tmp_path):
    path = tmp_path / "sub" / "r.jsonl"
    bench_lib.append_jsonl(path, {"a": 1})
    bench_lib.append_jsonl(path, {"a": 2})
    assert [json.loads(line)["a"] for line in path.read_text().splitlines()] == [1, 2]


def test_ratios_against_pytorch_eager_of_the_same_model():
    recs = bench_lib.select_run(FIXTURE)
    r = bench_lib.ratios(recs)
    assert r[("graph-transpiler", "default", "gpt2_small", 1)] == pytest.approx(65.5 / 50.5, abs=1e-3)
    assert r[("pytorch", "sdpa", "gpt2_small", 1)] == pytest.approx(31.5 / 50.5, abs=1e-3)
    assert r[("pytorch", "eager", "gpt2_small", 1)] == 1.0
    assert r[("graph-transpiler", "flat-update", "gpt2_small", 1)] is None  # failed row
    assert r[("graph-transpiler", "default", "perceptron", 1)] == pytest.approx(0.42 / 0.65, abs=1e-3)
    # best ours / best torch: 65.5 / 31.5 (the SDPA row is PyTorch's best)
    assert bench_lib.best_ratio(recs, "gpt2_small", 1) == pytest.approx(65.5 / 31.5, abs=1e-3)
    assert bench_lib.best_ratio(recs, "resnet18", 1) is None


def test_ratio_missing_baseline_is_none():
    recs = [r for r in bench_lib.select_run(FIXTURE) if r["variant"] != "eager"]
    assert bench_lib.ratios(recs)[("graph-transpiler", "default", "gpt2_small", 1)] is None


# -- rendering --------------------------------------------------------------------------------

def test_render_table_rows_order_ratios_and_error():
    table = bench_lib.render_table(bench_lib.select_run(FIXTURE)).splitlines()
    assert table[0].startswith("| model | GPUs | system")
    rows = [line.split(" | ") for line in table[2:]]
    assert [(r[0].strip("| "), r[2], r[3]) for r in rows] == [
        ("gpt2_small", "pytorch", "eager"), ("gpt2_small", "pytorch", "sdpa"),
        ("gpt2_small", "graph-transpiler", "default"), ("gpt2_small", "graph-transpiler", "flat-update"),
        ("perceptron", "pytorch", "eager"), ("perceptron", "graph-transpiler", "default")]
    ours = rows[2]
    assert ours[4] == "65.5" and ours[5] == "66.2" and ours[6] == "1.30x" and ours[7] == "6021" and ours[9].startswith("12.25")
    assert rows[3][4].startswith("error: transpile failed") and "/" in rows[3][4]  # '|' escaped out of the cell
    assert rows[5][4] == "0.420" and rows[5][6] == "0.65x"


def test_render_section_and_doc_update_keep_the_hand_written_text():
    recs = bench_lib.select_run(FIXTURE)
    section = bench_lib.render_section(recs, "images/benchmarks.png")
    assert section.startswith(bench_lib.BEGIN) and section.endswith(bench_lib.END)
    assert "NVIDIA H200" in section and "torch 2.11.0" in section and "onnxruntime 1.31.1" in section
    assert "best graph-transpiler / best PyTorch = 2.08x" in section
    assert "![step time relative to PyTorch eager](images/benchmarks.png)" in section
    assert " code " not in section  # these rows predate the source digest
    named = [dict(r, ours_source="0123456789ab") if r["system"] == "graph-transpiler" else r for r in recs]
    variant = next(r["variant"] for r in named if r["system"] == "graph-transpiler")
    assert f"`{variant}` code 0123456789ab" in bench_lib.render_section(named, None)
    doc = "# Benchmarks\n\nintro\n"
    once = bench_lib.update_doc(doc, section)
    assert once.startswith(doc.rstrip("\n")) and once.count(bench_lib.BEGIN) == 1
    again = bench_lib.update_doc(once + "\n## after\ntext\n", bench_lib.render_section(recs[:1], None))
    assert again.count(bench_lib.BEGIN) == 1 and "## after\ntext" in again and "intro" in again
    assert "6021" not in again  # the old section is gone


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = bench_lib.plot(bench_lib.select_run(FIXTURE), tmp_path / "img" / "b.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_command_from_jsonl(jsonl, tmp_path):
    pytest.importorskip("matplotlib")
    doc, image = tmp_path / "docs" / "benchmarks.md", tmp_path / "docs" / "images" / "b.png"
    doc.parent.mkdir()
    doc.write_text("# Benchmarks\n\nkept\n")
    assert main(["render", str(jsonl), "--docs", str(doc), "--image", str(image)]) == 0
    text = doc.read_text()
    assert "kept" in text and RUN in text and "(images/b.png)" in text and image.exists()
    assert main(["render", str(jsonl), "--run", "missing", "--docs", str(doc), "--image", str(image)]) == 2


# -- options ----------------------------------------------------------------------------------

def test_ours_variant_specs(tmp_path):
    assert parse_ours_variant("default", None) == {"label": "default", "flags": [], "path": None, "env": {}}
    # NAME=VALUE with an upper-case NAME: the row's environment, not a transpile flag
    assert parse_ours_variant("cumem0=--strategy zero NCCL_CUMEM_ENABLE=0 CUBLAS_WORKSPACE_CONFIG=:4096:8", None) == {
        "label": "cumem0", "flags": ["--strategy", "zero"], "path": None,
        "env": {"NCCL_CUMEM_ENABLE": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}}
    assert parse_ours_variant("allreduce", None)["flags"] == ["--strategy", "allreduce"]
    with pytest.raises(ValueError, match="unknown preset 'flat-update'"):  # transpile --flat-update was removed
        parse_ours_variant("flat-update", None)
    tree = tmp_path / "tree"
    (tree / "runtime").mkdir(parents=True)
    (tree / "transpiler").mkdir()
    v = parse_ours_variant("old=--flat-update --bucket-mb 4@" + str(tree), None)
    assert v == {"label": "old", "flags": ["--flat-update", "--bucket-mb", "4"], "path": str(tree.resolve()), "env": {}}
    assert parse_ours_variant("base@" + str(tree), None)["flags"] == []
    assert parse_ours_variant("zero", str(tree))["path"] == str(tree.resolve())  # --ours-path for all
    with pytest.raises(ValueError, match="unknown preset"):
        parse_ours_variant("nonsense", None)
    with pytest.raises(ValueError, match="not a graph-transpiler source tree"):
        parse_ours_variant("x@" + str(tmp_path), None)


def test_transpile_flags_match_the_torch_optimizer():
    assert transpile_flags({"name": "adamw", "lr": 1e-4, "weight_decay": 0.01}) == [
        "--optimizer", "adamw", "--lr", "0.0001", "--weight-decay", "0.01"]
    assert transpile_flags({"name": "momentum", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}) == [
        "--optimizer", "momentum", "--lr", "0.1", "--momentum", "0.9", "--weight-decay", "0.0005"]


def test_bad_options_are_one_line_errors(tmp_path, capsys):
    assert main(["compare", "--models", "nope", "--work", str(tmp_path), "--device", "cpu"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["compare", "--variants", "turbo", "--work", str(tmp_path), "--device", "cpu"]) == 2
    assert "--variants: unknown 'turbo'" in capsys.readouterr().err
    assert main(["compare", "--repeat", "0", "--work", str(tmp_path), "--device", "cpu"]) == 2
    assert "--repeat: a number of rounds >= 1, got 0" in capsys.readouterr().err


# -- end to end on CPU --------------------------------------------------------------------------

def test_compare_end_to_end_on_cpu(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    results, doc, image = tmp_path / "r.jsonl", tmp_path / "benchmarks.md", tmp_path / "b.png"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "GRAPH_TRANSPILER_", "CUBLAS_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), NCCL_DEBUG="WARN")
    cmd = [sys.executable, "-m", "benchmarks", "compare", "--device", "cpu", "--models", "perceptron",
           "--variants", "eager", "--ours-variants", "default,allreduce", "--batch", "64", "--steps", "3",
           "--windows", "3", "--warmup", "2", "--threads", "1", "--work", str(tmp_path / "work"),
           "--results", str(results), "--docs", str(doc), "--image", str(image)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    records = bench_lib.load_jsonl([results])
    assert [(r["system"], r["variant"]) for r in records] == [
        ("pytorch", "eager"), ("graph-transpiler", "default"), ("graph-transpiler", "allreduce")]
    for r in records:
        assert set(bench_lib.RECORD_KEYS) <= set(r) and not r.get("error")
        assert r["device"] == "cpu" and r["gpus"] == 1 and r["batch"] == 64 and len({x["run"] for x in records}) == 1
        assert r["step_ms"] > 0 and r["p90_ms"] >= r["step_ms"] and len(r["windows_ms"]) == 3
        assert r["kernels_per_step"] is None and r["peak_mem_gib"] is None
        assert r["env"] == {"NCCL_DEBUG": "WARN"}  # what a row ran under, but NCCL_NVLS_ENABLE (always 0)
        if r["system"] == "graph-transpiler":  # the cap its OUT was made with: the perceptron's, 25 MiB
            assert r["bucket_mb"] == 25.0 and r["sparse_gradients"] == []
    # same module, same data, same start: the first losses agree
    losses = [r["first_loss"] for r in records]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    assert "graph-transpiler | allreduce" in doc.read_text() and image.exists()
    # a rerun with the same --run-id reuses the exported model and the OUTs (also under another label
    # with the same flags: `again=`); its row replaces the earlier one
    again = subprocess.run(cmd + ["--variants", "", "--ours-variants", "default", "--run-id", records[0]["run"]],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "exporting" not in again.stdout and "transpiling" not in again.stdout
    every = bench_lib.load_jsonl([results])
    assert len(every) == 4 and every[3]["variant"] == "default" and every[3]["run"] == records[0]["run"]
    table = [line for line in doc.read_text().splitlines() if line.startswith("| perceptron")]
    assert len(table) == 3 and f"| {every[3]['step_ms']:.3f} |" in [line for line in table if "| default |" in line][0]
    # ... and under another label whose only flag is an environment variable of its processes
    relabelled = subprocess.run(cmd + ["--variants", "", "--ours-variants", "again=NCCL_DEBUG=INFO", "--run-id",
                                       records[0]["run"]], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert relabelled.returncode == 0 and "transpiling" not in relabelled.stdout, relabelled.stdout + relabelled.stderr
    last = bench_lib.load_jsonl([results])[-1]
    assert last["variant"] == "again" and last["env"] == {"NCCL_DEBUG": "INFO"} and last["transpile_flags"] == []
    # --repeat 2: every row twice, round after round, each a record; the table shows one row per row
    rounds = subprocess.run(cmd + ["--variants", "eager", "--ours-variants", "default", "--repeat", "2", "--run-id",
                                   "rounds"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert rounds.returncode == 0, rounds.stdout + rounds.stderr
    measured = [r for r in bench_lib.load_jsonl([results]) if r["run"] == "rounds"]
    assert [(r["variant"], r["round"]) for r in measured] == [("eager", 0), ("default", 0), ("eager", 1), ("default", 1)]
    table = [line for line in doc.read_text().splitlines() if line.startswith("| perceptron")]
    assert len(table) == 2 and all("2 rounds)" in line for line in table)


def test_ratio_uses_the_baseline_of_the_same_world_size():
    def rec(system, variant, gpus, ms):
        return {"run": "r", "system": system, "variant": variant, "model": "m", "gpus": gpus, "step_ms": ms}
    recs = [rec("pytorch", "eager", 1, 10.0), rec("pytorch", "eager", 4, 20.0),
            rec("graph-transpiler", "default", 1, 15.0), rec("graph-transpiler", "default", 4, 10.0)]
    r = bench_lib.ratios(recs)
    assert r[("graph-transpiler", "default", "m", 1)] == 1.5
    assert r[("graph-transpiler", "default", "m", 4)] == 0.5
    assert bench_lib.best_ratio(recs, "m", 4) == 0.5


def test_latest_run_is_the_newest_record_by_time():
    recs = [{"run": "zzz-custom", "time": "2026-11-24T01:00:00+00:00"},
            {"run": "aaa-custom", "time": "2026-11-24T02:00:00+00:00"},
            {"run": "aaa-custom", "time": "2026-11-24T01:30:00+00:00"}]
    assert bench_lib.latest_run(recs) == "aaa-custom"
    assert bench_lib.latest_run([{"run": "20261124T01"}, {"run": "20261124T02"}]) == "20261124T02"  # no times


def test_the_source_digest_names_the_code_an_ours_row_runs(tmp_path):
    """Same code, same digest wherever it lies; an edit to a .py under transpiler/, runtime/ or
    contract/ changes it, other files do not; a git archive of the checkout's own code has the
    checkout's digest (what a prev@DIR row names)."""
    from benchmarks.compare import ROOT, SOURCE_DIRS, source_digest

    tree = tmp_path / "tree"
    for sub in SOURCE_DIRS:
        (tree / sub / "pkg").mkdir(parents=True)
        (tree / sub / "pkg" / "a.py").write_text(f"X = '{sub}'\n")
    first = source_digest(tree)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(tree), str(copy)], check=True)
    assert source_digest(copy) == first
    (tree / "README.md").write_text("not code")
    (tree / "runtime" / "notes.txt").write_text("not code either")
    assert source_digest(tree) == first
    (tree / "runtime" / "pkg" / "a.py").write_text("X = 'edited'\n")
    assert source_digest(tree) != first
    (tree / "runtime" / "pkg" / "a.py").write_text("X = 'runtime'\n")
    (tree / "contract" / "b.py").write_text("")
    assert source_digest(tree) != first  # a new file counts

    if (ROOT / ".git").exists() and not subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                                                        *SOURCE_DIRS], capture_output=True, text=True).stdout.strip():
        archive = tmp_path / "archive"
        archive.mkdir()
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD", *SOURCE_DIRS], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(archive)], input=tar, check=True)
        assert source_digest(archive) == source_digest(ROOT)


def test_timeline_summary_splits_a_rank_step_into_busy_idle_and_exposed_communication():
    # Two steps: compute 0-10 and 20-30 us, NCCL 5-21 (6 us of it beside compute), idle 30-40, compute 40-50.
    events = [("gemm", 0, 10), ("ncclDevKernel_AllReduce_Sum_f32", 5, 21), ("gemm", 20, 30), ("relu", 40, 50),
              ("relu", 42, 44)]  # nested in the one before: counted once
    s = bench_lib.timeline_summary(events, steps=2)
    assert s == {"gpu_span_ms": 0.025, "gpu_busy_ms": 0.02, "gpu_idle_ms": 0.005, "nccl_ms": 0.008,
                 "nccl_exposed_ms": 0.005}
    assert bench_lib.timeline_summary([], steps=1) == {}


def test_the_kernel_profile_discards_one_warm_up_step_and_keeps_the_recorded_ones(tmp_path, monkeypatch):
    """The rows' kernel figures come from the steps after one discarded warm-up step under the
    profiler (each rank starts its profiler at its own time; bench_worker.kernel_profile). On CPU
    no CUDA activity is recorded, so the summary has none; the trace is written once, at the end."""
    torch = pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_worker

    calls = []

    def step():
        calls.append("step")
        with torch.profiler.record_function(f"step{calls.count('step')}"):
            torch.ones(64, 64) @ torch.ones(64, 64)

    trace = tmp_path / "t.json"
    summary = bench_worker.kernel_profile(step, lambda: calls.append("sync"), 3, str(trace))
    assert calls == ["step", "sync", "step", "sync", "step", "step", "step", "sync"]
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {n for n in names if n and n.startswith("step")} == {"step3", "step4", "step5"}  # not the warm-up (2)
    ranges = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "bench_step"]
    assert len(ranges) == 3  # each recorded step in its range, for benchmarks/trace_steps.py
    assert summary.get("kernels_per_step") in (None, 0, 0.0)


def test_a_row_names_the_other_processes_on_its_gpu_as_the_runs_ranks_or_by_command(monkeypatch):
    """The rows' device_process_commands tell a peer rank's context on this GPU from any other
    process's (benchmarks/bench_worker.py finish): the 4-GPU rows held 0.5 GiB a peer that no rank
    was charged for, and a pid alone could not say whose."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_worker

    class Ranks:
        rank = 0

        def __init__(self, every):
            self.every = every

        def gather(self, result):
            return self.every

        def barrier(self):
            pass

    def result(pid, step_ms, commands):
        return {"windows_ms": [step_ms], "pid": pid, "step_ms": step_ms, "mem_used_delta_gib": 1.0,
                "nvml_process_gib": 0.9, "device_processes_gib": {"self": 0.9, **{p: 0.5 for p in commands}},
                "device_process_commands": commands}

    slow = result(11, 5.0, {"12": "python3 bench_worker.py ours spec.json", "99": "python3 -m benchmarks compare"})
    out = bench_worker.finish(Ranks([slow, result(12, 4.0, {"11": "python3 bench_worker.py ours spec.json"})]), dict(slow))
    assert out["device_process_commands"] == {"12": "rank 1", "99": "python3 -m benchmarks compare"}
    assert out["rank_nvml_process_gib"] == [0.9, 0.9]
    # Without NVML nothing is known: None, not an empty map that reads as "no other process".
    blind = {**slow, "device_processes_gib": None, "device_process_commands": None}
    assert bench_worker.finish(Ranks([blind, dict(blind, pid=12)]), dict(blind))["device_process_commands"] is None


def test_a_row_records_the_cores_each_rank_may_run_on(monkeypatch):
    """A launcher that binds each rank to one core (Open MPI's default for 2 ranks) slows a
    host-bound step: every rank's row says how many cores it had."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_worker

    monkeypatch.setattr(bench_worker.os, "sched_getaffinity", lambda _pid: {0, 1, 2})
    peer = {"windows_ms": [4.0], "step_ms": 4.0, "cpu_affinity": 1}

    class Ranks:
        rank = 0

        def gather(self, result):
            return [result, peer]

        def barrier(self):
            pass

    out = bench_worker.finish(Ranks(), {"windows_ms": [5.0]})
    assert out["cpu_affinity"] == 3 and out["rank_cpu_affinity"] == [3, 1]


def test_a_call_with_fewer_gpus_measures_the_prepared_data(tmp_path):
    """`compare --gpus 1` after `prepare --gpus 1,2` reads the prepared data-2B file (rank 0 reads
    its first B rows, as in the 2-GPU rows), not a data file of its own that needs the export again."""
    import argparse

    from benchmarks import compare

    parser = argparse.ArgumentParser()
    compare.add_options(parser)

    def data_path(gpus: str) -> Path:
        args = parser.parse_args(["--models", "perceptron", "--gpus", gpus, "--device", "cpu", "--work", str(tmp_path),
                                  "--run-id", "t", "--results", str(tmp_path / "r.jsonl")])
        session = compare.Session(args)
        return session.data_path(session.models[0])

    assert data_path("1,2").name == "data-2000.npz"  # nothing prepared yet: exactly the largest world's rows
    prepared = data_path("1,2")
    prepared.parent.mkdir(parents=True)
    prepared.write_bytes(b"")
    (prepared.parent / "data-8000.npz").write_bytes(b"")
    (prepared.parent / "data-4000.tmp.npz").write_bytes(b"")  # a partial write is no data file
    assert data_path("1") == prepared  # the smallest with rows enough
    assert data_path("4").name == "data-8000.npz"  # 4000 rows: the partial data-4000 does not count
    assert data_path("16").name == "data-16000.npz"  # none holds enough: a new file
