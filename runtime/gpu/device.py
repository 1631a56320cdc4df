"""GpuDevice: the one GPU a rank drives, and what every part of the GPU backend shares on it: CuPy and
onnxruntime-gpu, the compute stream, the TF32 setting, the cuDNN context, device arrays.

The sessions (session.py), the native kernels (conv_grad.py, batchnorm.py, layernorm.py,
elementwise.py, update_kernel.py) and the program (program.py) take a GpuDevice, never the
backend: the backend composes them (backend.py), so nothing below it imports it.
"""

from __future__ import annotations

import numpy as np

from runtime.gpu.cuda import ORT_DTYPES, import_cupy, load_onnxruntime
from runtime.gpu.cudnn import CudnnContext


class GpuDevice:
    """CUDA device ``device_id``, made current. ``tf32``: fp32 MatMul/Conv may use TF32 (off for the
    equality tests)."""

    provider = "CUDAExecutionProvider"  # the execution provider whose memory its arrays are in

    def __init__(self, device_id: int = 0, *, tf32: bool = False):
        self.cp = cp = import_cupy()
        self.ort = load_onnxruntime()
        self.device_id = device_id
        self.tf32 = tf32
        cp.cuda.Device(device_id).use()
        # Every session runs on this stream (user_compute_stream) and every kernel of ours too.
        # Blocking: onnxruntime's CUDA EP copies on the legacy default stream by default
        # (do_copy_in_default_stream) and relies on that stream's implicit order with this one.
        self.compute = cp.cuda.Stream(non_blocking=False)
        self.compute.use()  # CuPy's own work (copies, the loss ring) joins the compute stream
        self._cudnn: CudnnContext | None = None

    def cudnn(self) -> CudnnContext:
        """The cuDNN handle and workspace every cuDNN call (the Conv gradients) shares, made on first use."""
        if self._cudnn is None:
            self._cudnn = CudnnContext(self.cp, self.compute)
        return self._cudnn

    @property
    def cudnn_workspace_bytes(self) -> int:
        """The shared cuDNN workspace's size (0 before any cuDNN runner ran): memory reports."""
        return self._cudnn.workspace_bytes if self._cudnn is not None else 0

    def synchronize(self) -> None:
        self.cp.cuda.Device().synchronize()

    def wrap(self, ortvalue):
        """A CuPy view of an onnxruntime output on this device; keeps the OrtValue alive."""
        return self.device_array(ortvalue.data_ptr(), tuple(ortvalue.shape()), ORT_DTYPES[ortvalue.data_type()], ortvalue)

    def device_array(self, ptr: int, shape: tuple, dtype, owner=None):
        """A CuPy view of ``shape`` elements of ``dtype`` at device pointer ``ptr`` on this device,
        which ``owner`` (if any) keeps allocated as long as the view lives."""
        cp = self.cp
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return cp.empty(shape, dtype)
        memory = cp.cuda.UnownedMemory(ptr, nbytes, owner, self.device_id)
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, 0))

    def from_host(self, array):
        return self.cp.asarray(array)
