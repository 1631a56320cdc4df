"""GPU backend: onnxruntime CUDA EP segments on one compute stream, NCCL (CuPy) collectives on a
communication stream, ordered by CUDA events. docs/gpu.md describes it.

Nothing here is imported unless ``--backend nccl`` (or ``auto`` on a GPU machine) is chosen, so the
CPU runtime needs neither CuPy nor onnxruntime-gpu.
"""

from runtime.gpu.backend import GpuBackend
from runtime.gpu.cuda import cuda_available, gpu_count
from runtime.gpu.nccl import NcclCommunicator

__all__ = ["GpuBackend", "NcclCommunicator", "cuda_available", "gpu_count"]
