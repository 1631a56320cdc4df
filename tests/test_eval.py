"""Evaluation during ``transpile run`` (--eval-data): OUT/eval.onnx is the forward in PyTorch's eval
mode, N ranks report what one device computes on the whole evaluation set (every row once, also for
a short last batch and rows not divisible by the ranks), and --export-best exports the best."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import child_env, load_data
from onnx import numpy_helper

from runtime import simulate
from runtime.metrics import read_metrics
from transpiler import OptimizerConfig, Options, transpile

ROWS, EVAL_ROWS, BATCH = 48, 37, 8  # 37 evaluation rows: not a multiple of the batch nor of the ranks


class TinyConvNet(torch.nn.Module):
    """Conv -> BatchNorm2d -> ReLU -> Dropout -> Linear -> MSE: every op whose eval mode differs."""

    def __init__(self, dropout: float = 0.5):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 3, 3)
        self.bn = torch.nn.BatchNorm2d(3)
        self.drop = torch.nn.Dropout(dropout)
        self.fc = torch.nn.Linear(3 * 4 * 4, 1)

    def forward(self, x, y):
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        return torch.nn.functional.mse_loss(self.fc(h.flatten(1)), y)


def conv_data(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 1, 6, 6)).astype(np.float32) * 2 + 0.5
    return {"x": x, "y": x[:, :, 1:3, 1:3].reshape(rows, 4).mean(1, keepdims=True).astype(np.float32)}


def export_conv(directory: Path, dropout: float) -> Path:
    torch.manual_seed(0)
    net = TinyConvNet(dropout)
    with torch.no_grad():  # running statistics away from (0, 1), so using them is visible
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 1.5)
    path = directory / "model.onnx"
    sample = conv_data(BATCH, 0)
    torch.onnx.export(copy.deepcopy(net), (torch.from_numpy(sample["x"]), torch.from_numpy(sample["y"])), str(path),
                      input_names=["x", "y"], output_names=["loss"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
                      opset_version=18, dynamo=False, training=torch.onnx.TrainingMode.TRAINING)
    return path


@pytest.fixture(scope="module")
def conv_model(tmp_path_factory):
    return export_conv(tmp_path_factory.mktemp("conv"), dropout=0.5)


@pytest.fixture(scope="module")
def conv_model_no_dropout(tmp_path_factory):
    """Deterministic training (Dropout draws differ between runs), for step-by-step comparisons."""
    return export_conv(tmp_path_factory.mktemp("conv_no_dropout"), dropout=0.0)


def torch_eval_loss(parameters: dict[str, np.ndarray], data: dict[str, np.ndarray]) -> float:
    """PyTorch's model.eval() loss over all of ``data`` in one batch, with the given state."""
    net = TinyConvNet()
    net.load_state_dict({k: torch.from_numpy(v) for k, v in parameters.items()}, strict=False)
    net.eval()
    with torch.no_grad():
        return float(net(torch.from_numpy(data["x"]), torch.from_numpy(data["y"])))


