"""--clip-grad-norm: N ranks of every strategy == one device == PyTorch's clip_grad_norm_.

A torch perceptron (targets ~40, gradient norms from a few to several hundred) is exported,
transpiled with ``--clip-grad-norm`` and trained 20 steps; torch trains the same module with
``torch.nn.utils.clip_grad_norm_`` between backward and step. The max norms are chosen so that some
steps are clipped and some are not (the coefficient's clamp at 1 matters). The global norm needs
every reduced gradient, which a sharded or zero rank holds only part of: those strategies sum the
ranks' squared norms with one scalar AllReduce after the gradient collectives (checked in
plan.json), allreduce needs none.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import assert_replicas_identical, max_rel_error
from test_torch_oracle import BATCH, STEPS, export, make_data, make_module, train_torch

from runtime import simulate
from transpiler import OptimizerConfig, Options, transpile

TOLERANCE = 1e-5
CONFIGS = {
    "sgd": OptimizerConfig("sgd", lr=1e-3, max_grad_norm=300.0),
    "adamw": OptimizerConfig("adamw", lr=0.05, max_grad_norm=450.0),
}


@pytest.fixture(scope="module")
def perceptron(tmp_path_factory):
    module = make_module("perceptron")
    data = make_data("perceptron")
    path = tmp_path_factory.mktemp("perceptron") / "model.onnx"
    export(module, data, path, "torchscript")
    return path, module, data


@pytest.mark.parametrize("strategy,world", [("local", 1), ("allreduce", 4), ("sharded", 2), ("sharded", 4),
                                            ("zero", 2), ("zero", 4)])
@pytest.mark.parametrize("opt", list(CONFIGS))
def test_clipped_training_equals_torch(perceptron, tmp_path, opt, strategy, world):
    path, module, data = perceptron
    config = CONFIGS[opt]
    plan = transpile(path, tmp_path / "out", Options(world_size=world, strategy="sharded" if world == 1 else strategy,
                                                     optimizer=config))
    assert plan["optimizer"]["max_grad_norm"] == config.max_grad_norm
    norm_sums = [c for c in plan["collectives"]["step"] if c["op"] == "AllReduce" and c["bucket"] == -1]
    if strategy in ("sharded", "zero"):
        # one scalar sum, after every gradient collective and before every Broadcast/AllGather
        assert [(c["reduction"], c["bytes"]) for c in norm_sums] == [("sum", 4)]
        ops = [c["op"] for c in plan["collectives"]["step"]]
        position = plan["collectives"]["step"].index(norm_sums[0])
        assert all(op in ("Reduce", "ReduceScatter") for op in ops[:position])
        assert all(op in ("Broadcast", "AllGather") for op in ops[position + 1:])
    else:
        assert norm_sums == []
    feeds = dict(zip([d["name"] for d in plan["data_inputs"]], data, strict=True))
    result = simulate(tmp_path / "out", feeds, batch=BATCH, steps=STEPS, single_device=world == 1)
    norms: list[float] = []
    torch_losses, torch_params = train_torch(module, data, config, config.lr, norms)
    clipped = sum(n > config.max_grad_norm for n in norms)
    assert 3 <= clipped <= STEPS - 3, norms  # both branches of min(1, max_norm / norm) are taken

    assert_replicas_identical(result.parameters)
    error = max_rel_error(result.parameters[0], torch_params)
    assert error <= TOLERANCE, f"max relative parameter error {error:.3g} vs torch"
    np.testing.assert_allclose(result.losses, torch_losses, rtol=TOLERANCE)


def test_without_the_flag_nothing_is_clipped(perceptron, tmp_path):
    path, _, _ = perceptron
    plan = transpile(path, tmp_path / "out", Options(world_size=2, strategy="zero", optimizer=OptimizerConfig("sgd")))
    assert plan["optimizer"]["max_grad_norm"] is None
    assert all(c["bucket"] != -1 for c in plan["collectives"]["step"])


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_bad_max_norm_is_a_one_line_error(perceptron, tmp_path, value):
    path, _, _ = perceptron
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "transpiler.cli", str(path), "-o", str(out), "--gpus", "2",
                           f"--clip-grad-norm={value}"], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--clip-grad-norm" in lines[0], done.stderr
    assert not out.exists()


def test_the_cli_flag_reaches_the_plan_and_inspect(perceptron, tmp_path):
    path, _, _ = perceptron
    out = tmp_path / "out"
    # sharded: each root holds part of the gradients, so the global norm needs a scalar AllReduce
    # (allreduce, the default, has every gradient on every rank and needs none).
    subprocess.run([sys.executable, "-m", "transpiler.cli", str(path), "-o", str(out), "--gpus", "2",
                    "--strategy", "sharded", "--clip-grad-norm", "0.5"], check=True, capture_output=True)
    assert json.loads((out / "plan.json").read_text())["optimizer"]["max_grad_norm"] == 0.5
    shown = subprocess.run([sys.executable, "-m", "transpiler.cli", "inspect", str(out), "--json"], check=True,
                           capture_output=True, text=True)
    assert json.loads(shown.stdout)["plan"]["max_grad_norm"] == 0.5
    text = subprocess.run([sys.executable, "-m", "transpiler.cli", "inspect", str(out)], check=True,
                          capture_output=True, text=True).stdout
    assert "optimizer sgd (gradients clipped to norm 0.5)" in text
    assert "grad_norm.squared.sum" in text  # the scalar AllReduce, listed with the step collectives
