"""Issue 29, item 6: where a run's numbers go. Output files create their missing directories; the
summary carries the last eval loss and says what its mean loss is; a --resume leaves one summary
in --metrics, and a --resume from an older checkpoint leaves each step's record once; --tensorboard
writes the --metrics records as TensorBoard event files (and tells TensorBoard what a resume replaces)."""

from __future__ import annotations

import json
import struct

import pytest

from commands.main import main
from runtime.metrics import MetricsFile, read_metrics


@pytest.fixture(scope="module")
def plan(model_dir, tmp_path_factory):
    """The perceptron transpiled for one rank (runs in this process: no MPI), and its data."""
    src = model_dir("perceptron")
    out = tmp_path_factory.mktemp("plan") / "out"
    assert main(["compile", str(src / "model.onnx"), "--gpus", "1", "-o", str(out)]) == 0
    return out, src / "data.npz"


def _run(plan, *args, capsys) -> tuple[int, str, str]:
    out, data = plan
    code = main(["run", str(out), "--data", str(data), "--batch", "16", *map(str, args)])
    printed, err = capsys.readouterr()
    return code, printed, err


def test_missing_output_directories_are_created(plan, tmp_path, capsys):
    metrics, export, timings = tmp_path / "a/b/m.jsonl", tmp_path / "c/t.onnx", tmp_path / "d/e/t.json"
    code, _, err = _run(plan, "--steps", 2, "--metrics", metrics, "--export", export, "--timings", timings,
                        capsys=capsys)
    assert code == 0, err
    assert metrics.is_file() and export.is_file() and timings.is_file()


def test_summary_has_the_last_eval_loss_and_names_the_mean_loss(plan, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    code, printed, err = _run(plan, "--steps", 4, "--log-every", 2, "--eval-data", plan[1], "--eval-every", 3,
                              "--metrics", metrics, capsys=capsys)
    assert code == 0, err
    records, summary = read_metrics(metrics)
    evaluations = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evaluations] == [3, 4]
    assert summary["eval_loss"] == evaluations[-1]["eval_loss"] and summary["eval_step"] == 4
    losses = [r["loss"] for r in records if "loss" in r]
    assert summary["mean_loss"] != records[-1]["mean_loss"] or len(losses) == 1  # the run's, not the last window's
    done = next(line for line in printed.splitlines() if line.startswith("done: "))
    assert f"mean loss over the run {summary['mean_loss']:.6f}" in done
    assert f"eval loss {summary['eval_loss']:.6f} (step 4)" in done


def test_summary_has_no_eval_loss_without_evaluation(plan, tmp_path, capsys):
    code, printed, err = _run(plan, "--steps", 2, "--metrics", tmp_path / "m.jsonl", capsys=capsys)
    assert code == 0, err
    assert "eval_loss" not in read_metrics(tmp_path / "m.jsonl")[1] and "eval loss" not in printed


def test_resume_leaves_one_summary(plan, tmp_path, capsys):
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    for steps, extra in ((4, ()), (6, ("--resume", "latest"))):
        code, _, err = _run(plan, "--steps", steps, "--log-every", 2, "--metrics", metrics, "--checkpoint", ck, *extra,
                            capsys=capsys)
        assert code == 0, err
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r.get("step") for r in lines] == [1, 2, 4, 5, 6, None]  # the first run's summary is gone
    records, summary = read_metrics(metrics)
    assert [r["step"] for r in records] == [1, 2, 4, 5, 6]
    assert summary["steps"] == 6 and summary["steps_run"] == 2


def test_resume_from_an_older_checkpoint_keeps_each_step_once(plan, tmp_path, capsys):
    pytest.importorskip("tensorboardX")
    metrics, board, ck = tmp_path / "m.jsonl", tmp_path / "tb", tmp_path / "ck"
    args = ("--log-every", 1, "--metrics", metrics, "--tensorboard", board, "--checkpoint", ck, "--checkpoint-every", 2,
            "--keep-last", 3)
    code, _, err = _run(plan, "--steps", 6, *args, capsys=capsys)
    assert code == 0, err
    first, _ = read_metrics(metrics)
    code, _, err = _run(plan, "--steps", 6, *args, "--resume", ck / "checkpoint-2", capsys=capsys)
    assert code == 0, err
    records, summary = read_metrics(metrics)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and summary["steps_run"] == 4
    # Steps 3..6 are the resumed run's, which computes what the first run did (same data, same state).
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in first], rel=1e-6)
    loss = _scalars(board)["loss"]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in loss] == pytest.approx([r["loss"] for r in records], rel=1e-6)


def test_appending_drops_summaries_and_a_half_written_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"summary": {"steps": 1}}\n{"step": 2, "loss": 0.5}\n{"step": 3, "lo')
    metrics = MetricsFile(path, resumed_at=2)
    metrics.write({"step": 3, "loss": 0.25})
    metrics.summary({"steps": 3})
    metrics.close()
    records, summary = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3] and summary == {"steps": 3}
    assert path.read_text().count("summary") == 1


def _scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """The scalars of every event file in ``directory`` (TFRecord framing, tensorboardX's protos),
    as TensorBoard shows them: a session-start event at step s (a purge) drops what came before it
    for steps >= s."""
    from tensorboardX.proto import event_pb2

    found: dict[str, list[tuple[int, float]]] = {}
    for file in sorted(directory.glob("events.out.tfevents.*")):
        raw, at = file.read_bytes(), 0
        while at < len(raw):
            (length,) = struct.unpack("<Q", raw[at:at + 8])
            event = event_pb2.Event.FromString(raw[at + 12:at + 12 + length])
            at += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                found = {tag: [(s, v) for s, v in values if s < event.step] for tag, values in found.items()}
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


def test_tensorboard_scalars_equal_the_metrics_records(plan, tmp_path, capsys):
    pytest.importorskip("tensorboardX")
    metrics, board = tmp_path / "m.jsonl", tmp_path / "runs" / "one"
    code, _, err = _run(plan, "--steps", 5, "--log-every", 2, "--eval-data", plan[1], "--metrics", metrics,
                        "--tensorboard", board, capsys=capsys)
    assert code == 0, err
    records, _ = read_metrics(metrics)
    expected: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                expected.setdefault(key, []).append((record["step"], value))
    assert {"loss", "mean_loss", "learning_rate", "samples_per_second", "step_time_ms", "eval_loss"} <= set(expected)
    scalars = _scalars(board)
    assert set(scalars) == set(expected)
    for key, values in expected.items():
        assert [s for s, _ in scalars[key]] == [s for s, _ in values], key
        assert [v for _, v in scalars[key]] == pytest.approx([v for _, v in values], rel=1e-6), key  # float32 there


def test_tensorboard_without_tensorboardx_is_one_line(plan, tmp_path, capsys, monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboardX" else find(name, *a))
    code, printed, err = _run(plan, "--steps", 2, "--tensorboard", tmp_path / "tb", capsys=capsys)
    assert code == 2 and printed == ""
    assert err.splitlines() == ["transpile: error: --tensorboard needs the tensorboardX package: pip install "
                                "tensorboardX (or graph-transpiler[tensorboard])"]
    assert not (tmp_path / "tb").exists()
