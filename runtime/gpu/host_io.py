"""The host side of a GPU step: each step's data into fixed device buffers, and the losses kept on
the device until the trainer reads them (one transfer per log line, not per step)."""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime.gpu.device import GpuDevice

LOSS_RING = 4096  # device slots for losses not yet read; Trainer flushes long before it wraps


class HostIO:
    def __init__(self, device: GpuDevice):
        self.device = device
        self._staging: dict[str, tuple[Any, np.ndarray, Any]] = {}
        self._ring = device.cp.zeros(LOSS_RING, dtype=np.float64)
        self._ring_next = 0

    def feed(self, name: str, array: np.ndarray):
        """``array`` in this input's persistent device buffer: an async copy from pinned memory on
        the compute stream, so the bound pointer never changes and the host never waits for it,
        except to reuse the pinned buffer while the GPU is a whole step behind."""
        cp, compute = self.device.cp, self.device.compute
        array = np.ascontiguousarray(array)
        staged = self._staging.get(name)
        if staged is None or staged[1].shape != array.shape or staged[1].dtype != array.dtype:
            memory = cp.cuda.alloc_pinned_memory(max(array.nbytes, 1))
            host = np.frombuffer(memory, array.dtype, array.size).reshape(array.shape)
            staged = (cp.empty(array.shape, array.dtype), host, None)
        device, host, copied = staged
        if copied is not None:
            copied.synchronize()
        host[...] = array
        device.set(host, stream=compute)
        self._staging[name] = (device, host, compute.record())
        return device

    def to_host(self, value):
        if isinstance(value, np.ndarray):
            return value
        return self.device.cp.asnumpy(value, stream=self.device.compute)

    def hold_scalar(self, value):
        slot = self._ring_next % LOSS_RING
        self._ring_next += 1
        self._ring[slot:slot + 1] = value.reshape(1)
        return slot

    def scalars_to_host(self, held: list) -> list[float]:
        if not held:
            return []
        host = self.device.cp.asnumpy(self._ring, stream=self.device.compute)  # one transfer, at log time only
        return [float(host[slot]) for slot in held]
