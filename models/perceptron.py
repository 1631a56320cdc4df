"""flashlight's distributed-training example perceptron: Linear(10, 100) - ReLU - Linear(100, 1), MSE.

Inputs: X [batch, 10], Y [batch, 1] float32. Parameters named as a PyTorch export names them:
fc1.weight [100, 10], fc1.bias [100], fc2.weight [1, 100], fc2.bias [1], each layer a Gemm with
transB=1 (weight stored [out, in]), initialized like torch.nn.Linear. Output: loss, a float32 scalar.
Data: X ~ U(1, 2)^10, Y = sum(X^3, axis=1) + sin(2*pi*U) with U ~ U(0, 1); 2048 rows by default.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from models._common import (
    ModelSpec,
    data_input,
    data_rng,
    linear_init,
    make_model,
    mse_loss_nodes,
    parameter_rng,
)

IN_FEATURES = 10
HIDDEN = 100


def build(seed: int = 0) -> onnx.ModelProto:
    rng = parameter_rng(seed)
    fc1_weight, fc1_bias = linear_init(rng, HIDDEN, IN_FEATURES)
    fc2_weight, fc2_bias = linear_init(rng, 1, HIDDEN)
    nodes = [
        helper.make_node(
            "Gemm", ["X", "fc1.weight", "fc1.bias"], ["/fc1/Gemm_output_0"], name="/fc1/Gemm", transB=1
        ),
        helper.make_node("Relu", ["/fc1/Gemm_output_0"], ["/relu/Relu_output_0"], name="/relu/Relu"),
        helper.make_node(
            "Gemm",
            ["/relu/Relu_output_0", "fc2.weight", "fc2.bias"],
            ["prediction"],
            name="/fc2/Gemm",
            transB=1,
        ),
        *mse_loss_nodes("prediction", "Y"),
    ]
    parameters = {
        "fc1.weight": fc1_weight,
        "fc1.bias": fc1_bias,
        "fc2.weight": fc2_weight,
        "fc2.bias": fc2_bias,
    }
    return make_model(
        "perceptron", nodes, [data_input("X", IN_FEATURES), data_input("Y", 1)], parameters, __doc__
    )


def make_data(seed: int = 0, rows: int = 2048) -> dict[str, np.ndarray]:
    rng = data_rng(seed)
    x = rng.uniform(1.0, 2.0, size=(rows, IN_FEATURES))
    noise = np.sin(2.0 * np.pi * rng.uniform(0.0, 1.0, size=(rows, 1)))
    y = np.sum(x**3, axis=1, keepdims=True) + noise
    return {"X": x.astype(np.float32), "Y": y.astype(np.float32)}


SPEC = ModelSpec(
    summary="Linear(10,100)-ReLU-Linear(100,1), MSE loss (flashlight's example)",
    build=build,
    make_data=make_data,
    default_rows=2048,
)
