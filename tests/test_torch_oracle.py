"""One device == PyTorch: a torch module exported with torch.onnx, transpiled and trained by the
single-device graph, ends (after 20 steps, same batches in the same order) where the same module
trained by autograd + torch.optim ends, within a relative 1e-5 per parameter; the per-step losses
agree within rtol 1e-5. One case per model also trains 4 sharded ranks, which closes the loop
N ranks == 1 device == PyTorch.

Both exporters are covered: the TorchScript one (``dynamo=False``, opset 17, so the transpiler's
upgrade to opset 18 runs too) and torch.export's (``dynamo=True``, opset 18). Both keep torch's
parameter names ("fc1.weight", "m") as the initializer names, so parameters are matched by name.

Pitfall found while writing this: both exporters merge parameters with equal initial values.
With LinearRegression's zero init the TorchScript exporter (eval mode) emits one initializer "m"
and ``n = Identity(m)``; the dynamo exporter's optimizer drops "n" and feeds "m" twice. The
transpiled graph then trains one tied parameter, which is not the torch model. The modules here are
therefore initialized with distinct random values, and ``exported_parameters`` insists that every
torch parameter has its own initializer.

``python3 -m pytest -s tests/test_torch_oracle.py`` prints the measured errors at the end.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import assert_replicas_identical, max_rel_error
from onnx import numpy_helper

import models
from models.torch_twins import LinearRegression, Perceptron
from runtime import simulate
from transpiler import OptimizerConfig, Options, transpile

STEPS = 20
BATCH = 32  # divisible by 4 ranks
ROWS = 200  # not a multiple of BATCH: batch 6 wraps around the end of the data
TOLERANCE = 1e-5
SHARDED_WORLD = 4

OPTIMIZERS = {
    "sgd": OptimizerConfig("sgd", lr=0.01),
    "momentum": OptimizerConfig("momentum", lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": OptimizerConfig("adam", lr=0.01),
    "adamw": OptimizerConfig("adamw", lr=0.01),  # torch's default weight decay, 0.01
}
# The perceptron's targets are ~40 and its gradients large: a smaller SGD step keeps it from
# diverging. Adam normalizes the step, so it keeps a learning rate that moves the weights visibly.
LR_SCALE = {
    ("perceptron", "sgd"): 1e-3,
    ("perceptron", "momentum"): 1e-3,
    ("perceptron", "adam"): 0.1,
    ("perceptron", "adamw"): 0.1,
}
EXPORTERS = ["torchscript", "dynamo"]
# Exporter cases known to fail, with the reason (none at the moment: torch 2.13, onnxscript).
XFAIL: dict[tuple[str, str], str] = {}

# (model, exporter, optimizer, mode) -> {"params": max rel error, "loss": max rel loss error, ...}
RESULTS: dict[tuple[str, str, str, str], dict[str, float]] = {}


def make_module(model: str) -> torch.nn.Module:
    """torch's own initialization, seeded; m and n of the linear regression drawn like
    nn.Linear(1, 1)'s (U(-1, 1)) so that they differ (see the module docstring)."""
    torch.manual_seed(0)
    if model == "linear_regression":
        module = LinearRegression()
        with torch.no_grad():
            module.m.uniform_(-1.0, 1.0)
            module.n.uniform_(-1.0, 1.0)
        return module
    return Perceptron()


def make_data(model: str) -> list[np.ndarray]:
    """[inputs, targets] as float32 arrays, in forward()'s argument order."""
    data = models.MODELS[model].make_data(0, ROWS)
    return [np.ascontiguousarray(a, dtype=np.float32) for a in data.values()]


def export(module: torch.nn.Module, example: list[np.ndarray], path: Path, exporter: str) -> None:
    args = tuple(torch.from_numpy(a[:4].copy()) for a in example)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            torch.onnx.export(
                module, args, str(path), dynamo=False, opset_version=17,
                input_names=["x", "y"], output_names=["loss"],
                dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
            )
        else:
            pytest.importorskip("onnxscript")
            batch = torch.export.Dim("batch")
            torch.onnx.export(
                module, args, str(path), dynamo=True, opset_version=18,
                input_names=["x", "y"], output_names=["loss"],
                dynamic_shapes={"x": {0: batch}, "y": {0: batch}}, verbose=False,
            )


