"""Shared fixtures: built-in models generated once per session, and comparison helpers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """``model_dir(name)`` -> directory holding the generated model.onnx and data.npz."""
    import models

    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            models.generate(name, out, seed=0, rows=256)
            cache[name] = out
        return cache[name]

    return get


def load_data(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as npz:
        return {k: npz[k] for k in npz.files}


def max_rel_error(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> float:
    """Largest over parameters of max|a - e| / max|e|: relative to each parameter's scale, so
    elements that happen to be near zero do not blow the measure up."""
    assert actual.keys() == expected.keys()
    worst = 0.0
    for name, e in expected.items():
        a = actual[name]
        assert a.shape == e.shape and a.dtype == e.dtype, name
        scale = float(np.max(np.abs(e))) or 1.0
        worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - e.astype(np.float64)))) / scale)
    return worst


def assert_replicas_identical(parameters: list[dict[str, np.ndarray]]) -> None:
    """Every rank's trained values equal rank 0's bit for bit (``SimResult.parameters``, one dict per rank)."""
    for r, values in enumerate(parameters[1:], start=1):
        assert values.keys() == parameters[0].keys(), f"rank {r}"
        for name, value in parameters[0].items():
            np.testing.assert_array_equal(values[name], value, err_msg=f"rank {r} {name}")


def initial_parameters(model_path: Path) -> dict[str, np.ndarray]:
    """The float initializers of an ONNX model, by name."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(model_path)
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return {k: v for k, v in arrays.items() if v.dtype.kind == "f"}
