"""Built-in example models: valid ONNX, documented data, reproducible, and equal to their torch twins.

Tolerance: the onnxruntime loss equals the torch twin's loss within rtol 1e-5 (float32, different
summation orders in Gemm and ReduceMean).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

import models
from models.torch_twins import load_onnx_parameters, twin_for

REPO = Path(__file__).resolve().parents[1]

# name -> (data input shapes without the batch axis, initializer shapes, default rows)
EXPECTED = {
    "linear_regression": ({"x": [1], "y": [1]}, {"m": [1], "n": [1]}, 1024),
    "perceptron": (
        {"X": [10], "Y": [1]},
        {"fc1.weight": [100, 10], "fc1.bias": [100], "fc2.weight": [1, 100], "fc2.bias": [1]},
        2048,
    ),
}


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as npz:
        return {key: npz[key] for key in npz.files}


def onnx_loss(model_path: Path, data: dict[str, np.ndarray]) -> float:
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    (loss,) = session.run(["loss"], data)
    assert loss.shape == () and loss.dtype == np.float32
    return float(loss)


def torch_loss(name: str, model_path: Path, data: dict[str, np.ndarray]) -> float:
    twin = twin_for(name, model_path)
    with torch.no_grad():
        loss = twin(*(torch.from_numpy(array) for array in data.values()))
    assert loss.dtype == torch.float32
    return float(loss)


# Models exported from PyTorch modules (tests/test_models_real.py covers them).
TORCH_MODELS = {"cnn", "cnn_small", "gpt", "gpt2_small", "digits"}


def test_registry_lists_the_builtin_models():
    assert sorted(models.MODELS) == sorted(set(EXPECTED) | TORCH_MODELS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_model_is_valid_onnx_with_symbolic_batch(name, tmp_path):
    model_path, data_path = models.generate(name, tmp_path)
    assert (model_path, data_path) == (tmp_path / "model.onnx", tmp_path / "data.npz")
    onnx.checker.check_model(str(model_path), full_check=True)
    model = onnx.load(str(model_path))
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 18)]

    inputs, initializers, _ = EXPECTED[name]
    graph = model.graph
    assert [i.name for i in graph.input] == list(inputs)
    for value in graph.input:
        dims = value.type.tensor_type.shape.dim
        assert value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        assert dims[0].dim_param == "batch"
        assert [d.dim_value for d in dims[1:]] == inputs[value.name]
    assert {i.name: list(i.dims) for i in graph.initializer} == initializers
    assert all(i.data_type == onnx.TensorProto.FLOAT for i in graph.initializer)
    assert [o.name for o in graph.output] == ["loss"]
    assert len(graph.output[0].type.tensor_type.shape.dim) == 0


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_data_has_documented_shapes_and_dtypes(name, tmp_path):
    inputs, _, default_rows = EXPECTED[name]
    _, data_path = models.generate(name, tmp_path)
    data = load_npz(data_path)
    assert list(data) == list(inputs)
    for key, array in data.items():
        assert array.dtype == np.float32 and list(array.shape) == [default_rows, *inputs[key]]
    _, data_path = models.generate(name, tmp_path / "small", rows=37)
    assert all(array.shape[0] == 37 for array in load_npz(data_path).values())


def test_data_follows_the_documented_distributions(tmp_path):
    linear = load_npz(models.generate("linear_regression", tmp_path / "l")[1])
    assert np.all(np.abs(linear["x"]) <= 1.0)
    residual = linear["y"] - (3.0 * linear["x"] + 2.0)
    assert np.std(residual) < 0.02 and abs(np.mean(residual)) < 0.005

    perceptron = load_npz(models.generate("perceptron", tmp_path / "p")[1])
    assert np.all((perceptron["X"] >= 1.0) & (perceptron["X"] <= 2.0))
    noise = perceptron["Y"] - np.sum(perceptron["X"].astype(np.float64) ** 3, axis=1, keepdims=True)
    assert np.all(np.abs(noise) <= 1.0 + 1e-4)  # sin(2*pi*U), up to float32 rounding of Y


def test_perceptron_parameters_follow_torch_linear_init(tmp_path):
    model = onnx.load(str(models.generate("perceptron", tmp_path)[0]))
    params = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for layer, fan_in in (("fc1", 10), ("fc2", 100)):
        bound = 1.0 / np.sqrt(fan_in)
        for kind in ("weight", "bias"):
            values = params[f"{layer}.{kind}"]
            assert np.all(np.abs(values) <= bound)
        # 1000 draws of U(-b, b) for fc1.weight spread over most of the interval.
        if layer == "fc1":
            assert np.max(np.abs(params["fc1.weight"])) > 0.95 * bound


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_generation_is_reproducible_from_the_seed(name, tmp_path):
    first = models.generate(name, tmp_path / "a", seed=7)
    again = models.generate(name, tmp_path / "b", seed=7)
    other = models.generate(name, tmp_path / "c", seed=8)
    for path_a, path_b in zip(first, again):
        assert path_a.read_bytes() == path_b.read_bytes()
    for path_a, path_c in zip(first, other):
        assert path_a.read_bytes() != path_c.read_bytes()
    # More rows extend the data set without touching the parameters.
    more = models.generate(name, tmp_path / "d", seed=7, rows=3000)
    assert more[0].read_bytes() == first[0].read_bytes()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_onnx_loss_equals_torch_twin_loss(name, tmp_path):
    model_path, data_path = models.generate(name, tmp_path)
    data = load_npz(data_path)
    for rows in (len(next(iter(data.values()))), 5):  # the full data set, and another batch size
        batch = {key: array[:rows] for key, array in data.items()}
        ours, theirs = onnx_loss(model_path, batch), torch_loss(name, model_path, batch)
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, err_msg=f"{name}, {rows} rows")


def test_twin_loader_rejects_a_model_missing_a_parameter(tmp_path):
    model_path, _ = models.generate("linear_regression", tmp_path)
    with pytest.raises(KeyError, match="fc1.weight"):
        load_onnx_parameters(
            twin_for("perceptron", models.generate("perceptron", tmp_path / "p")[0]), model_path
        )


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "models", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_cli_writes_both_files_and_prints_their_paths(tmp_path):
    result = run_cli("perceptron", "-o", str(tmp_path / "out"), "--seed", "3", "--rows", "64")
    assert result.returncode == 0, result.stderr
    printed = [Path(line) for line in result.stdout.splitlines()]
    assert printed == [tmp_path / "out" / "model.onnx", tmp_path / "out" / "data.npz"]
    assert load_npz(printed[1])["X"].shape == (64, 10)


def test_cli_unknown_name_is_a_one_line_error(tmp_path):
    result = run_cli("resnet", "-o", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "unknown model 'resnet'" in result.stderr and "linear_regression, perceptron" in result.stderr


def test_models_package_does_not_need_torch(tmp_path):
    script = (
        "import sys, models; "
        f"models.generate('perceptron', {str(tmp_path)!r}, rows=8); "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr or "models imported torch"
