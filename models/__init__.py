"""Built-in example models: each writes ``model.onnx`` (forward + loss, opset 18, symbolic batch axis
"batch" on the data inputs) and ``data.npz`` (arrays keyed by the model's input names).

    model_path, data_path = models.generate("perceptron", "examples/perceptron", seed=0)
    python -m models perceptron -o examples/perceptron [--seed S] [--rows N]

Only numpy and onnx are needed; ``models.torch_twins`` (tests only) adds the PyTorch versions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from models import linear_regression, perceptron
from models._common import ModelSpec

__all__ = ["MODELS", "ModelSpec", "UnknownModelError", "generate"]

MODELS: dict[str, ModelSpec] = {
    "linear_regression": linear_regression.SPEC,
    "perceptron": perceptron.SPEC,
}


class UnknownModelError(ValueError):
    """A model name that is not in MODELS; the message lists the available ones, on one line."""

    def __init__(self, name: str):
        super().__init__(f"unknown model {name!r} (available: {', '.join(sorted(MODELS))})")


def generate(name: str, out_dir: str | Path, *, seed: int = 0, rows: int | None = None) -> tuple[Path, Path]:
    """Write ``out_dir/model.onnx`` and ``out_dir/data.npz`` for model ``name``; return both paths.

    The same ``seed`` gives the same parameters and data, byte for byte. ``rows`` (default: the
    model's) only changes the data: parameters come from their own random stream.
    """
    if name not in MODELS:
        raise UnknownModelError(name)
    spec = MODELS[name]
    rows = spec.default_rows if rows is None else rows
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive integer, got {rows!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_path, data_path = out / "model.onnx", out / "data.npz"
    onnx.save_model(spec.build(seed), model_path)
    # Uncompressed: np.savez output is deterministic, so the same seed gives the same bytes.
    np.savez(data_path, **spec.make_data(seed, rows))
    return model_path, data_path
