"""The Communicator interface: how a rank talks to the others, whatever moves the bytes.

A backend (MPI on CPU, NCCL on GPU, threads in tests) implements these few calls. The collective
node executors (allreduce.py, reduce.py, broadcast.py, reducescatter.py, allgather.py) only ever
call them, so a new backend needs no change to the executors.

Invariants every caller keeps, because a violation is a hang rather than an error on a real
backend: every rank makes the same calls in the same order, with the same root, and with buckets of
the same element counts and dtypes. A bucket (a list of arrays) moves in one call; how it is packed
(one flat buffer per dtype on MPI, a persistent device buffer on NCCL) is the backend's business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runtime.errors import RunError

REDUCTIONS = ("sum", "mean")


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a receiving buffer, from the graph's static value type."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def flat_size(sizes: Sequence[int], world: int) -> tuple[int, int]:
    """``(T, S)`` of a ReduceScatter/AllGather bucket (docs/contracts.md): ``T`` elements in all,
    zero-padded to ``world * S`` with ``S = ceil(T / world)``; rank r owns ``[r*S, (r+1)*S)``."""
    total = int(sum(sizes))
    return total, -(-total // world)


def pack_padded(arrays: Sequence[np.ndarray], world: int) -> np.ndarray:
    """The bucket flattened, concatenated and zero-padded to ``world * S`` (one dtype per bucket)."""
    dtypes = {np.dtype(a.dtype) for a in arrays}
    if len(dtypes) != 1:
        raise RunError(f"a ReduceScatter bucket must hold one dtype, got {', '.join(sorted(map(str, dtypes)))}")
    total, shard = flat_size([a.size for a in arrays], world)
    flat = np.zeros(world * shard, dtype=dtypes.pop())
    offset = 0
    for a in arrays:
        flat[offset:offset + a.size] = np.asarray(a).ravel()
        offset += a.size
    return flat


def flat_views(flat, shapes: Sequence[Sequence[int]], align: int = 1) -> list:
    """Views of a flat buffer (NumPy or CuPy) with the given shapes, in order, each starting at a
    multiple of ``align`` elements (1: back to back): a bucket's tensors."""
    out = []
    for offset, shape in zip(aligned_offsets(shapes, align), shapes):
        n = int(np.prod(shape, dtype=np.int64))
        out.append(flat[offset:offset + n].reshape(shape))
    return out


