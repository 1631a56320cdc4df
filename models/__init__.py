"""Built-in example models: each writes ``model.onnx`` (forward + loss, opset 18, symbolic batch axis
"batch" on the data inputs) and ``data.npz`` (arrays keyed by the model's input names).

    model_path, data_path = models.generate("perceptron", "examples/perceptron", seed=0)
    python -m models perceptron -o examples/perceptron [--seed S] [--rows N]

The numpy-only models need numpy and onnx. ``cnn`` (ResNet-18 for 32x32 images), ``cnn_small``,
``gpt`` (a 4-layer transformer), ``gpt2_small`` (the GPT-2-small shape) and ``digits`` are PyTorch
modules exported with torch.onnx: they need torch (the test extra), imported only when one of them
is generated; ``python -m models.cnn`` / ``models.gpt`` / ``models.digits`` take size options.
``models.torch_twins`` (tests only) adds the PyTorch versions of the numpy-only models.
"""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path

import numpy as np
import onnx

from models import linear_regression, perceptron
from models._common import ModelSpec

__all__ = ["MODELS", "ModelSpec", "TorchMissingError", "UnknownModelError", "generate"]


class TorchMissingError(ValueError):
    """A torch-defined model was asked for and PyTorch is not installed (one-line message)."""


def _torch_module(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name == "torch" or "needs PyTorch" in str(exc):
            raise TorchMissingError(
                f"{module} needs PyTorch (pip install torch, or the project's [test] extra)"
            ) from None
        raise


def _torch_spec(module: str, config: str, summary: str, default_rows: int) -> ModelSpec:
    """A spec whose generator module (and torch) is imported only when the model is generated."""

    def build(seed: int) -> onnx.ModelProto:
        # Each torch model module offers make_module(config, seed) and export(module, path).
        mod = _torch_module(module)
        with tempfile.TemporaryDirectory() as tmp:
            path = mod.export(mod.make_module(getattr(mod, config), seed), Path(tmp) / "model.onnx")
            return onnx.load(str(path))

    def make_data(seed: int, rows: int) -> dict[str, np.ndarray]:
        mod = _torch_module(module)
        return mod.make_data(getattr(mod, config), seed, rows)

    return ModelSpec(summary=summary, build=build, make_data=make_data, default_rows=default_rows)


MODELS: dict[str, ModelSpec] = {
    "linear_regression": linear_regression.SPEC,
    "perceptron": perceptron.SPEC,
    "cnn": _torch_spec("models.cnn", "CIFAR_RESNET18",
                       "ResNet-18 for 32x32 images (width 64, [2,2,2,2], BatchNorm, 10 classes), cross-entropy; "
                       "random images (needs torch)", 1024),
    "cnn_small": _torch_spec("models.cnn", "SMALL",
                             "ResNet, width 8, stages [1,1], 16x16 images, cross-entropy (needs torch)", 256),
    "gpt": _torch_spec("models.gpt", "DEFAULT",
                       "decoder-only transformer, 4 layers x 256, 4 heads, vocab 4096, seq 128, "
                       "next-token cross-entropy; random tokens (needs torch)", 256),
    "gpt2_small": _torch_spec("models.gpt", "GPT2_SMALL",
                              "GPT-2-small shape: 12 layers x 768, 12 heads, vocab 50304, seq 512, "
                              "163M parameters, 650 MB (needs torch)", 64),
    "digits": _torch_spec("models.digits", "CONFIG",
                          "small CNN (Conv-BN-ReLU-MaxPool x2, Linear) on scikit-learn's 8x8 digits "
                          "(training split; needs torch and scikit-learn)", 1437),
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
