"""The training run's user interface (issue 13): the subcommands, the progress a run prints (banner,
lines when piped, summary), --metrics JSON lines, schedule options a schedule ignores, picture
extensions, truthful legends, and the warning for more CPU ranks than cores."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from conftest import load_data

from commands.main import main
from runtime import simulate
from runtime.metrics import read_metrics

STEP_KEYS = {"step", "epoch", "loss", "mean_loss", "learning_rate", "samples_per_second", "step_time_ms"}
SUMMARY_KEYS = {"steps", "steps_run", "samples", "runtime_s", "samples_per_second", "step_time_ms", "final_loss",
                "mean_loss", "epoch", "export", "checkpoint", "metrics"}


def transpile(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "commands", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def plans(model_dir, tmp_path_factory):
    """The perceptron transpiled for 1 rank, 2 ranks, and 1 rank with --clip-grad-norm."""
    src = model_dir("perceptron")
    root = tmp_path_factory.mktemp("plans")
    made = {}
    for key, extra in (("one", ["--gpus", "1"]), ("two", ["--gpus", "2", "--strategy", "sharded"]),
                       ("clip", ["--gpus", "1", "--clip-grad-norm", "1.0"])):
        assert main(["compile", str(src / "model.onnx"), *extra, "-o", str(root / key)]) == 0
        made[key] = root / key
    made["data"] = src / "data.npz"
    return made


# ---------------------------------------------------------------- subcommands


def test_version_help_and_usage_errors(tmp_path):
    done = transpile("--version", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("transpile (graph-transpiler) ")
    done = transpile("help", "run", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("usage: transpile run") and "--metrics" in done.stdout
    done = transpile("--help", cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout.startswith("usage: transpile [-h] [-V] {compile,run,export,inspect,view,help}")
    for args, message in ((["run"], "the following arguments are required: OUT"),
                          ([], "the following arguments are required: command"),
                          (["rnu", "out"], "'rnu' is neither a command nor a file (did you mean 'run'?)"),
                          (["inspect", "x", "--no-such-option"], "unrecognized arguments: --no-such-option")):
        done = transpile(*args, cwd=tmp_path)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.splitlines()[-1].endswith(message), (args, done.stderr)


def test_compile_word_is_optional(plans, tmp_path, model_dir):
    model = model_dir("perceptron") / "model.onnx"
    with_word = transpile("compile", model, "-o", tmp_path / "a", cwd=tmp_path)
    without = transpile(model, "-o", tmp_path / "b", cwd=tmp_path)
    options_first = transpile("-o", tmp_path / "c", model, cwd=tmp_path)
    assert [d.returncode for d in (with_word, without, options_first)] == [0, 0, 0], without.stderr
    assert (tmp_path / "a" / "plan.json").read_text() == (tmp_path / "b" / "plan.json").read_text()


def test_only_the_command_run_is_imported():
    """The parser of 'transpile inspect' neither imports onnxruntime nor the runtime's CLI."""
    code = ("import sys; from commands.main import build_parser; build_parser('inspect'); "
            "print(sorted(m for m in ('onnxruntime', 'runtime.cli', 'transpiler.cli') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


# ---------------------------------------------------------------- progress and metrics


@pytest.mark.mpi
def test_two_rank_run_writes_metrics_and_prints_progress(plans, tmp_path):
    """A real 2-rank run, piped: banner, a line every --log-every steps, a summary naming the
    outputs; the metrics' losses are the in-process simulation's losses at the logged steps."""
    metrics, trained = tmp_path / "m.jsonl", tmp_path / "t.onnx"
    done = transpile("run", plans["two"], "--data", plans["data"], "--batch", 16, "--steps", 12, "--log-every", 5,
                     "--lr", "0.0001", "--metrics", metrics, "--export", trained, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records, summary = read_metrics(metrics)
    assert [r["step"] for r in records] == [1, 5, 10, 12]
    assert all(set(r) == STEP_KEYS for r in records), records[0]
    expected = simulate(plans["two"], load_data(plans["data"]), batch=16, steps=12, lr=1e-4).losses
    assert [r["loss"] for r in records] == pytest.approx([expected[s - 1] for s in (1, 5, 10, 12)], rel=1e-5)
    assert all(r["samples_per_second"] > 0 and r["step_time_ms"] > 0 and r["learning_rate"] == 1e-4 for r in records)
    assert [r["epoch"] for r in records] == pytest.approx([s * 16 / 256 for s in (1, 5, 10, 12)], abs=1e-4)
    assert set(summary) == SUMMARY_KEYS
    assert summary["steps"] == summary["steps_run"] == 12 and summary["samples"] == 12 * 16
    assert summary["final_loss"] == records[-1]["loss"] and summary["runtime_s"] > 0
    assert summary["samples_per_second"] == pytest.approx(12 * 16 / summary["runtime_s"], rel=1e-3, abs=0.05)  # written to 0.1
    assert summary["export"] == str(trained) and summary["metrics"] == str(metrics) and summary["checkpoint"] is None

    lines = done.stdout.splitlines()
    assert lines[0] == "transpile run" and any(line.split() == ["ranks", "2", "on", "the", "cpu", "backend,", "strategy",
                                                                "sharded"] for line in lines)
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/12", "5/12", "10/12", "12/12"]
    assert all(f"loss {r['loss']:.6f}" in line and "samples/s" in line for r, line in zip(records, steps))
    assert lines[-3].startswith("done: 12 steps in ") and f"final loss {summary['final_loss']:.6f}" in lines[-3]
    assert lines[-2].split() == ["export", str(trained)] and lines[-1].split() == ["metrics", str(metrics)]


def _run(plans, key, *args, tmp_path, capsys) -> tuple[int, str, str]:
    """``transpile run`` in this process (one rank: no MPI)."""
    code = main(["run", str(plans[key]), "--data", str(plans["data"]), "--batch", "16", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_metrics_has_grad_norm_when_clipping_and_appends_on_resume(plans, tmp_path, capsys):
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    code, _, err = _run(plans, "clip", "--steps", 4, "--log-every", 2, "--metrics", metrics, "--checkpoint", ck,
                        tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err
    records, summary = read_metrics(metrics)
    assert [r["step"] for r in records] == [1, 2, 4] and all(r["grad_norm"] > 0 for r in records)
    assert summary["checkpoint"] == str(ck / "checkpoint-4")
    code, _, err = _run(plans, "clip", "--steps", 6, "--log-every", 2, "--metrics", metrics, "--checkpoint", ck,
                        "--resume", "latest", tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r.get("step") for r in lines] == [1, 2, 4, 5, 6, None]  # appended; the first summary dropped
    assert lines[-1]["summary"]["steps"] == 6 and lines[-1]["summary"]["steps_run"] == 2


def test_eval_records_go_through_report_log(tmp_path):
    """The entry point evaluation uses: one record with step, epoch and its values, in both outputs."""
    from runtime.metrics import MetricsFile
    from runtime.progress import LineView, Report

    printed: list[str] = []
    report = Report(LineView(printed.append, steps=10), [MetricsFile(tmp_path / "m.jsonl")], steps=10, batch=4, rows=20)
    report.log(5, eval_loss=0.25)
    report.close()
    assert read_metrics(tmp_path / "m.jsonl")[0] == [{"step": 5, "epoch": 1.0, "eval_loss": 0.25}]
    assert printed == ["step 5/10  epoch 1.00  eval loss 0.25"]


@pytest.mark.parametrize("where, message", [
    ("file/m.jsonl", "{tmp}/file is a file, not a directory"),
    (".", "is a directory; give a file name"),
    ("ro/m.jsonl", "directory {tmp}/ro is not writable"),
])
def test_unwritable_metrics_is_one_line_before_training(plans, tmp_path, capsys, monkeypatch, where, message):
    (tmp_path / "ro").mkdir(mode=0o500)
    (tmp_path / "file").write_text("")
    if where.startswith("ro/") and __import__("os").access(tmp_path / "ro", __import__("os").W_OK):
        pytest.skip("running as root: a read-only directory is writable")
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(plans, "one", "--steps", 2, "--metrics", where, tmp_path=tmp_path, capsys=capsys)
    assert code == 2 and out == ""  # nothing ran: no banner, no step
    assert err.splitlines() == [f"transpile: error: --metrics {where}: {message.format(tmp=tmp_path)}"]


def test_bar_view_on_a_terminal(plans, tmp_path, capsys, monkeypatch):
    """--progress bar: the banner, the bar with the last record's numbers, the summary (rich, on a
    console standing in for the terminal)."""
    from rich.console import Console

    screen = io.StringIO()
    monkeypatch.setattr("runtime.progress.bar_console", lambda tty: Console(file=screen, force_terminal=True, width=100))
    code, out, err = _run(plans, "one", "--steps", 6, "--log-every", 3, "--progress", "bar",
                          "--metrics", tmp_path / "m.jsonl", tmp_path=tmp_path, capsys=capsys)
    assert code == 0 and out == "", err
    text = screen.getvalue()
    records, summary = read_metrics(tmp_path / "m.jsonl")
    assert "lr schedule" in text and "6/6" in text and f"loss {records[-1]['loss']:.4f}" in text
    assert "done" in text and f"final loss {summary['final_loss']:.6f}" in text


# ---------------------------------------------------------------- options and warnings


@pytest.mark.parametrize("args, message", [
    (["--min-lr", "0.001"], "--min-lr is not used by --lr-schedule constant (only by cosine and linear)"),
    (["--lr-schedule", "cosine", "--lr-gamma", "0.5"], "--lr-gamma is not used by --lr-schedule cosine (only by step)"),
    (["--lr-schedule", "linear", "--lr-step-size", "2", "--lr-gamma", "0.5"],
     "--lr-step-size, --lr-gamma are not used by --lr-schedule linear (only by step)"),
    (["--lr-schedule", "step", "--min-lr", "0"], "--min-lr is not used by --lr-schedule step (only by cosine and linear)"),
])
def test_schedule_options_the_schedule_ignores_are_errors(plans, tmp_path, capsys, args, message):
    code, out, err = _run(plans, "one", "--steps", 4, *args, tmp_path=tmp_path, capsys=capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"transpile: error: {message}"), err


def test_schedule_options_the_schedule_uses_are_accepted(plans, tmp_path, capsys):
    code, _, err = _run(plans, "one", "--steps", 4, "--lr-schedule", "step", "--lr-step-size", "2", "--lr-gamma",
                        "0.5", "--warmup-steps", "1", "--log-every", "0", tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err


def test_more_cpu_ranks_than_cores_warns_once(plans, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr("runtime.cli.spawn", lambda n, args, **_: 0)  # the ranks themselves don't matter
    code, _, err = _run(plans, "two", "--steps", 2, tmp_path=tmp_path, capsys=capsys)
    assert code == 0
    assert err.splitlines() == ["transpile: warning: 2 CPU ranks on 1 core(s) that this process may use: the ranks "
                                "take turns and every step is slower; transpile with --gpus 1 or fewer for a CPU run"]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert _run(plans, "two", "--steps", 2, tmp_path=tmp_path, capsys=capsys)[2] == ""


@pytest.mark.parametrize("option, file, allowed", [("--svg", "g.png", ".svg"), ("--timeline", "t.txt", ".png or ")])
def test_picture_extension_is_checked(plans, tmp_path, capsys, option, file, allowed):
    code = main(["inspect", str(plans["two"]), option, str(tmp_path / file)])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / file).exists()
    assert len(err.splitlines()) == 1 and err.startswith(f"transpile: error: {option} {tmp_path / file}: the file name "
                                                         f"must end with {allowed}"), err


def test_graph_title_names_the_colours_drawn(plans):
    import re

    from inspection.draw import COLOR_NAMES, graph_dot

    plan = json.loads((plans["two"] / "plan.json").read_text())
    source, _ = graph_dot(plans["two"] / "rank0.onnx", 0, plan)
    title = re.search(r'^  label="([^"]*)"', source, re.M).group(1)
    drawn = set(re.findall(r'fillcolor="(#[0-9a-f]{6})"', source))
    named = {hex_ for hex_, name in COLOR_NAMES.items() if re.search(rf"\({name}\)", title)}
    assert drawn == named, (title, drawn)
    assert "collectives: Reduce (orange), Broadcast (green)" in title


def test_measured_timeline_does_not_say_estimates(plans, tmp_path):
    import matplotlib

    from inspection.draw import draw_timeline, schedule
    from inspection.report import build_report

    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text in the SVG
    report = build_report(plans["two"], None)
    every = {}
    for item in schedule(report)["items"]:
        lane = every.setdefault(item["rank"], {"segments": {}, "collectives": {}})
        lane["segments" if item["kind"] == "segment" else "collectives"][item["index"]] = 1e-3
    draw_timeline(report, str(tmp_path / "measured.svg"), timings=every)
    draw_timeline(report, str(tmp_path / "estimated.svg"))
    measured, estimated = (tmp_path / "measured.svg").read_text(), (tmp_path / "estimated.svg").read_text()
    assert "estimate" not in measured and "(measured)" in measured
    assert "estimates: " in estimated and "(estimated)" in estimated
