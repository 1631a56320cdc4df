"""In-process communicator: N ranks as threads of one process, reductions in NumPy.

Used by ``runtime.simulate`` and the tests to check N ranks == 1 device without starting processes.

How a call works: each rank drops its contribution into its slot and waits on a barrier; the
barrier's action (run by exactly one thread, after all have arrived) checks that every rank issued
the same collective and computes the result once, summing in rank order; each rank then takes its
own copy and waits on a second barrier, so no rank can overwrite a slot that another still reads.
Computing once and copying means every rank receives bit-identical values, as MPI and NCCL promise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

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


class LocalGroup:
    """The shared state of ``size`` in-process ranks; ``communicator(r)`` is rank r's handle."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"group size must be >= 1, got {size}")
        self.size = size
        self._slots: list[tuple | None] = [None] * size
        self._combine: Callable[[list], object] | None = None
        self._result: object = None
        self._arrive = threading.Barrier(size, action=self._run_combine)
        self._leave = threading.Barrier(size)

    def communicator(self, rank: int) -> LocalCommunicator:
        return LocalCommunicator(self, rank)

    def abort(self) -> None:
        """Break both barriers: every rank waiting or arriving later raises BrokenBarrierError."""
        self._arrive.abort()
        self._leave.abort()

    def exchange(self, rank: int, signature: tuple, payload: object, combine: Callable[[list], object]) -> object:
        """Run one collective; ``combine`` maps the list of payloads (rank order) to the shared result."""
        self._slots[rank] = (signature, payload)
        # Every rank stores the same combine function for the same collective; the last store wins.
        self._combine = combine
        self._arrive.wait()
        result = self._result
        self._leave.wait()
        return result

    def _run_combine(self) -> None:
        signatures = [slot[0] for slot in self._slots]
        for r, sig in enumerate(signatures):
            if sig != signatures[0]:
                raise RunError(f"collective mismatch: rank 0 issued {signatures[0]}, rank {r} issued {sig} "
                               "(on MPI or NCCL this would hang)")
        self._result = self._combine([slot[1] for slot in self._slots])


def _bucket_signature(arrays: Sequence[np.ndarray]) -> tuple:
    # What every rank must agree on (docs/contracts.md): element counts and dtypes, in order.
    return tuple((int(a.size), str(a.dtype)) for a in arrays)


def _reduce_buckets(buckets: list[Sequence[np.ndarray]], reduction: str, size: int) -> list[np.ndarray]:
    results = []
    for i in range(len(buckets[0])):
        total = np.array(buckets[0][i], copy=True)
        for bucket in buckets[1:]:
            total += bucket[i].reshape(total.shape)  # rank order: the same sum on every call
        results.append(finish_mean(total, size) if reduction == "mean" else total)
    return results


class LocalCommunicator(Communicator):
    def __init__(self, group: LocalGroup, rank: int):
        self.group = group
        self.rank = rank
        self.size = group.size

    def allreduce(self, arrays, reduction):
        check_reduction(reduction)
        result = self.group.exchange(self.rank, ("AllReduce", reduction, _bucket_signature(arrays)), list(arrays),
                                     lambda buckets: _reduce_buckets(buckets, reduction, self.size))
        return [a.copy() for a in result]

    def reduce(self, arrays, root, reduction):
        check_reduction(reduction)
        result = self.group.exchange(self.rank, ("Reduce", root, reduction, _bucket_signature(arrays)), list(arrays),
                                     lambda buckets: _reduce_buckets(buckets, reduction, self.size))
        return [a.copy() for a in result] if self.rank == root else None

    def broadcast(self, arrays, root, specs: Sequence[TensorSpec]):
        signature = ("Broadcast", root, tuple((s.size, str(np.dtype(s.dtype))) for s in specs))
        if self.rank == root:
            if arrays is None:
                raise RunError(f"rank {self.rank} is the root of a Broadcast but passed no arrays")
            signature = ("Broadcast", root, _bucket_signature(arrays))
        result = self.group.exchange(self.rank, signature, arrays, lambda payloads: payloads[root])
        return [np.array(a, copy=True).reshape(s.shape) for a, s in zip(result, specs)]

    def reduce_scatter(self, arrays, reduction):
        check_reduction(reduction)
        flat = pack_padded(arrays, self.size)
        result = self.group.exchange(self.rank, ("ReduceScatter", reduction, _bucket_signature(arrays)), [flat],
                                     lambda buckets: _reduce_buckets(buckets, reduction, self.size)[0])
        shard = flat.size // self.size
        return result[self.rank * shard:(self.rank + 1) * shard].copy()

    def all_gather(self, array, specs: Sequence[TensorSpec]):
        flat = np.ascontiguousarray(array).ravel()
        result = self.group.exchange(self.rank, ("AllGather", _bucket_signature([flat])), flat,
                                     lambda slices: np.concatenate(slices))
        return [a.copy() for a in unpack_gathered(result, specs)]

    def barrier(self):
        self.group.exchange(self.rank, ("Barrier",), None, lambda payloads: None)

    def allreduce_scalars(self, values, reduction="mean"):
        check_reduction(reduction)
        totals = self.group.exchange(self.rank, ("AllReduceScalars", reduction, len(values)),
                                     [float(v) for v in values],
                                     lambda per_rank: np.sum(np.array(per_rank, dtype=np.float64), axis=0))
        return [float(t) / self.size if reduction == "mean" else float(t) for t in totals]

    def abort(self, code):
        self.group.abort()
