"""--grad-accumulation K: K micro-batches per optimizer step == PyTorch's gradient accumulation
(``(loss / K).backward()`` on each micro-batch, then ``optimizer.step()``), on one device and on
N ranks of every strategy; BatchNorm running statistics move on with every micro-batch as in torch.

Each rank cuts its shard of the global batch into K contiguous micro-batches: the accumulate graph
(rank{r}_accum.onnx) adds the gradients of the first K-1, the step graph those of the last and sends
their mean to the collectives. Without BatchNorm the result is the mean gradient over the global
batch whatever N and K; with it, one device's K micro-batches are torch's.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import test_models_real  # noqa: E402
from conftest import assert_replicas_identical, max_rel_error  # noqa: E402
from test_models_real import BATCH, LR, STEPS, TOLERANCE, batch_of, torch_state  # noqa: E402

from runtime import simulate  # noqa: E402
from transpiler import OptimizerConfig, Options, transpile  # noqa: E402

K = 2
torch_model = test_models_real.exported  # the fixture: (model.onnx, torch module, data) of "mlp", "cnn", "gpt"


def train_torch(module, data: dict[str, np.ndarray], batch: int, k: int) -> tuple[list[float], dict]:
    module = copy.deepcopy(module).train()
    optimizer = torch.optim.SGD(module.parameters(), lr=float(np.float32(LR)), foreach=False)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        rows = batch_of(data, step, batch)
        total = 0.0
        for m in range(k):
            micro = (torch.from_numpy(v[m * batch // k:(m + 1) * batch // k].copy()) for v in rows.values())
            loss = module(*micro)
            (loss / k).backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total / k)
    return losses, torch_state(module)


def check(result, module, data, batch: int, k: int) -> None:
    torch_losses, expected = train_torch(module, data, batch, k)
    assert_replicas_identical(result.parameters)
    ours = result.parameters[0]
    assert sorted(ours) == sorted(expected)
    error = max_rel_error(ours, expected)
    assert error <= TOLERANCE, f"max relative error {error:.3g} vs torch with accumulation"
    np.testing.assert_allclose(result.losses, torch_losses, rtol=TOLERANCE)
    assert max_rel_error(expected, torch_state(module)) > 1e-3, "training did not move the parameters"


@pytest.mark.parametrize("model", ["mlp", "cnn", "gpt"])
def test_one_device_equals_torch_accumulation(model, torch_model, tmp_path):
    path, module, data = torch_model(model, "torchscript")
    transpile(path, tmp_path / "out", Options(optimizer=OptimizerConfig("sgd", lr=LR), grad_accumulation=K))
    result = simulate(tmp_path / "out", data, batch=BATCH[model], steps=STEPS, single_device=True)
    check(result, module, data, BATCH[model], K)


@pytest.mark.parametrize("strategy", ["sharded", "allreduce", "zero"])
@pytest.mark.parametrize("model,world", [("mlp", 2), ("mlp", 4), ("gpt", 4)])
def test_ranks_equal_torch_accumulation(model, world, strategy, torch_model, tmp_path):
    """Without BatchNorm: N ranks x K micro-batches average the gradient over the global batch, so
    they equal torch's K micro-batches on one device."""
    path, module, data = torch_model(model, "torchscript")
    transpile(path, tmp_path / "out", Options(world_size=world, strategy=strategy, bucket_mb=0.001,
                                             optimizer=OptimizerConfig("sgd", lr=LR), grad_accumulation=K))
    result = simulate(tmp_path / "out", data, batch=BATCH[model], steps=STEPS)
    check(result, module, data, BATCH[model], K)


def test_plan_and_files(torch_model, tmp_path):
    path, _, _ = torch_model("mlp", "torchscript")
    plan = transpile(path, tmp_path / "out", Options(world_size=2, grad_accumulation=4))
    assert plan["grad_accumulation"] == 4
    for entry in [plan["graphs"]["single"], *plan["graphs"]["ranks"]]:
        assert (tmp_path / "out" / entry["accum"]).is_file()
        assert sorted(a["param"] for a in entry["accumulators"]) == sorted(p["name"] for p in plan["parameters"])
    plain = transpile(path, tmp_path / "plain", Options(world_size=2))
    assert plain["grad_accumulation"] == 1 and "accum" not in plain["graphs"]["ranks"][0]


def test_cli_trains_with_accumulation_on_mpi_ranks(model_dir, tmp_path):
    source = model_dir("perceptron")
    cli = [sys.executable, "-m", "transpiler.cli"]
    done = subprocess.run([*cli, str(source / "model.onnx"), "--gpus", "2", "--grad-accumulation", "4", "-o",
                           str(tmp_path / "out"), "--optimizer", "momentum", "--lr", "1e-4"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    common = ["--data", str(source / "data.npz"), "--steps", "6", "--log-every", "3"]
    bad = subprocess.run([*cli, "run", str(tmp_path / "out"), "--batch", "12", *common], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "transpile: error: global batch 12 does not split into 2 rank(s) x 4 micro-batches (--grad-accumulation 4); "
        "use a multiple of 8"], bad.stderr
    run = subprocess.run([*cli, "run", str(tmp_path / "out"), "--batch", "16", *common, "--backend", "cpu",
                          "--export", str(tmp_path / "t.onnx"), "--metrics", str(tmp_path / "m.jsonl")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    data = dict(np.load(source / "data.npz"))
    expected = simulate(tmp_path / "out", data, batch=16, steps=6)
    from runtime.metrics import read_metrics

    assert [r["loss"] for r in read_metrics(tmp_path / "m.jsonl")[0]] == pytest.approx(
        [expected.losses[s - 1] for s in (1, 3, 6)], rel=1e-5)


def test_a_backend_without_accumulation_refuses_the_plan(torch_model, tmp_path):
    """The nccl backend does not run accumulate graphs yet: a clear error, not a wrong result."""
    from runtime.collectives import LocalGroup
    from runtime.errors import RunError
    from runtime.executor import CpuBackend
    from runtime.plan import load_plan
    from runtime.trainer import Trainer

    class NotCpu(CpuBackend):
        name = "nccl"
        runs_grad_accumulation = False  # declared, as GpuBackend does

    path, _, _ = torch_model("mlp", "torchscript")
    transpile(path, tmp_path / "out", Options(grad_accumulation=2))
    with pytest.raises(RunError, match="--grad-accumulation 2, which the nccl backend does not run yet"):
        Trainer(load_plan(tmp_path / "out"), LocalGroup(1).communicator(0), rank=0, backend=NotCpu())
