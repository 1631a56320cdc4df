"""N ranks == 1 device: for every strategy and placement, after 20 steps on the same global batches
the parameters equal a single-device run on the full batch, and are identical across ranks.

The ranks run as threads of this process with in-process collectives (runtime.simulate); the MPI
path is covered by tests/test_cli_run.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_replicas_identical, initial_parameters, load_data, max_rel_error

from runtime import simulate
from transpiler import OptimizerConfig, Options, transpile

STEPS = 20
BATCH = 32  # divisible by 1, 2 and 4; 20 steps wrap around the 256 rows
TOLERANCE = 1e-5

OPTIMIZERS = {
    "sgd": OptimizerConfig("sgd", lr=0.01),
    "momentum": OptimizerConfig("momentum", lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adamw": OptimizerConfig("adamw", lr=0.01),
}
# The perceptron's targets are ~40; a smaller step keeps SGD from diverging.
LR_SCALE = {"linear_regression": 1.0, "perceptron": 1e-3}


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """Single-device run on the full global batch, per (model, optimizer)."""
    cache = {}

    def get(model: str, opt: str):
        if (model, opt) not in cache:
            out = tmp_path_factory.mktemp(f"ref-{model}-{opt}")
            transpile(model_dir(model) / "model.onnx", out / "out", Options(world_size=1, optimizer=OPTIMIZERS[opt]))
            data = load_data(model_dir(model) / "data.npz")
            cache[model, opt] = simulate(
                out / "out", data, batch=BATCH, steps=STEPS, lr=OPTIMIZERS[opt].lr * LR_SCALE[model], single_device=True
            )
        return cache[model, opt]

    return get


@pytest.mark.parametrize("placement", ["hash", "balanced"])
@pytest.mark.parametrize("strategy", ["allreduce", "sharded", "zero"])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("model", ["linear_regression", "perceptron"])
def test_ranks_equal_one_device(model, opt, world, strategy, placement, model_dir, reference, tmp_path):
    ref = reference(model, opt)
    options = Options(world_size=world, strategy=strategy, placement=placement, optimizer=OPTIMIZERS[opt])
    transpile(model_dir(model) / "model.onnx", tmp_path / "out", options)
    data = load_data(model_dir(model) / "data.npz")
    result = simulate(tmp_path / "out", data, batch=BATCH, steps=STEPS, lr=OPTIMIZERS[opt].lr * LR_SCALE[model])

    # Replicas are bit-identical: in the sharded strategy every rank receives the root's values,
    # in the all-reduce one every rank applies the same update to the same all-reduced gradient.
    assert_replicas_identical(result.parameters)
    error = max_rel_error(result.parameters[0], ref.parameters[0])
    assert error <= TOLERANCE, f"max relative error {error:.3g} vs one device"
    np.testing.assert_allclose(result.losses, ref.losses, rtol=1e-5)
    # Training moved the parameters (comparing two untouched models would pass vacuously).
    assert max_rel_error(result.parameters[0], initial_parameters(model_dir(model) / "model.onnx")) > 1e-3
