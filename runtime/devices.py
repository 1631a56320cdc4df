"""Which backend a run uses, and the GPUs it needs: shared by the launching process and each rank."""

from __future__ import annotations

import os

from runtime.errors import RunError

BACKENDS = ("auto", "cpu", "nccl")


def resolve_backend(name: str) -> str:
    """``auto`` becomes ``nccl`` where GPUs, CuPy and onnxruntime-gpu are all present, else ``cpu``."""
    if name != "auto":
        return name
    from runtime.gpu.cuda import cuda_available

    return "nccl" if cuda_available() else "cpu"


def check_gpus(needed: int, what: str) -> None:
    """One GPU per rank: ``needed`` ranks on this host need that many GPUs here."""
    from runtime.gpu.cuda import gpu_count

    have = gpu_count()
    if needed > have:
        raise RunError(f"{what} needs {needed} GPU(s), one per rank, but this machine has {have}"
                       + (" (no CUDA device, or CuPy is not installed)" if have == 0 else "")
                       + "; transpile with --gpus <= the GPUs present, or use --backend cpu")


def pick_gpu(local_rank: int, local_size: int | None) -> int:
    """The CUDA device of the rank with this local rank (its index among the ranks of its host).

    Where the launcher hands each rank one GPU (Slurm's --gpus-per-task, a CUDA_VISIBLE_DEVICES per
    rank), that GPU is device 0 whatever the local rank; otherwise local rank r drives device r.
    """
    from runtime.gpu.cuda import gpu_count

    have = gpu_count()
    # One visible GPU per rank: a launcher narrowed CUDA_VISIBLE_DEVICES for it. Without that, one
    # GPU shared by several local ranks is the machine's only GPU: the check below names it.
    if have == 1 and (os.environ.get("CUDA_VISIBLE_DEVICES") or (local_size or 1) <= 1):
        return 0
    check_gpus(max(local_rank + 1, local_size or 0), f"{local_size or 'the'} rank(s) on this host")
    return local_rank
