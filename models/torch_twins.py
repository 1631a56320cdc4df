"""PyTorch versions of the built-in models, for oracle tests: ``forward(x, y)`` returns the loss.

Parameter names equal the ONNX initializer names, so ``load_onnx_parameters`` can copy the initial
values of a generated model.onnx into the module and both can be trained from the same start.
``export_onnx`` is the one PyTorch -> ONNX export used by the torch-defined models (models.cnn,
models.gpt, models.digits) and their tests. Imports torch; the numpy-only models do not.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

__all__ = ["TWINS", "LinearRegression", "Perceptron", "export_onnx", "load_onnx_parameters", "twin_for"]


def mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # The ONNX graphs square with a Mul; torch's x**2 computes x*x as well.
    diff = prediction - target
    return (diff * diff).mean()


class LinearRegression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = nn.Parameter(torch.zeros(1))
        self.n = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return mse(x * self.m + self.n, y)


class Perceptron(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 100)
        self.fc2 = nn.Linear(100, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return mse(self.fc2(torch.relu(self.fc1(x))), y)


TWINS: dict[str, type[nn.Module]] = {"linear_regression": LinearRegression, "perceptron": Perceptron}


def onnx_initializers(model_path: str | Path) -> dict[str, np.ndarray]:
    model = onnx.load(str(model_path))
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}


def load_onnx_parameters(module: nn.Module, model_path: str | Path) -> nn.Module:
    """Copy the initializers of ``model_path`` into the parameters of the same name; every parameter
    must be found, with the same shape (a twin that silently kept torch's own init would make an
    oracle test compare two different starting points)."""
    arrays = onnx_initializers(model_path)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name not in arrays:
                raise KeyError(
                    f"{model_path}: no initializer named {name!r} (has: {', '.join(sorted(arrays))})"
                )
            value = torch.from_numpy(arrays[name].copy())
            if value.shape != parameter.shape:
                raise ValueError(
                    f"{model_path}: {name!r} has shape {list(value.shape)}, module expects {list(parameter.shape)}"
                )
            parameter.copy_(value)
    return module


def twin_for(name: str, model_path: str | Path) -> nn.Module:
    """The torch twin of built-in model ``name``, starting from ``model_path``'s parameters."""
    return load_onnx_parameters(TWINS[name](), model_path)


def export_onnx(
    module: nn.Module,
    args: tuple[torch.Tensor, ...],
    path: str | Path,
    *,
    input_names: list[str],
    output_names: list[str],
    dynamo: bool = False,
    opset: int | None = None,
) -> Path:
    """Export ``module`` (its forward takes ``args``) to ``path`` with a dynamic batch axis (axis 0 of
    every input), in TRAINING mode so BatchNormalization and Dropout keep their training semantics.

    - TorchScript (``dynamo=False``, default opset 17): ``training=TRAINING`` and no constant folding,
      so BatchNormalization is exported with ``training_mode=1`` and no two parameters are merged.
    - dynamo (``dynamo=True``, default opset 18): the module is exported in train mode with
      ``optimize=False``, so initializers with equal values are not deduplicated
      (docs/architecture.md, "Exporters may merge parameters that start equal"), weights inside
      model.onnx (no external data file).
    The module's own training flag is restored afterwards.
    """
    path = Path(path)
    was_training = module.training
    module.train()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if dynamo:
                batch = torch.export.Dim("batch")
                torch.onnx.export(
                    module, args, str(path), dynamo=True, opset_version=opset or 18,
                    input_names=input_names, output_names=output_names,
                    dynamic_shapes={name: {0: batch} for name in input_names},
                    optimize=False, verbose=False,
                    # One self-contained file (the exporter would otherwise move large weights to
                    # model.onnx.data); protobuf's 2 GiB limit allows GPT-2 small (650 MB).
                    external_data=False,
                )
            else:
                torch.onnx.export(
                    module, args, str(path), dynamo=False, opset_version=opset or 17,
                    input_names=input_names, output_names=output_names,
                    dynamic_axes={name: {0: "batch"} for name in input_names},
                    training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                )
    finally:
        module.train(was_training)
    return path
