"""``zero`` (ZeRO-1; XLA's cross-replica weight-update sharding): the bandwidth-optimal form.

Per bucket: ReduceScatter(mean) of the flat bucket, each rank updates its 1/N slice and keeps the
optimizer state of that slice only (exactly 1/N per rank), AllGather of the slices gives every
rank the new parameters.

The flat layout (docs/contracts.md): a bucket's parameters flattened and concatenated in bucket
order, zero-padded to N*S elements; rank r owns [r*S, (r+1)*S). Padding stays zero: its gradient
is zero, so is its update.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.tape import Tape

from contract.plan import Piece
from transpiler.collectives import append_collective
from transpiler.errors import TranspileError
from transpiler.names import NEXT
from transpiler.strategies.base import Strategy
from transpiler.update import emit_param_update, flatten, slot_state


class Zero(Strategy):
    name = "zero"
    summary = "ReduceScatter each bucket, every rank updates 1/N of it, AllGather (ZeRO-1)"
    holds_part_of_gradients = True

    def reduce(self, step, bucket):
        """ReduceScatter the bucket's gradients; this rank holds the [S] slice of their mean."""
        _, _, per_rank, dtype = _layout(step, bucket)
        return append_collective(
            step.graph, "ReduceScatter", [step.grads[p] for p in bucket.params],
            like=[ir.val("", dtype, [per_rank])], output_names=[f"bucket{bucket.id}.grad.slice"],
            order=0, bucket=bucket.id, phase="step", reduction="mean",
        )

    def update(self, step, bucket, grads):
        """This rank's slice of the flat bucket, updated (its optimizer state: one [S] vector per
        slot, on this rank only)."""
        (grad_slice,) = grads
        sizes, total, per_rank, dtype = _layout(step, bucket)
        start = step.rank * per_rank
        tape = Tape(step.graph)

        def const(array: np.ndarray) -> ir.Value:
            return tape.op("Constant", [], {"value": ir.tensor(array)})

        flat = flatten(tape, [step.params[p] for p in bucket.params], total)  # (1, total)
        if per_rank * step.world > total:
            flat = tape.op("Pad", [flat, const(np.array([0, 0, 0, per_rank * step.world - total], np.int64))])
        row = tape.op("Slice", [flat, const(np.array([start], np.int64)), const(np.array([start + per_rank], np.int64)),
                                const(np.array([1], np.int64))])
        param_slice = tape.op("Reshape", [row, const(np.array([-1], np.int64))])
        param_slice.dtype, param_slice.shape = dtype, ir.Shape([per_rank])
        name = f"bucket{bucket.id}.slice"
        new_value = emit_param_update(step, name, grad_slice, param=param_slice)
        _record_pieces(step, name, bucket.params, sizes, start, per_rank)
        return [new_value]

    def publish(self, step, bucket, new_values):
        """AllGather the slices: its outputs are the new parameters."""
        names = bucket.params
        sizes, _, per_rank, _ = _layout(step, bucket)
        start = step.rank * per_rank
        gathered = append_collective(
            step.graph, "AllGather", new_values, like=[step.params[p] for p in names],
            output_names=[p + NEXT for p in names], order=0, bucket=bucket.id, phase="step",
        )
        offset = 0
        for name, size, value in zip(names, sizes, gathered):
            step.add_state(step.params[name], value, "param", name)
            if offset < start + per_rank and offset + size > start:
                step.updates.append(name)  # part of this parameter's elements are updated here
            offset += size

    def updates_per_param(self, world):
        # Each parameter's elements are updated by the ranks whose slices cover them.
        return 1, world


def _record_pieces(step, name: str, params: list[str], sizes: list[int], start: int, per_rank: int) -> None:
    """Which elements of which parameter's optimizer state each slot state of this rank's slice
    holds (plan.json's ``pieces``): what lets a checkpoint be read back by parameter, whole, and
    resumed on another world size or strategy (runtime/reshard.py)."""
    spans, offset = [], 0
    for param, size in zip(params, sizes):
        lo, hi = max(offset, start), min(offset + size, start + per_rank)
        if lo < hi:
            spans.append((param, lo - offset, hi - offset, lo - start))
        offset += size
    slots = {slot_state(name, slot): slot for slot in step.config.slots()}
    for entry in step.state:
        if entry.input in slots:
            entry.pieces = [Piece(slot_state(param, slots[entry.input]), a, b, at) for param, a, b, at in spans]


def _layout(step, bucket) -> tuple[list[int], int, int, ir.DataType]:
    """(element count of each parameter, bucket total, slice length S, dtype) of a bucket."""
    names = bucket.params
    params = step.params
    dtypes = {params[p].dtype for p in names}
    if len(dtypes) != 1:
        raise TranspileError(f"--strategy zero: bucket {bucket.id} mixes dtypes {sorted(map(str, dtypes))}")
    sizes = [int(np.prod(params[p].shape.numpy(), dtype=np.int64)) for p in names]
    total = sum(sizes)
    return sizes, total, -(-total // step.world), params[names[0]].dtype
