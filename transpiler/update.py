"""The one place the rank builder emits optimizer updates (``transpiler.optimizer.emit_update``).

Every strategy updates through these two functions, so a different update emission (a fused
update op, say) replaces the body of ``emit_param_update`` or ``emit_bucket_update`` here and
nowhere else:

- ``emit_param_update(step, name, grad, param=None)``: one tensor's update; its optimizer state
  (the optimizer table's slots) becomes state inputs/outputs of the step graph.
- ``emit_bucket_update(step, bucket, grads)``: a bucket's parameters, each on its own, or with
  --flat-update as one flat vector. This is the flat-update wrapper: it applies to every strategy
  that updates whole parameters, once, here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir
from onnx_ir.tape import Tape

from transpiler.bucketing import Bucket
from transpiler.optimizer import emit_update

if TYPE_CHECKING:
    from transpiler.rank_step import RankStep


def emit_param_update(step: RankStep, name: str, grad: ir.Value, param: ir.Value | None = None) -> ir.Value:
    """Emit the optimizer update of the parameter ``name``, or of ``param`` (a flat bucket or a zero
    slice named ``name``, whose state belongs to no single parameter); return the new value."""
    graph = step.graph
    owner = name if param is None else None
    param = step.params[name] if param is None else param
    slots = {}
    for slot in step.config.slots():
        slots[slot] = ir.val(f"{name}.{slot}", param.dtype, ir.Shape(param.shape))
        graph.inputs.append(slots[slot])
    new_param, new_slots = emit_update(
        graph, step.config, param=param, grad=grad, lr=step.lr, step=step.step_counter, state=slots, name=name
    )
    for slot, value in slots.items():
        step.add_state(value, new_slots[slot], "optimizer", owner)
    return new_param


def emit_bucket_update(step: RankStep, bucket: Bucket, grads: list[ir.Value]) -> list[ir.Value]:
    """The new values of a bucket's parameters, updated on this rank (recorded in ``step.updates``).

    With --flat-update a bucket of several parameters is updated as one flat vector (its optimizer
    state too): the optimizers are elementwise, so the numbers are those of per-parameter updates,
    in a few large ops instead of ~25 small ones per parameter (kernel launches dominate small
    updates on a GPU; on CPU the concatenation copies cost more than they save).
    """
    params = step.params
    names = bucket.params
    step.updates.extend(names)
    if not step.job.options.flat_update or len(names) == 1 or len({params[n].dtype for n in names}) != 1:
        return [emit_param_update(step, n, g) for n, g in zip(names, grads)]
    tape = Tape(step.graph)
    sizes = [int(np.prod(params[n].shape.numpy(), dtype=np.int64)) for n in names]
    flat_param = flatten(tape, [params[n] for n in names], sum(sizes))
    flat_grad = flatten(tape, grads, sum(sizes))
    new_flat = emit_param_update(step, f"bucket{bucket.id}", flat_grad, param=flat_param)
    parts = tape.op_multi_out("Split", [new_flat, int64(tape, sizes)], {"axis": 0}, num_outputs=len(names))
    new_values = []
    for name, part in zip(names, parts):
        shape = [int(d) for d in params[name].shape.numpy()]
        value = tape.op("Reshape", [part, int64(tape, shape)])
        value.dtype, value.shape = params[name].dtype, ir.Shape(shape)
        new_values.append(value)
    return new_values


def int64(tape: Tape, values: list[int]) -> ir.Value:
    return tape.op("Constant", [], {"value": ir.tensor(np.array(values, dtype=np.int64))})


def flatten(tape: Tape, values: list[ir.Value], total: int) -> ir.Value:
    """The values flattened and concatenated, in order (a bucket's flat layout)."""
    flat = tape.op("Concat", [tape.op("Reshape", [v, int64(tape, [-1])]) for v in values], {"axis": 0})
    flat.dtype, flat.shape = values[0].dtype, ir.Shape([total])
    return flat
