"""``--grad-dtype bf16`` on GPUs: the gradient collectives send bfloat16 buckets through NCCL
(runtime/gpu/nccl_types.py), under every strategy, and training follows the CPU backend's run of
the same plan (whose MPI collectives round as NCCL's do on two ranks: one rounding of the float32
sum).

Marked ``gpu``; skipped without two CUDA GPUs, CuPy and onnxruntime-gpu. Each plan trains STEPS
steps in one ``mpiexec -n 2`` of benchmarks/gpu_diag.py on the GPUs and one on CPU ranks. A bf16
network computes differently on the two backends (cuBLAS against onnxruntime's CPU kernels with
their rounding emulated), so the bound is relative: the bf16 wire may take the GPU run no further
from the CPU run than the fp32 wire does, with a margin (ERROR_MARGIN) for the rounding of a bf16
sum that lands on another side; a wrong NCCL type or a missing mean is off by orders of magnitude.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from commands.main import main

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

STEPS = 10
ERROR_MARGIN = 4.0
WORLD = 2


def _gpus() -> int:
    from runtime.gpu import cuda_available, gpu_count

    return gpu_count() if cuda_available() else 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpus() < WORLD, reason=f"needs {WORLD} CUDA GPUs with CuPy and onnxruntime-gpu")]


def _train(outs: list[Path], backend: str, data: Path, saved: Path) -> None:
    from runtime.launcher import child_environment, find_mpiexec, mpiexec_command, mpiexec_flavor

    mpiexec = find_mpiexec()
    command = mpiexec_command(mpiexec, mpiexec_flavor(mpiexec), WORLD, [])
    command = command[:command.index("-m")] + [str(REPO / "benchmarks" / "gpu_diag.py"), "--backend", backend,
                                               "--data", str(data), "--batch", "16", "--steps", str(STEPS),
                                               "--save", str(saved), *map(str, outs)]
    done = subprocess.run(command, env=child_environment(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _params(saved: Path, out: Path) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(saved / f"{out.name}.rank{r}.npz")) for r in range(WORLD)]


def _error(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) / (float(np.max(np.abs(b[k]))) or 1.0)
               for k in b)


@pytest.mark.parametrize("strategy", ["allreduce", "sharded", "zero"])
def test_bf16_gradients_on_the_wire_train_as_on_cpu_ranks(strategy, tmp_path):
    import gpu_gpt

    src = tmp_path / "gpt"
    src.mkdir()
    onnx.save(gpu_gpt.build(**gpu_gpt.TINY), src / "model.onnx")
    np.savez(src / "data.npz", **gpu_gpt.make_data(gpu_gpt.TINY["vocab"], gpu_gpt.TINY["seq"], 64))
    outs = {}
    for wire in ("fp32", "bf16"):
        outs[wire] = tmp_path / f"{strategy}-{wire}"
        assert main(["compile", str(src / "model.onnx"), "--gpus", str(WORLD), "--strategy", strategy,
                     "--precision", "bf16", "--grad-dtype", wire, "--optimizer", "momentum", "--lr", "0.01",
                     "--bucket-mb", "0.05", "-o", str(outs[wire])]) == 0
    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    gpu.mkdir()
    cpu.mkdir()
    _train(list(outs.values()), "nccl", src / "data.npz", gpu)
    _train(list(outs.values()), "cpu", src / "data.npz", cpu)
    errors = {}
    for wire, out in outs.items():
        ranks = _params(gpu, out)
        for r, params in enumerate(ranks[1:], start=1):  # the replicas stay bit-identical
            for name, value in ranks[0].items():
                np.testing.assert_array_equal(params[name], value, err_msg=f"{out.name} rank {r} {name}")
        assert all(np.isfinite(v).all() for v in ranks[0].values()), out.name
        errors[wire] = _error(ranks[0], _params(cpu, out)[0])
    print(f"{strategy}: GPU against CPU ranks after {STEPS} steps: fp32 wire {errors['fp32']:.3g}, "
          f"bf16 wire {errors['bf16']:.3g}")
    assert errors["bf16"] <= ERROR_MARGIN * max(errors["fp32"], 1e-4), errors
