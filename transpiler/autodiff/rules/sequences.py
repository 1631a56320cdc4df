"""Sequence ops around ``split``/``chunk``: SplitToSequence and SequenceAt (what the dynamo exporter
writes with ``optimize=False``).

The gradient of a sequence is kept dense: for a sequence made by ``SplitToSequence(x)`` it is one
tensor shaped like ``x``, with each element's gradient in the slice that element was cut from.
``SequenceAt`` pads its output gradient into that slice (zeros elsewhere), several ``SequenceAt``
of one sequence add up as plain tensors (the backward's usual ``Sum``), and ``SplitToSequence``
passes the dense tensor on as the gradient of ``x``. No sequence-typed value is made by the
backward, so the rank graphs and the runtime's segment cutting see tensors only.
"""

from __future__ import annotations

import onnx_ir as ir

from transpiler.autodiff._context import RuleContext
from transpiler.autodiff._registry import register


@register("SplitToSequence", inputs=(0,))
def _split_to_sequence(ctx: RuleContext) -> list[ir.Value | None]:
    # The sequence's gradient is already dense (shaped like x): see the module docstring.
    return ctx.wanted_grads(lambda: ctx.dy)


def _int_constant(value: ir.Value | None) -> list[int] | int | None:
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    array = tensor.numpy()
    return int(array) if array.ndim == 0 else [int(v) for v in array.reshape(-1)]


@register("SequenceAt", inputs=(0,))
def _sequence_at(ctx: RuleContext) -> list[ir.Value | None]:
    sequence = ctx.inputs[0]
    split_node = sequence.producer()
    if split_node is None or split_node.op_type != "SplitToSequence" or split_node.domain not in ("", "ai.onnx"):
        made_by = "a graph input" if split_node is None else f"a {split_node.op_type} node"
        raise ctx.error(f"its sequence is made by {made_by}; only sequences made by SplitToSequence are supported")
    index = _int_constant(ctx.inputs[1])
    if not isinstance(index, int):
        raise ctx.error("the position must be a constant scalar")
    x = split_node.inputs[0]
    rank = ctx.rank(x)
    axis = split_node.attributes.get_int("axis", 0)
    axis = axis + rank if axis < 0 else axis
    keepdims = split_node.attributes.get_int("keepdims", 1)
    has_split = len(split_node.inputs) > 1 and split_node.inputs[1] is not None
    split = _int_constant(split_node.inputs[1]) if has_split else None
    if has_split and split is None:
        raise ctx.error(f"the split sizes of SplitToSequence '{split_node.name}' must be constants")
    dim = x.shape[axis] if x.shape is not None else None
    dim = dim if isinstance(dim, int) else None

    # The element's slice [start, end) of x along the axis; end None: min(start + size, dim).
    if isinstance(split, list):
        index = index + len(split) if index < 0 else index
        if not 0 <= index < len(split):
            raise ctx.error(f"position {index} is outside the {len(split)} pieces")
        start = sum(split[:index])
        end = start + split[index]
    else:
        size = 1 if split is None else split
        if index < 0:
            if dim is None:
                raise ctx.error("a negative position needs a static split axis")
            index += -(-dim // size)
        start, end = index * size, (index + 1) * size
        if dim is not None:
            end = min(end, dim)

    def grad() -> ir.Value:
        dy = ctx.dy
        if split is None and not keepdims:
            dy = ctx.op("Unsqueeze", [dy, ctx.const([axis])])
        if dim is not None:
            pads = ctx.const([start, dim - end])
        else:
            length = ctx.shape_of(x, axis, axis + 1)
            if split is not None and not isinstance(split, list):  # the last chunk may be short
                stop = ctx.op("Min", [length, ctx.const([end])])
            else:
                stop = ctx.const([end])
            pads = ctx.op("Concat", [ctx.const([start]), ctx.op("Sub", [length, stop])], {"axis": 0})
        return ctx.op("Pad", [dy, pads, None, ctx.const([axis])], like=x)

    return ctx.wanted_grads(grad, lambda: None)
