"""MPI communicator (mpi4py), for the CPU backend: one process per rank.

A bucket is packed into one contiguous buffer per dtype so that ONE MPI call moves it (buckets from
the transpiler hold one dtype, so in practice one call per bucket); the results are views into the
received buffer, reshaped to each tensor's shape. ``mean`` is computed as the MPI sum divided by the
world size, exactly as the local communicator does, so both give the same bits for two ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from runtime.collectives.base import (
    Communicator,
    TensorSpec,
    check_reduction,
    finish_mean,
    pack_padded,
    unpack_gathered,
)
from runtime.errors import RunError


def _dtype_groups(dtypes: Sequence[np.dtype]) -> dict[np.dtype, list[int]]:
    """Positions of the bucket's tensors grouped by dtype, in first-seen order (same on every rank)."""
    groups: dict[np.dtype, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        groups.setdefault(np.dtype(dtype), []).append(i)
    return groups


def _pack(arrays: Sequence[np.ndarray], positions: list[int], dtype: np.dtype) -> np.ndarray:
    return np.concatenate([np.ascontiguousarray(arrays[i], dtype=dtype).ravel() for i in positions])


def _unpack(flat: np.ndarray, positions: list[int], shapes: Sequence[tuple[int, ...]], out: list) -> None:
    offset = 0
    for i in positions:
        n = int(np.prod(shapes[i], dtype=np.int64))
        out[i] = flat[offset:offset + n].reshape(shapes[i])
        offset += n


class MpiCommunicator(Communicator):
    def __init__(self, comm=None):
        from mpi4py import MPI  # imported here so that simulate() and the tests never need MPI

        self._mpi = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def allreduce(self, arrays, reduction):
        check_reduction(reduction)
        out: list = [None] * len(arrays)
        for dtype, positions in _dtype_groups([a.dtype for a in arrays]).items():
            flat = _pack(arrays, positions, dtype)
            self.comm.Allreduce(self._mpi.IN_PLACE, flat, op=self._mpi.SUM)
            if reduction == "mean":
                finish_mean(flat, self.size)
            _unpack(flat, positions, [a.shape for a in arrays], out)
        return out

    def reduce(self, arrays, root, reduction):
        check_reduction(reduction)
        is_root = self.rank == root
        out: list = [None] * len(arrays)
        for dtype, positions in _dtype_groups([a.dtype for a in arrays]).items():
            flat = _pack(arrays, positions, dtype)
            if is_root:
                self.comm.Reduce(self._mpi.IN_PLACE, flat, op=self._mpi.SUM, root=root)
                if reduction == "mean":
                    finish_mean(flat, self.size)
                _unpack(flat, positions, [a.shape for a in arrays], out)
            else:
                self.comm.Reduce(flat, None, op=self._mpi.SUM, root=root)
        return out if is_root else None

    def broadcast(self, arrays, root, specs: Sequence[TensorSpec]):
        is_root = self.rank == root
        if is_root and arrays is None:
            raise RunError(f"rank {self.rank} is the root of a Broadcast but passed no arrays")
        out: list = [None] * len(specs)
        for dtype, positions in _dtype_groups([s.dtype for s in specs]).items():
            if is_root:
                flat = _pack(arrays, positions, dtype)
            else:
                flat = np.empty(sum(specs[i].size for i in positions), dtype=dtype)
            self.comm.Bcast(flat, root=root)
            _unpack(flat, positions, [s.shape for s in specs], out)
        return out

    def reduce_scatter(self, arrays, reduction):
        check_reduction(reduction)
        flat = pack_padded(arrays, self.size)
        out = np.empty(flat.size // self.size, dtype=flat.dtype)
        self.comm.Reduce_scatter_block(flat, out, op=self._mpi.SUM)
        return finish_mean(out, self.size) if reduction == "mean" else out

    def all_gather(self, array, specs: Sequence[TensorSpec]):
        flat = np.ascontiguousarray(array).ravel()
        gathered = np.empty(flat.size * self.size, dtype=flat.dtype)
        self.comm.Allgather(flat, gathered)
        return unpack_gathered(gathered, specs)

    def barrier(self):
        self.comm.Barrier()

    def allreduce_scalars(self, values, reduction="mean"):
        check_reduction(reduction)
        buf = np.array(values, dtype=np.float64)
        self.comm.Allreduce(self._mpi.IN_PLACE, buf, op=self._mpi.SUM)
        return [float(t) / self.size if reduction == "mean" else float(t) for t in buf]

    def abort(self, code):
        # Flush first: MPI_Abort kills this process without running Python's exit handlers.
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(code)
