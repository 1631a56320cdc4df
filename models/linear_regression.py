"""Linear regression y = m*x + n with a mean-squared-error loss.

Inputs: x [batch, 1], y [batch, 1] float32. Parameters: m [1], n [1] (initializers "m", "n"), drawn
like torch.nn.Linear(1, 1) (U(-1, 1)). Output: loss, a float32 scalar.
Data: x ~ U(-1, 1), y = 3x + 2 + N(0, 0.01^2), 1024 rows by default.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from models._common import ModelSpec, data_input, data_rng, make_model, mse_loss_nodes, parameter_rng

TRUE_SLOPE = 3.0
TRUE_INTERCEPT = 2.0
NOISE_STD = 0.01


def build(seed: int = 0) -> onnx.ModelProto:
    rng = parameter_rng(seed)
    # nn.Linear(1, 1)'s init: fan_in 1, so both draw from U(-1, 1).
    m = rng.uniform(-1.0, 1.0, size=(1,)).astype(np.float32)
    n = rng.uniform(-1.0, 1.0, size=(1,)).astype(np.float32)
    nodes = [
        helper.make_node("Mul", ["x", "m"], ["mx"], name="/Mul"),
        helper.make_node("Add", ["mx", "n"], ["prediction"], name="/Add"),
        *mse_loss_nodes("prediction", "y"),
    ]
    return make_model(
        "linear_regression", nodes, [data_input("x", 1), data_input("y", 1)], {"m": m, "n": n}, __doc__
    )


def make_data(seed: int = 0, rows: int = 1024) -> dict[str, np.ndarray]:
    rng = data_rng(seed)
    x = rng.uniform(-1.0, 1.0, size=(rows, 1))
    y = TRUE_SLOPE * x + TRUE_INTERCEPT + rng.normal(0.0, NOISE_STD, size=(rows, 1))
    return {"x": x.astype(np.float32), "y": y.astype(np.float32)}


SPEC = ModelSpec(summary="y = m*x + n, MSE loss", build=build, make_data=make_data, default_rows=1024)
