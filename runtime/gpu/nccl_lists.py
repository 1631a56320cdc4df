"""The list form of the Communicator interface (init graphs, the first step, tests) for a
communicator whose own collectives are flat-buffer calls enqueued on a communication stream
(NcclCommunicator): each list call packs its arrays into one buffer, runs the flat collective, and
returns views of the result.

Synchronous with respect to the current (compute) stream: the caller's values are ready before the
call, and the results are ready when it returns, in the compute stream's order and on the host
(first calls only, where onnxruntime's work may not be on that stream).

What a class using it provides: ``cp`` (CuPy), ``rank``, ``size``, ``stream`` (the communication
stream), the flat calls (``all_reduce_flat``, ``reduce_flat``, ``broadcast_flat``,
``reduce_scatter_flat``, ``all_gather_flat``, ``finish_mean``) and ``track`` (the watchdog's entry
for each call).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runtime.collectives.base import (
    TensorSpec,
    aligned_offsets,
    check_reduction,
    flat_size,
    flat_views,
    unpack_gathered,
)
from runtime.collectives.op import FLAT_ALIGN
from runtime.errors import RunError


class ListsOverFlat:
    _sync_calls = 0  # the list calls so far (each its watchdog key); ``+=`` makes it the instance's

    def _pack(self, arrays, total: int | None = None, align: int = 1):
        """The arrays in one new device buffer, each at a multiple of ``align`` elements (the
        padding zeros); ``total`` elements at least."""
        cp = self.cp
        dtypes = {a.dtype for a in arrays}
        if len(dtypes) != 1:
            raise RunError(f"the nccl backend needs one dtype per bucket, got {sorted(map(str, dtypes))}")
        offsets = aligned_offsets([a.shape for a in arrays], align)
        flat = cp.zeros(max(offsets[-1], total or 0), dtype=dtypes.pop())
        for a, offset in zip(arrays, offsets):
            flat[offset:offset + a.size] = cp.asarray(a).ravel()
        return flat

    def _sync_call(self, body):
        cp = self.cp
        compute = cp.cuda.get_current_stream()
        self.stream.wait_event(compute.record())
        with self.stream:
            result = body()
        done = self.stream.record()
        self._sync_calls += 1
        self.track(-self._sync_calls, done, "a collective of an init graph or of the first step")
        compute.wait_event(done)
        done.synchronize()  # first calls only: also orders onnxruntime's work if it is not on `compute`
        return result

    def allreduce(self, arrays, reduction):
        check_reduction(reduction)

        def body():
            flat = self._pack(arrays, align=FLAT_ALIGN)
            self.all_reduce_flat(flat, "AllReduce")
            if reduction == "mean":
                self.finish_mean(flat)
            return flat_views(flat, [a.shape for a in arrays], FLAT_ALIGN)
        return self._sync_call(body)

    def reduce(self, arrays, root, reduction):
        check_reduction(reduction)

        def body():
            flat = self._pack(arrays, align=FLAT_ALIGN)
            self.reduce_flat(flat, root, "Reduce")
            if self.rank != root:
                return None
            if reduction == "mean":
                self.finish_mean(flat)
            return flat_views(flat, [a.shape for a in arrays], FLAT_ALIGN)
        return self._sync_call(body)

    def broadcast(self, arrays, root, specs: Sequence[TensorSpec]):
        if self.rank == root and arrays is None:
            raise RunError(f"rank {self.rank} is the root of a Broadcast but passed no arrays")

        def body():
            shapes = [s.shape for s in specs]
            if self.rank == root:
                flat = self._pack(arrays, align=FLAT_ALIGN)
            else:
                dtypes = {np.dtype(s.dtype) for s in specs}
                if len(dtypes) != 1:
                    raise RunError(f"the nccl backend needs one dtype per bucket, got {sorted(map(str, dtypes))}")
                flat = self.cp.empty(aligned_offsets(shapes, FLAT_ALIGN)[-1], dtype=dtypes.pop())
            self.broadcast_flat(flat, root, "Broadcast")
            return flat_views(flat, shapes, FLAT_ALIGN)
        return self._sync_call(body)

    def reduce_scatter(self, arrays, reduction):
        check_reduction(reduction)

        def body():
            _, shard = flat_size([a.size for a in arrays], self.size)
            flat = self._pack(arrays, self.size * shard)
            self.reduce_scatter_flat(flat, "ReduceScatter")
            mine = flat[self.rank * shard:(self.rank + 1) * shard]
            if reduction == "mean":
                self.finish_mean(mine)
            return mine
        return self._sync_call(body)

    def all_gather(self, array, specs: Sequence[TensorSpec]):
        def body():
            shard = array.size
            flat = self.cp.zeros(self.size * shard, dtype=array.dtype)
            flat[self.rank * shard:(self.rank + 1) * shard] = self.cp.asarray(array).ravel()
            self.all_gather_flat(flat, "AllGather")
            return unpack_gathered(flat, specs)
        return self._sync_call(body)
