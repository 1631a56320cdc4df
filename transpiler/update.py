"""The one place the rank builder emits optimizer updates: one fused update node per tensor
(``transpiler.update_node.emit_fused_update``; domain ``graph_transpiler.optimizer``, its function
body the standard-op update), whatever the strategy:

- ``emit_param_update(step, name, grad, param=None)``: one tensor's update; its optimizer state
  (the optimizer table's slots) becomes state inputs/outputs of the step graph.
- ``emit_bucket_update(step, bucket, grads)``: a bucket's parameters, each its own node. A backend
  with a native kernel runs a bucket's consecutive update nodes as one multi-tensor launch, which
  is what the removed --flat-update did with concatenations.

With fp16 loss scaling every updated value (parameter, optimizer state) is
``step.unless_skipped(new, old)``: ``Where(all gradients finite, new, old)``, GradScaler.step's skip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir
from onnx_ir.tape import Tape

from transpiler.bucketing import Bucket
from transpiler.update_node import emit_fused_update

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
        slots[slot] = ir.val(slot_state(name, slot), param.dtype, ir.Shape(param.shape))
        graph.inputs.append(slots[slot])
    new_param, new_slots = emit_fused_update(
        step.model, step.config, param=param, grad=grad, lr=step.lr, step=step.step_counter, state=slots, name=name
    )
    if step.finite is not None:  # fp16 loss scaling: a step with a non-finite gradient changes nothing
        new_param = step.unless_skipped(new_param, param)
        new_slots = {slot: step.unless_skipped(value, slots[slot]) for slot, value in new_slots.items()}
    for slot, value in slots.items():
        step.add_state(value, new_slots[slot], "optimizer", owner)
    return new_param


def slot_state(name: str, slot: str) -> str:
    """The state input of optimizer slot ``slot`` of the tensor ``name`` (a parameter, or a zero
    slice): plan.json's pieces name a zero slice's elements by the parameters' slot states."""
    return f"{name}.{slot}"


def emit_bucket_update(step: RankStep, bucket: Bucket, grads: list[ir.Value]) -> list[ir.Value]:
    """The new values of a bucket's parameters, updated on this rank (recorded in ``step.updates``)."""
    step.updates.extend(bucket.params)
    return [emit_param_update(step, n, g) for n, g in zip(bucket.params, grads)]


def int64(tape: Tape, values: list[int]) -> ir.Value:
    return tape.op("Constant", [], {"value": ir.tensor(np.array(values, dtype=np.int64))})


def flatten(tape: Tape, values: list[ir.Value], total: int) -> ir.Value:
    """The values flattened and concatenated, in order (a bucket's flat layout), as one row (1, total).

    A row, not a vector: onnx's shape inference with data propagation (runtime/specialize.py) takes
    a 1-D Concat or Slice for shape arithmetic and keeps one symbolic dimension per element: 135 s
    and tens of GiB for GPT-2-small's zero step (its first step on 2 H200s, run h200x2-s40); rows it
    leaves alone."""
    flat = tape.op("Concat", [tape.op("Reshape", [v, int64(tape, [1, -1])]) for v in values], {"axis": 1})
    flat.dtype, flat.shape = values[0].dtype, ir.Shape([1, total])
    return flat