def ort_eval_loss(out: Path, parameters: dict[str, np.ndarray], data: dict[str, np.ndarray]) -> float:
    """One device: onnxruntime on OUT/eval.onnx, every evaluation row in one call."""
    session = ort.InferenceSession(str(out / "eval.onnx"), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return float(session.run(["loss"], {k: v for k, v in {**data, **parameters}.items() if k in names})[0])


def initializers(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def test_eval_graph_is_torch_eval_mode(conv_model, tmp_path):
    """eval.onnx with the model's own values equals torch's model.eval() (running statistics, no
    Dropout), and differs from the train-mode loss (so the test can tell the modes apart)."""
    plan = transpile(conv_model, tmp_path / "out", Options(world_size=2))
    assert plan["eval"]["graph"] == "eval.onnx" and plan["eval"]["loss"] == "loss"
    assert set(plan["eval"]["state"]) >= {"bn.running_mean", "bn.running_var", "conv.weight", "fc.weight"}
    graph = onnx.load(str(tmp_path / "out" / "eval.onnx")).graph
    assert not [n for n in graph.node if n.domain.startswith("graph_transpiler")]
    values = initializers(conv_model)
    data = conv_data(EVAL_ROWS, 1)
    expected = torch_eval_loss(values, data)
    assert ort_eval_loss(tmp_path / "out", values, data) == pytest.approx(expected, rel=1e-5)
    net = TinyConvNet()
    net.load_state_dict({k: torch.from_numpy(v) for k, v in values.items()}, strict=False)
    with torch.no_grad():
        train_mode = float(net.train()(torch.from_numpy(data["x"]), torch.from_numpy(data["y"])))
    assert abs(train_mode - expected) > 1e-3


@pytest.mark.parametrize("strategy", ["sharded", "allreduce", "zero"])
def test_two_ranks_equal_one_device(conv_model, tmp_path, strategy):
    """Every evaluation of a 2-rank run equals one device's on the same state (rank 0's parameters
    and buffers: without --sync-bn each rank's BN statistics differ, and evaluation uses rank 0's),
    for eval batches whose last batch is short and splits unevenly or leaves rank 1 without rows."""
    out = tmp_path / "out"
    transpile(conv_model, out, Options(world_size=2, strategy=strategy, optimizer=OptimizerConfig("momentum", lr=0.02)))
    data, evaluation = conv_data(ROWS, 0), conv_data(EVAL_ROWS, 1)
    for eval_batch in (8, 12):  # last batch: 5 rows (rank 0: 4, rank 1: 1); 1 row (rank 1: none)
        result = simulate(out, data, batch=BATCH, steps=3, eval_data=evaluation, eval_batch=eval_batch)
        assert [step for step, _ in result.eval_losses] == [3]
        state = result.parameters[0]
        assert not np.array_equal(state["bn.running_mean"], result.parameters[1]["bn.running_mean"])
        assert abs(result.eval_losses[-1][1] - ort_eval_loss(out, state, evaluation)) < 1e-6
        assert result.eval_losses[-1][1] == pytest.approx(torch_eval_loss(state, evaluation), rel=1e-5)


def test_every_n_steps_equals_single_device(conv_model_no_dropout, tmp_path):
    """With --sync-bn (and no Dropout) training is the same on 2 ranks and on one device, so every
    evaluation is too."""
    out = tmp_path / "out"
    transpile(conv_model_no_dropout, out, Options(world_size=2, sync_bn=True, optimizer=OptimizerConfig("sgd", lr=0.02)))
    data, evaluation = conv_data(ROWS, 0), conv_data(EVAL_ROWS, 1)
    two = simulate(out, data, batch=BATCH, steps=5, eval_data=evaluation, eval_every=2)
    one = simulate(out, data, batch=BATCH, steps=5, eval_data=evaluation, eval_every=2, single_device=True)
    assert [s for s, _ in two.eval_losses] == [2, 4, 5] == [s for s, _ in one.eval_losses]
    for (_, a), (_, b) in zip(two.eval_losses, one.eval_losses):
        assert abs(a - b) < 1e-6
    assert len({round(v, 6) for _, v in two.eval_losses}) == 3  # the parameters moved between evaluations


def run_cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "commands", "run", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300, env=child_env())


@pytest.fixture(scope="module")
def regression(model_dir, tmp_path_factory):
    """The built-in linear regression on 2 ranks, with its data split into training and evaluation."""
    tmp = tmp_path_factory.mktemp("regression")
    source = model_dir("linear_regression")
    transpile(source / "model.onnx", tmp / "out", Options(world_size=2, strategy="sharded"))
    data = load_data(source / "data.npz")
    np.savez(tmp / "train.npz", **{k: v[:200] for k, v in data.items()})
    np.savez(tmp / "eval.npz", **{k: v[200:] for k, v in data.items()})  # 56 rows
    return tmp


def test_export_best_exports_the_best_step(regression):
    """With a learning rate that first improves and then diverges (linear warmup to a peak past
    stability), --export-best writes the parameters of the best evaluation: what 'transpile export'
    writes from the checkpoint of that step. On 2 MPI ranks (the cli path), with the eval losses
    read from --metrics."""
    tmp = regression
    done = run_cli(tmp / "out", "--data", tmp / "train.npz", "--batch", 20, "--steps", 16, "--lr", _diverging_lr(tmp),
                   "--warmup-steps", 15, "--eval-data", tmp / "eval.npz", "--eval-every", 2, "--eval-batch", 6,
                   "--log-every", 4, "--export", tmp / "best.onnx", "--export-best", "--checkpoint", tmp / "ckpt",
                   "--checkpoint-every", 2, "--keep-last", 8, "--metrics", tmp / "metrics.jsonl", cwd=tmp)
    assert done.returncode == 0, done.stderr
    records, summary = read_metrics(tmp / "metrics.jsonl")
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(evals) == [2, 4, 6, 8, 10, 12, 14, 16], records
    best = min(evals, key=evals.get)
    assert 2 < best < 16 and evals[16] > 2 * evals[best], evals  # it improved, then diverged
    assert (summary["best_eval_step"], summary["best_eval_loss"]) == (best, evals[best])
    assert f"(step {best}, best eval loss" in done.stdout  # the end summary names the exported step
    export = subprocess.run([sys.executable, "-m", "commands", "export", tmp / "out", "--checkpoint",
                             tmp / "ckpt" / f"checkpoint-{best}", "-o", tmp / "at_best.onnx"], capture_output=True,
                            text=True, cwd=tmp, timeout=120, env=child_env())
    assert export.returncode == 0, export.stderr
    exported, expected = initializers(tmp / "best.onnx"), initializers(tmp / "at_best.onnx")
    assert exported.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    last = subprocess.run([sys.executable, "-m", "commands", "export", tmp / "out", "--checkpoint", tmp / "ckpt",
                           "-o", tmp / "last.onnx"], capture_output=True, text=True, cwd=tmp, timeout=120,
                          env=child_env())
    assert last.returncode == 0, last.stderr
    assert not np.array_equal(initializers(tmp / "last.onnx")["m"], exported["m"])


def _diverging_lr(tmp: Path) -> float:
    """A peak lr past the stability limit of SGD on this least-squares problem (2 / the largest
    eigenvalue of the MSE's Hessian in (m, n)), so late steps diverge while early, warmed-up ones improve."""
    with np.load(tmp / "train.npz") as npz:
        features = np.concatenate([npz["x"].astype(np.float64), np.ones((len(npz["x"]), 1))], axis=1)
    return 3.0 / float(np.linalg.eigvalsh(2 * features.T @ features / len(features)).max())


@pytest.mark.parametrize("args, fragments", [
    (["--eval-every", 2], ["--eval-every needs --eval-data"]),
    (["--eval-batch", 4], ["--eval-batch needs --eval-data"]),
    (["--export-best", "--export", "t.onnx"], ["--export-best needs --eval-data"]),
    (["--eval-data", "eval.npz", "--export-best"], ["--export-best needs --export"]),
    (["--eval-data", "eval.npz", "--eval-batch", 5], ["--eval-batch 5", "2 equal shards"]),
    (["--eval-data", "eval.npz", "--eval-every", -1], ["--eval-every must be >= 0"]),
    (["--eval-data", "missing.npz"], ["missing.npz: no such data file"]),
    (["--eval-data", "no_y.npz"], ["no_y.npz: missing input 'y'"]),
    (["--eval-data", "int_x.npz"], ["int_x.npz: input 'x' has dtype int64"]),
    (["--eval-data", "wide_x.npz"], ["wide_x.npz: input 'x' has shape"]),
])
def test_bad_options_are_one_line_errors(regression, args, fragments, capsys, monkeypatch):
    """Checked by ``transpile run`` before any rank starts (in process here: the same code path)."""
    from runtime.cli import main

    tmp = regression
    monkeypatch.chdir(tmp)
    with np.load(tmp / "eval.npz") as npz:
        data = {k: npz[k] for k in npz.files}
    np.savez(tmp / "no_y.npz", x=data["x"])
    np.savez(tmp / "int_x.npz", **{**data, "x": data["x"].astype(np.int64)})
    np.savez(tmp / "wide_x.npz", **{**data, "x": np.concatenate([data["x"], data["x"]], axis=1)})
    status = main(["run", str(tmp / "out"), "--data", str(tmp / "train.npz"), "--batch", "20", "--steps", "2",
                   *map(str, args)])
    captured = capsys.readouterr()
    assert status == 2, (captured.out, captured.err)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("transpile: error: "), captured.err
    assert captured.out == ""
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not (tmp / "t.onnx").exists()


def test_old_out_without_eval_graph_says_transpile_again(regression, tmp_path):
    """An OUT written before evaluation graphs: plan.json without "eval" still trains, and
    --eval-data on it is one line asking to transpile again."""
    import shutil

    out = tmp_path / "old"
    shutil.copytree(regression / "out", out)
    plan = json.loads((out / "plan.json").read_text())
    del plan["eval"]
    (out / "plan.json").write_text(json.dumps(plan))
    (out / "eval.onnx").unlink()
    done = run_cli(out, "--data", regression / "train.npz", "--batch", 20, "--steps", 2, "--eval-data",
                   regression / "eval.npz", cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "has no evaluation graph" in done.stderr and "transpile the model again" in done.stderr


def test_plan_eval_field_is_checked(regression, tmp_path):
    """plan.json's eval field names a file that must be in OUT: one line naming the field."""
    import shutil

    from contract.plan import PlanError, load_plan

    out = tmp_path / "out"
    shutil.copytree(regression / "out", out)
    assert load_plan(out).eval.state == ("m", "n")
    (out / "eval.onnx").unlink()
    with pytest.raises(PlanError, match=r"field 'eval.graph' names eval.onnx, which is not in"):
        load_plan(out)


def _gpus() -> int:
    from runtime.gpu import cuda_available, gpu_count

    return gpu_count() if cuda_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")
def test_gpu_eval_equals_cpu(conv_model_no_dropout, tmp_path):
    """The nccl backend's evaluations (every GPU it may use, TF32 off) equal the cpu backend's."""
    ranks = 2 if _gpus() >= 2 else 1
    transpile(conv_model_no_dropout, tmp_path / "out", Options(world_size=ranks, sync_bn=True))
    np.savez(tmp_path / "train.npz", **conv_data(ROWS, 0))
    np.savez(tmp_path / "eval.npz", **conv_data(EVAL_ROWS, 1))
    common = [tmp_path / "out", "--data", tmp_path / "train.npz", "--batch", BATCH, "--steps", 4, "--eval-data",
              tmp_path / "eval.npz", "--eval-every", 2, "--eval-batch", 12, "--log-every", 2]
    evals = {}
    for backend in ("nccl", "cpu"):
        metrics = tmp_path / f"{backend}.jsonl"
        done = run_cli(*common, "--backend", backend, "--no-tf32", "--metrics", metrics, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        evals[backend] = [r["eval_loss"] for r in read_metrics(metrics)[0] if "eval_loss" in r]
    assert len(evals["cpu"]) == 2
    np.testing.assert_allclose(evals["nccl"], evals["cpu"], rtol=1e-5)


def test_quiet_runs_still_record_evaluations_and_a_resume_at_the_end_only_evaluates(regression, tmp_path):
    """--log-every 0 says nothing but --metrics still gets the eval records; a resume at --steps
    evaluates, exports and ends with a summary of no steps (it used to crash formatting it)."""
    tmp = regression
    common = [tmp / "out", "--data", tmp / "train.npz", "--batch", 20, "--steps", 6, "--eval-data", tmp / "eval.npz",
              "--eval-every", 3]
    done = run_cli(*common, "--log-every", 0, "--metrics", tmp_path / "quiet.jsonl", "--checkpoint", tmp_path / "ck",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
    records, summary = read_metrics(tmp_path / "quiet.jsonl")
    assert [(r["step"], set(r)) for r in records] == [(3, {"step", "epoch", "eval_loss"}), (6, {"step", "epoch", "eval_loss"})]
    again = run_cli(*common, "--resume", "latest", "--checkpoint", tmp_path / "ck", "--export", tmp_path / "t.onnx",
                    "--metrics", tmp_path / "resumed.jsonl", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    records, summary = read_metrics(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in records] == [6] and records[0]["eval_loss"] == pytest.approx(
        read_metrics(tmp_path / "quiet.jsonl")[0][-1]["eval_loss"], rel=1e-6)
    assert summary["steps_run"] == 0 and "no steps run (resumed at step 6)" in again.stdout
    assert (tmp_path / "t.onnx").is_file()
