"""End to end as a user runs it: `transpile`, `transpile inspect`, `transpile run` on 4 MPI ranks."""

from __future__ import annotations

import subprocess
import sys

import onnx
import pytest
from conftest import initial_parameters, load_data, max_rel_error
from onnx import numpy_helper

from runtime import simulate
from runtime.metrics import read_metrics


def cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "transpiler.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["sharded", "allreduce", "zero"])
def test_perceptron_trains_on_four_mpi_ranks(model_dir, tmp_path, strategy):
    src = model_dir("perceptron")
    out = tmp_path / "out"
    done = cli(src / "model.onnx", "--gpus", 4, "--strategy", strategy, "--optimizer", "momentum",
               "--lr", "0.0001", "-o", out, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "4 rank(s)" in done.stdout

    inspected = cli("inspect", out, cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    expected_op = {"sharded": "Reduce", "allreduce": "AllReduce", "zero": "ReduceScatter"}[strategy]
    assert expected_op in inspected.stdout

    trained = tmp_path / "trained.onnx"
    done = cli("run", out, "--data", src / "data.npz", "--batch", 32, "--steps", 40, "--log-every", 10,
               "--export", trained, "--metrics", tmp_path / "m.jsonl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records, summary = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in records] == [1, 10, 20, 30, 40] and summary["steps"] == 40
    losses = [r["loss"] for r in records]
    assert losses[-1] < 0.5 * losses[0], losses

    # The exported model is the user's model with the parameters of the 4 MPI ranks, which equal
    # the in-process simulation (MPI may sum in another order: not bitwise, within float32 noise).
    model = onnx.load(trained)
    exported = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    expected = simulate(out, load_data(src / "data.npz"), batch=32, steps=40)
    assert max_rel_error({k: exported[k] for k in expected.parameters[0]}, expected.parameters[0]) <= 1e-5
    assert max_rel_error(expected.parameters[0], initial_parameters(src / "model.onnx")) > 1e-3
    assert [n.op_type for n in model.graph.node] == [n.op_type for n in onnx.load(src / "model.onnx").graph.node]


@pytest.mark.mpi
def test_measured_timings_feed_the_timeline(model_dir, tmp_path):
    """`transpile run --timings` writes every rank's measured segment and collective times in the
    format `transpile inspect --timeline --timings` reads."""
    import json

    src = model_dir("perceptron")
    out = tmp_path / "out"
    assert cli(src / "model.onnx", "--gpus", 2, "-o", out, cwd=tmp_path).returncode == 0
    done = cli("run", out, "--data", src / "data.npz", "--batch", 16, "--steps", 6, "--log-every", 0,
               "--timings", tmp_path / "t.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    timings = json.loads((tmp_path / "t.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert [r["rank"] for r in timings["ranks"]] == [0, 1]
    for rank in timings["ranks"]:
        assert sorted(int(k) for k in rank["collectives"]) == [c["order"] for c in plan["collectives"]["step"]]
        assert rank["segments"] and all(v > 0 for v in [*rank["segments"].values(), *rank["collectives"].values()])
    assert not list(tmp_path.glob("t.json.rank*"))  # the per-rank parts are merged and removed
    drawn = cli("inspect", out, "--timeline", tmp_path / "t.png", "--timings", tmp_path / "t.json", cwd=tmp_path)
    assert drawn.returncode == 0, drawn.stderr
    assert (tmp_path / "t.png").stat().st_size > 0


@pytest.mark.mpi
def test_fp16_runs_report_the_loss_scale_and_the_skipped_steps(model_dir, tmp_path):
    """The perceptron's gradients overflow fp16 at GradScaler's first scales: those steps are
    skipped (their non-finite norm stops nothing), and every record says the scale and how many
    steps since the previous record were skipped; the summary counts them all."""
    src, out = model_dir("perceptron"), tmp_path / "out"
    done = cli(src / "model.onnx", "--gpus", 2, "--precision", "fp16", "--optimizer", "adam", "--lr", "0.01",
               "-o", out, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = cli("run", out, "--data", src / "data.npz", "--batch", 32, "--steps", 20, "--log-every", 1,
               "--metrics", tmp_path / "m.jsonl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records, summary = read_metrics(tmp_path / "m.jsonl")
    skipped = [r["skipped_steps"] for r in records]
    scales = [r["loss_scale"] for r in records]
    assert set(skipped) == {0, 1} and summary["skipped_steps"] == sum(skipped) < 20
    # GradScaler's rule: a skipped step halves the scale, a kept one leaves it (growth interval 2000).
    assert all(b == (a / 2 if s else a) for a, b, s in zip([2.0 ** 16] + scales, scales, skipped))
    assert summary["loss_scale"] == scales[-1] and "steps skipped (overflow)" in done.stdout
