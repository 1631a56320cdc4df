"""CuPy and onnxruntime-gpu: importing them, checking the CUDA provider, dtype tables."""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime.errors import RunError

# onnxruntime's OrtValue.data_type() strings, for wrapping its outputs as CuPy arrays.
ORT_DTYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_,
    # NumPy and CuPy have no bfloat16: an array of its raw bits, bound by the ONNX type (session.py).
    "tensor(bfloat16)": np.uint16,
}


def gpu_count() -> int:
    """CUDA devices visible to this process; 0 without CuPy or a driver (CI)."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # ImportError, or CUDARuntimeError without a driver
        return 0


def cuda_available() -> bool:
    """GPUs, CuPy and an onnxruntime with the CUDA execution provider: what ``--backend auto`` needs."""
    if gpu_count() == 0:
        return False
    try:
        import onnxruntime
    except ImportError:
        return False
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def import_cupy():
    try:
        import cupy
    except ImportError:
        raise RunError("the nccl backend needs CuPy (pip install cupy-cuda13x, or the cupy build for your CUDA)") from None
    return cupy


def load_onnxruntime():
    """onnxruntime with the CUDA EP usable: its CUDA/cuDNN libraries loaded from the nvidia-* wheels
    when they are installed there (onnxruntime.preload_dlls), else from the system's library path."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise RunError("the nccl backend needs onnxruntime-gpu (pip install onnxruntime-gpu)") from None
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise RunError(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider: install onnxruntime-gpu "
                       "instead of onnxruntime (never both; they provide the same module)")
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        try:
            preload()
        except Exception:  # nothing in the wheels: the session check below reports what is missing
            pass
    return ort


# cudaStreamCaptureModeRelaxed / CU_STREAM_CAPTURE_MODE_RELAXED: this thread's CUDA calls never
# invalidate a capture that another thread is making.
_CAPTURE_MODE_RELAXED = 2


def relax_capture_mode() -> bool:
    """Put the calling thread in relaxed stream-capture mode (cudaThreadExchangeStreamCaptureMode),
    so that its event queries do not invalidate a CUDA graph capture on another thread: the
    watchdog's ``cudaEventQuery`` during onnxruntime's (global-mode) capture otherwise fails it
    (PyTorch's NCCL watchdog does the same, pytorch/pytorch#148594). Best effort: False where no
    CUDA runtime library exposes the call."""
    import ctypes

    # The driver's call sets the same per-thread mode as the runtime's, and libcuda is always there
    # where a GPU is (CuPy links its CUDA runtime statically, so no libcudart may be loadable).
    for name, call in (("libcuda.so.1", "cuThreadExchangeStreamCaptureMode"),
                       ("libcudart.so.13", "cudaThreadExchangeStreamCaptureMode")):
        try:
            function = getattr(ctypes.CDLL(name), call)
        except (OSError, AttributeError):
            continue
        mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
        return function(ctypes.byref(mode)) == 0
    return False


_MODULES: dict[tuple[int, str], Any] = {}  # (device id, CUDA source) -> compiled RawModule


def compiled_module(cp, source: str):
    """``source`` compiled as a CuPy RawModule for the current device, once per process (the
    backend's hand-written kernels: fused updates, LayerNorm gradients, ReLU masks)."""
    key = (cp.cuda.Device().id, source)
    if key not in _MODULES:
        _MODULES[key] = cp.RawModule(code=source, options=("--std=c++14",))
    return _MODULES[key]
