"""The Python API on GPUs (docs/api.md): ``train(out, data, backend="nccl")`` starts one process per
GPU (``transpile run OUT --config FILE``), relays the per-step records to the callback as they are
logged, and trains what the CPU backend trains: every logged loss within test_gpu_cli.py's
tolerance (TF32 off), the same steps logged, and ``export=`` written. Marked ``gpu``; skipped
without a CUDA GPU, CuPy and onnxruntime-gpu."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from graph_transpiler import train, transpile
from runtime.gpu import cuda_available, gpu_count

GPUS = gpu_count() if cuda_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU with CuPy and onnxruntime-gpu")]

TOLERANCE = 1e-5
STEPS = 12


@pytest.mark.parametrize("world", sorted({1, max(1, min(GPUS, 2))}))
def test_train_on_gpus_equals_the_cpu_backend(world, tmp_path, model_dir):
    out = transpile(model_dir("perceptron") / "model.onnx", tmp_path / "out", gpus=world, optimizer="adamw",
                    lr=0.001, verbose=False)
    data = model_dir("perceptron") / "data.npz"
    runs = {}
    for backend in ("cpu", "nccl"):
        seen = []
        result = train(out, data, batch=32, steps=STEPS, log_every=3, backend=backend, no_tf32=True,
                       export=tmp_path / f"{backend}.onnx", callback=seen.append, verbose=False)
        assert result.records == seen and [r["step"] for r in seen] == [1, 3, 6, 9, 12]
        weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / f"{backend}.onnx")).graph.initializer}
        runs[backend] = ([r["loss"] for r in seen], weights)
    (cpu_losses, cpu_weights), (gpu_losses, gpu_weights) = runs["cpu"], runs["nccl"]
    assert np.allclose(gpu_losses, cpu_losses, rtol=TOLERANCE, atol=0)
    for name, expected in cpu_weights.items():
        scale = float(np.max(np.abs(expected))) or 1.0
        assert float(np.max(np.abs(gpu_weights[name] - expected))) / scale < TOLERANCE, name