def aligned_offsets(shapes: Sequence[Sequence[int]], align: int = 1) -> list[int]:
    """Start of each view of ``flat_views``; one more entry at the end: the elements they span."""
    offsets, offset = [], 0
    for shape in shapes:
        offset = -(-offset // align) * align
        offsets.append(offset)
        offset += int(np.prod(shape, dtype=np.int64))
    return offsets + [offset]


def unpack_gathered(flat: np.ndarray, specs: Sequence[TensorSpec]) -> list[np.ndarray]:
    """AllGather's outputs: the first T elements of the gathered vector, split and reshaped."""
    return [v.astype(s.dtype, copy=False) for v, s in zip(flat_views(flat, [s.shape for s in specs]), specs)]


def check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise RunError(f"unknown reduction {reduction!r}, expected one of {', '.join(REDUCTIONS)}")


def finish_mean(total: np.ndarray, size: int) -> np.ndarray:
    """``mean = sum / size`` in the tensor's own dtype, in place, the same way on every backend.

    Dividing the sum (rather than pre-scaling each contribution) is what the contract defines and
    what makes N ranks match one device's mean loss over the full batch.
    """
    if not np.issubdtype(total.dtype, np.floating):
        raise RunError(f"reduction 'mean' needs a floating dtype, got {total.dtype}")
    total /= total.dtype.type(size)
    return total


class Communicator(ABC):
    """One rank's view of the group of ``size`` ranks."""

    rank: int
    size: int
    # The collective this rank is in right now (set by the program around each call), so that a
    # watchdog's timeout message can name it (runtime/guard.py); None between collectives.
    current: str | None = None

    @abstractmethod
    def allreduce(self, arrays: Sequence[np.ndarray], reduction: str) -> list[np.ndarray]:
        """Every rank receives the element-wise reduction of every rank's bucket."""

    @abstractmethod
    def reduce(self, arrays: Sequence[np.ndarray], root: int, reduction: str) -> list[np.ndarray] | None:
        """``root`` receives the reduction of every rank's bucket; other ranks receive None."""

    @abstractmethod
    def broadcast(self, arrays: Sequence[np.ndarray] | None, root: int, specs: Sequence[TensorSpec]) -> list[np.ndarray]:
        """Every rank receives ``root``'s bucket; non-roots pass None and allocate from ``specs``."""

    @abstractmethod
    def reduce_scatter(self, arrays: Sequence[np.ndarray], reduction: str) -> np.ndarray:
        """This rank's slice ``[r*S, (r+1)*S)`` of the reduced, flattened, zero-padded bucket."""

    @abstractmethod
    def all_gather(self, array: np.ndarray, specs: Sequence[TensorSpec]) -> list[np.ndarray]:
        """Every rank's 1-D slice concatenated in rank order, cut into tensors shaped as ``specs``."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it."""

    @abstractmethod
    def allreduce_scalars(self, values: Sequence[float], reduction: str = "mean") -> list[float]:
        """Reduce Python floats across ranks elementwise, in float64, in one call (the losses held
        since the last log line)."""

    def allreduce_scalar(self, value: float, reduction: str = "mean") -> float:
        return self.allreduce_scalars([value], reduction)[0]

    @abstractmethod
    def abort(self, code: int) -> None:
        """Tear down every rank, so peers blocked in a collective do not hang after this rank fails."""

    def before_destroy(self, release) -> None:
        """Call ``release`` (a bound method) before ``close`` destroys this communicator's resources:
        what captured its calls in CUDA graphs must go first (NcclCommunicator). Others hold none."""
        return None  # nothing captures their calls

    def close(self) -> None:
        """Destroy what the communicator holds, after the rank's last collective (default: nothing)."""
        return None

    # -- flat-buffer collectives ----------------------------------------------------------------
    # In place on one persistent flat buffer per collective (``CollectiveOp.flat_layout``), enqueued
    # rather than completed: what a device program runs every step (runtime/gpu/program.py). Always
    # a sum; ``finish_mean`` divides afterwards, in the same order. A communicator with flat
    # buffers (NcclCommunicator) overrides all six; the others raise.

    def all_reduce_flat(self, buf, label: str) -> None:
        """Every rank's ``buf`` becomes the sum over ranks."""
        raise self._no_flat("all_reduce_flat", label)

    def reduce_flat(self, buf, root: int, label: str) -> None:
        """``root``'s ``buf`` becomes the sum over ranks; the others' are only read."""
        raise self._no_flat("reduce_flat", label)

    def broadcast_flat(self, buf, root: int, label: str) -> None:
        """Every rank's ``buf`` becomes ``root``'s."""
        raise self._no_flat("broadcast_flat", label)

    def reduce_scatter_flat(self, buf, label: str) -> None:
        """``buf`` holds N*S elements; rank r's slice ``[r*S, (r+1)*S)`` becomes the sum over ranks of it."""
        raise self._no_flat("reduce_scatter_flat", label)

    def all_gather_flat(self, buf, label: str) -> None:
        """Rank r contributes ``buf[r*S:(r+1)*S]``; every rank ends with all N*S elements."""
        raise self._no_flat("all_gather_flat", label)

    def finish_mean(self, view) -> None:
        """``view /= size`` in its dtype, ordered after the flat call that summed it."""
        raise self._no_flat("finish_mean", "reduction 'mean'")

    def _no_flat(self, method: str, label: str) -> RunError:
        return RunError(f"{type(self).__name__} has no flat-buffer collectives ({method} for {label}): they run "
                        "on a device communicator (NcclCommunicator, --backend nccl); this one takes the list "
                        "calls (allreduce, reduce, ...) through CollectiveOp.run")
