"""Shared pieces of the example-model generators: the spec type, ONNX helpers, parameter init."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 18
# IR 10 is read by every onnxruntime this project supports (CPU and GPU wheels, >= 1.20).
IR_VERSION = 10
BATCH = "batch"


@dataclass(frozen=True)
class ModelSpec:
    """How to generate one example model and its data set."""

    summary: str
    build: Callable[[int], onnx.ModelProto]  # seed -> model with initial parameters
    make_data: Callable[[int, int], dict[str, np.ndarray]]  # (seed, rows) -> arrays keyed by input name
    default_rows: int


def parameter_rng(seed: int) -> np.random.Generator:
    # Parameters and data draw from separate streams, so --rows never changes the initial parameters.
    return np.random.default_rng((seed, 0))


def data_rng(seed: int) -> np.random.Generator:
    return np.random.default_rng((seed, 1))


def linear_init(rng: np.random.Generator, fan_out: int, fan_in: int) -> tuple[np.ndarray, np.ndarray]:
    """torch.nn.Linear's default init: kaiming_uniform_(a=sqrt(5)) on the weight reduces to
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and the bias uses the same bound. Weight is [out, in]."""
    bound = 1.0 / np.sqrt(fan_in)
    weight = rng.uniform(-bound, bound, size=(fan_out, fan_in)).astype(np.float32)
    bias = rng.uniform(-bound, bound, size=(fan_out,)).astype(np.float32)
    return weight, bias


def data_input(name: str, features: int) -> onnx.ValueInfoProto:
    """A float32 [batch, features] input with a symbolic batch axis."""
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [BATCH, features])


def mse_loss_nodes(prediction: str, target: str, loss: str = "loss") -> list[onnx.NodeProto]:
    """mean((prediction - target)^2) over every element, as a scalar, like torch's mse_loss.

    The square is a Mul rather than Pow(x, 2): no exponent constant to keep out of the trainable
    parameters, and x*x is what torch computes for x**2.
    """
    return [
        helper.make_node("Sub", [prediction, target], ["diff"], name="loss/Sub"),
        helper.make_node("Mul", ["diff", "diff"], ["squared"], name="loss/Square"),
        helper.make_node("ReduceMean", ["squared"], [loss], name="loss/ReduceMean", keepdims=0),
    ]


def make_model(
    name: str,
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    initializers: dict[str, np.ndarray],
    doc: str,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        name,
        inputs,
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(array, name=key) for key, array in initializers.items()],
        doc_string=doc,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="graph-transpiler models",
    )
    onnx.checker.check_model(model, full_check=True)
    return model