def exported_parameters(path: Path, module: torch.nn.Module) -> dict[str, np.ndarray]:
    """The exported initializers by name; each must be a torch parameter with torch's initial value."""
    proto = onnx.load(str(path))
    arrays = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    expected = {name: p.detach().numpy() for name, p in module.named_parameters()}
    assert sorted(arrays) == sorted(expected), (
        f"exporter renamed, merged or added initializers: {sorted(arrays)} vs torch {sorted(expected)}"
    )
    for name, value in expected.items():
        np.testing.assert_array_equal(arrays[name], value, err_msg=f"initial value of {name}")
    return arrays


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(model, exporter)`` -> (model.onnx, the torch module it was exported from, data)."""
    cache: dict[tuple[str, str], tuple[Path, torch.nn.Module, list[np.ndarray]]] = {}

    def get(model: str, exporter: str):
        if (model, exporter) not in cache:
            module = make_module(model)
            data = make_data(model)
            path = tmp_path_factory.mktemp(f"{model}-{exporter}") / "model.onnx"
            export(module, data, path, exporter)
            exported_parameters(path, module)
            cache[model, exporter] = (path, module, data)
        return cache[model, exporter]

    return get


def torch_optimizer(config: OptimizerConfig, params, lr: float) -> torch.optim.Optimizer:
    if config.name in ("sgd", "momentum"):
        momentum = config.momentum if config.name == "momentum" else 0.0
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=config.nesterov,
                               weight_decay=config.weight_decay, foreach=False)
    cls = torch.optim.Adam if config.name == "adam" else torch.optim.AdamW
    return cls(params, lr=lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, foreach=False)


def train_torch(module: torch.nn.Module, data: list[np.ndarray], config: OptimizerConfig, lr: float,
                norms: list[float] | None = None):
    """A deepcopy of ``module`` trained on global batch b = rows [b*B, (b+1)*B) modulo the data.
    With ``config.max_grad_norm``, clip_grad_norm_ runs between backward and step; the total norms
    it returns are appended to ``norms``."""
    module = copy.deepcopy(module)
    # The graph's lr input is float32: give torch the same value (docs/optimizers.md).
    optimizer = torch_optimizer(config, list(module.parameters()), float(np.float32(lr)))
    rows = len(data[0])
    losses = []
    for step in range(STEPS):
        index = np.arange(step * BATCH, (step + 1) * BATCH) % rows
        x, y = (torch.from_numpy(a[index]) for a in data)
        optimizer.zero_grad()
        loss = module(x, y)
        loss.backward()
        if config.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(module.parameters(), config.max_grad_norm, foreach=False)
            if norms is not None:
                norms.append(float(norm))
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, {name: p.detach().numpy().copy() for name, p in module.named_parameters()}


def run_case(model, exporter, opt, world, exported, tmp_path) -> None:
    reason = XFAIL.get((model, exporter))
    if reason:
        pytest.xfail(reason)
    path, module, data = exported(model, exporter)
    config = OPTIMIZERS[opt]
    lr = config.lr * LR_SCALE.get((model, opt), 1.0)
    plan = transpile(path, tmp_path / "out", Options(world_size=world, optimizer=config))
    feeds = dict(zip([d["name"] for d in plan["data_inputs"]], data, strict=True))
    single = world == 1
    result = simulate(tmp_path / "out", feeds, batch=BATCH, steps=STEPS, lr=lr, single_device=single)
    torch_losses, torch_params = train_torch(module, data, config, lr)

    assert_replicas_identical(result.parameters)
    params = result.parameters[0]
    assert sorted(params) == sorted(torch_params)
    param_error = max_rel_error(params, torch_params)
    losses, expected = np.array(result.losses), np.array(torch_losses)
    loss_error = float(np.max(np.abs(losses - expected) / np.abs(expected)))
    moved = max_rel_error(torch_params, {n: p.detach().numpy() for n, p in module.named_parameters()})
    mode = "single" if single else f"sharded x{world}"
    RESULTS[model, exporter, opt, mode] = {"params": param_error, "loss": loss_error, "moved": moved,
                                           "loss0": float(expected[0]), "lossN": float(expected[-1])}

    assert param_error <= TOLERANCE, f"max relative parameter error {param_error:.3g} vs torch"
    np.testing.assert_allclose(losses, expected, rtol=TOLERANCE)
    # Training moved the parameters (comparing two untouched models would pass vacuously).
    assert moved > 1e-3, f"parameters moved by only {moved:.3g} (relative)"


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("model", ["linear_regression", "perceptron"])
def test_one_device_equals_torch(model, exporter, opt, exported, tmp_path):
    run_case(model, exporter, opt, 1, exported, tmp_path)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("model", ["linear_regression", "perceptron"])
def test_sharded_ranks_equal_torch(model, exporter, exported, tmp_path):
    run_case(model, exporter, "adamw", SHARDED_WORLD, exported, tmp_path)


def test_report():
    """Print the measured errors (visible with -s); runs last in this file."""
    if not RESULTS:
        pytest.skip("no oracle case ran")
    print(f"\n{'model':<18} {'exporter':<12} {'optimizer':<9} {'mode':<11} "
          f"{'param rel err':>13} {'loss rel err':>12} {'moved':>8} {'loss 0 -> 19':>20}")
    for (model, exporter, opt, mode), r in RESULTS.items():
        print(f"{model:<18} {exporter:<12} {opt:<9} {mode:<11} {r['params']:>13.3g} {r['loss']:>12.3g} "
              f"{r['moved']:>8.3g} {r['loss0']:>9.4g} -> {r['lossN']:<9.4g}")
    assert max(r["params"] for r in RESULTS.values()) <= TOLERANCE
