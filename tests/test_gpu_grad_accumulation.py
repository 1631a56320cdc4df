"""``transpile run --grad-accumulation K`` on the nccl backend: the trainer's accumulate program and
accumulated step program (runtime/accumulation.py) as two GpuPrograms, against the CPU backend and
against the same model transpiled with ``--grad-accumulation K``.

Marked ``gpu``; skipped without a CUDA GPU, CuPy and onnxruntime-gpu. Not yet run on a GPU (written
where none was available; the CPU path is tests/test_grad_accumulation_run.py). TF32 off: the
tolerance is test_gpu_cli.py's, 1e-5 of each parameter's scale. K = 2 captures the accumulate
program's sessions as CUDA graphs; K = 4 calls it 3 times a step, whose sessions the GPU backend
runs uncaptured (GpuBackend.make_program ``calls_per_step``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import child_env
from onnx import numpy_helper

from runtime.gpu import cuda_available, gpu_count
from runtime.metrics import read_metrics

GPUS = gpu_count() if cuda_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU with CuPy and onnxruntime-gpu")]

TOLERANCE = 1e-5
STEPS = 10


def _transpile(model: Path, out: Path, world: int, *extra: str) -> Path:
    done = subprocess.run([sys.executable, "-m", "commands", str(model), "-o", str(out), "--gpus", str(world),
                           "--strategy", "sharded", "--optimizer", "momentum", "--lr", "0.01", *extra],
                          capture_output=True, text=True, env=child_env())
    assert done.returncode == 0, done.stderr
    return out


def _train(out: Path, data: Path, batch: int, tag: str, tmp_path: Path, *extra: str) -> tuple[list[float], dict]:
    """``transpile run OUT``: the logged losses and the exported weights."""
    metrics, export = tmp_path / f"{tag}.jsonl", tmp_path / f"{tag}.onnx"
    done = subprocess.run([sys.executable, "-m", "commands", "run", str(out), "--data", str(data), "--batch", str(batch),
                           "--steps", str(STEPS), "--log-every", "1", "--export", str(export), "--metrics", str(metrics),
                           "--progress", "lines", *extra], capture_output=True, text=True, timeout=300, env=child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(export)).graph.initializer}
    return [r["loss"] for r in read_metrics(metrics)[0]], weights


def _close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for name, value in b.items():
        scale = float(np.max(np.abs(value))) or 1.0
        error = float(np.max(np.abs(a[name].astype(np.float64) - value))) / scale
        assert error < TOLERANCE, f"{what}: {name} differs by {error:.3g} of its scale"


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("model", ["perceptron", "cnn_small"])
def test_run_option_on_gpus_equals_the_cpu_backend_and_the_transpiled_option(model, k, model_dir, tmp_path):
    if model == "cnn_small":
        pytest.importorskip("torch")
    world = min(GPUS, 2)
    source = model_dir(model)
    data = source / "data.npz"
    batch = world * k * 4
    plain = _transpile(source / "model.onnx", tmp_path / "plain", world)
    transpiled = _transpile(source / "model.onnx", tmp_path / "k", world, "--grad-accumulation", str(k))
    gpu_losses, gpu = _train(plain, data, batch, "gpu", tmp_path, "--grad-accumulation", str(k), "--no-tf32",
                             "--backend", "nccl")
    cpu_losses, cpu = _train(plain, data, batch, "cpu", tmp_path, "--grad-accumulation", str(k), "--backend", "cpu")
    k_losses, k_gpu = _train(transpiled, data, batch, "gpu-k", tmp_path, "--no-tf32", "--backend", "nccl")
    _close(gpu, cpu, "GPU vs CPU ranks")
    _close(gpu, k_gpu, "the run option vs the transpiled option, on GPUs")
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=TOLERANCE)
    np.testing.assert_allclose(gpu_losses, k_losses, rtol=TOLERANCE)
