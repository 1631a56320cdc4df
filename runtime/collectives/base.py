"""The Communicator interface: how a rank talks to the others, whatever moves the bytes.

A backend (MPI on CPU now, NCCL on GPU later, threads in tests) implements these few calls. The
collective node executors (allreduce.py, reduce.py, broadcast.py) only ever call them, so a new
backend needs no change to the executors.

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
    def barrier(self) -> None:
        """Return once every rank has called it."""

    @abstractmethod
    def allreduce_scalar(self, value: float, reduction: str = "mean") -> float:
        """Reduce one Python float across ranks (for logging the loss), in float64."""

    @abstractmethod
    def abort(self, code: int) -> None:
        """Tear down every rank, so peers blocked in a collective do not hang after this rank fails."""
