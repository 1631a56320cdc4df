"""Ops that select, repeat or pad elements: their gradients scatter, sum or crop the gradient back.

Gather/GatherElements/GatherND scatter-add into zeros (repeated indices accumulate); Slice scatters into
zeros along each sliced axis (any starts/ends/steps, negative steps too) or, when everything is
static with unit steps, is a Pad; Split concatenates; Tile sums the tiles; Pad (constant mode) pads
by the negated pads, which crops.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from transpiler.autodiff._context import RuleContext, producer_of
from transpiler.autodiff._registry import linear, register


def _normalized_indices(ctx: RuleContext, indices: ir.Value, data: ir.Value, axis: int) -> ir.Value:
    """Indices as int64 with negative ones wrapped by the data's length along ``axis``."""
    if ctx.dtype(indices) != ir.DataType.INT64:
        indices = ctx.op("Cast", [indices], {"to": ir.DataType.INT64})
    const = ir.convenience.get_const_tensor(indices)
    if const is not None and not (const.numpy() < 0).any():
        return indices
    length = ctx.op("Squeeze", [ctx.shape_of(data, axis, axis + 1), ctx.const([0])])
    negative = ctx.op("Less", [indices, ctx.const(np.array(0, dtype=np.int64))])
    return ctx.op("Where", [negative, ctx.op("Add", [indices, length]), indices])


@register("Gather", inputs=(0,))
def _gather(ctx: RuleContext) -> list[ir.Value | None]:
    # y = data[..., idx, ...] along axis: dy has shape pre + idx.shape + post. Move the index dims to
    # the front, ScatterND(reduction=add) into zeros of (D_axis, pre, post), move axis back.
    data, indices = ctx.inputs
    rank, q = ctx.rank(data), ctx.rank(indices)
    axis = ctx.node.attributes.get_int("axis", 0) % rank

    def grad() -> ir.Value:
        idx = ctx.op("Unsqueeze", [_normalized_indices(ctx, indices, data, axis), ctx.const([-1])])
        dy = ctx.dy
        if axis:
            perm = [*range(axis, axis + q), *range(axis), *range(axis + q, rank - 1 + q)]
            dy = ctx.op("Transpose", [dy], {"perm": perm})
        front = [axis, *range(axis), *range(axis + 1, rank)]
        shape = ctx.op(
            "Concat", [ctx.shape_of(data, axis, axis + 1), *_shape_pieces(ctx, data, front[1:])], {"axis": 0}
        )
        zero = ir.tensor(np.zeros([1], dtype=ctx.dtype(data).numpy()))
        zeros = ctx.op("ConstantOfShape", [shape], {"value": zero})
        scattered = ctx.op("ScatterND", [zeros, idx, dy], {"reduction": "add"})
        if axis:
            scattered = ctx.op("Transpose", [scattered], {"perm": np.argsort(front).tolist()})
        return ctx.op("Identity", [scattered], like=data)

    return ctx.wanted_grads(grad)


def _shape_pieces(ctx: RuleContext, value: ir.Value, axes: list[int]) -> list[ir.Value]:
    """Shape(value)[a] for each axis, grouped into contiguous runs."""
    pieces, start = [], None
    for i, a in enumerate(axes):
        if start is None:
            start = a
        if i + 1 == len(axes) or axes[i + 1] != a + 1:
            pieces.append(ctx.shape_of(value, start, a + 1))
            start = None
    return pieces


@register("GatherElements", inputs=(0,))
def _gather_elements(ctx: RuleContext) -> list[ir.Value | None]:
    data, indices = ctx.inputs
    axis = ctx.node.attributes.get_int("axis", 0) % ctx.rank(data)

    def grad() -> ir.Value:
        idx = _normalized_indices(ctx, indices, data, axis)
        return ctx.op(
            "ScatterElements",
            [ctx.zeros_like(data), idx, ctx.dy],
            {"axis": axis, "reduction": "add"},
            like=data,
        )

    return ctx.wanted_grads(grad)


def _slice_axes(ctx: RuleContext, rank: int) -> list[int]:
    axes = ctx.const_input(3)
    if axes is None:
        if ctx.has_input(3):
            raise ctx.error("the axes input must be a constant")
        starts = ctx.inputs[1]
        if starts.shape is None or not isinstance(starts.shape[0], int):
            raise ctx.error("the number of sliced axes (length of starts) is unknown")
        return list(range(starts.shape[0]))
    return [int(a) % rank for a in axes.reshape(-1)]


@register("Slice", inputs=(0,))
def _slice(ctx: RuleContext) -> list[ir.Value | None]:
    x = ctx.inputs[0]
    rank = ctx.rank(x)
    axes = _slice_axes(ctx, rank)

    def static_pads() -> list[int] | None:
        starts, ends = ctx.const_input(1), ctx.const_input(2)
        steps = ctx.const_input(4) if ctx.has_input(4) else np.ones(len(axes), dtype=np.int64)
        if starts is None or ends is None or steps is None or x.shape is None or (steps != 1).any():
            return None
        dims = [x.shape[a] for a in axes]
        if not all(isinstance(d, int) for d in dims):
            return None
        begins, tails = [0] * rank, [0] * rank
        for a, d, s, e in zip(axes, dims, starts.reshape(-1), ends.reshape(-1)):
            lo, hi, _ = slice(int(s), int(e), 1).indices(d)
            begins[a], tails[a] = lo, d - max(hi, lo)
        return begins + tails

    def grad() -> ir.Value:
        pads = static_pads()
        if pads is not None:
            return ctx.op("Pad", [ctx.dy, ctx.const(pads)], like=x)
        # One axis at a time: the positions a slice keeps along an axis are Slice(Range(0, D));
        # scatter the gradient there (positions are distinct, so no reduction is needed).
        grad = ctx.dy
        for j, axis in enumerate(axes):
            length = ctx.shape_of(x, axis, axis + 1)
            ids = ctx.op(
                "Range",
                [
                    ctx.const(np.array(0, dtype=np.int64)),
                    ctx.op("Squeeze", [length, ctx.const([0])]),
                    ctx.const(np.array(1, dtype=np.int64)),
                ],
            )
            inputs = [ids, _part(ctx, 1, j), _part(ctx, 2, j), ctx.const([0])]
            if ctx.has_input(4):
                inputs.append(_part(ctx, 4, j))
            kept = ctx.op("Slice", inputs)
            kept = ctx.op("Reshape", [kept, ctx.const([-1 if a == axis else 1 for a in range(rank)])])
            current = ctx.op("Shape", [grad])
            kept = ctx.op("Expand", [kept, current])
            target = ctx.op(
                "Concat",
                [
                    p
                    for p in (
                        _range_of(ctx, current, 0, axis),
                        length,
                        _range_of(ctx, current, axis + 1, rank),
                    )
                    if p is not None
                ],
                {"axis": 0},
            )
            zero = ir.tensor(np.zeros([1], dtype=ctx.dtype(x).numpy()))
            zeros = ctx.op("ConstantOfShape", [target], {"value": zero})
            grad = ctx.op("ScatterElements", [zeros, kept, grad], {"axis": axis})
        return ctx.op("Identity", [grad], like=x)

    return ctx.wanted_grads(grad)


def _part(ctx: RuleContext, index: int, j: int) -> ir.Value:
    """Element j of Slice's starts/ends/steps input, as a 1-element tensor."""
    const = ctx.const_input(index)
    if const is not None:
        return ctx.const(np.asarray(const.reshape(-1)[j : j + 1]))
    return ctx.op("Slice", [ctx.inputs[index], ctx.const([j]), ctx.const([j + 1])])


def _range_of(ctx: RuleContext, shape: ir.Value, start: int, end: int) -> ir.Value | None:
    if start >= end:
        return None
    return ctx.op("Slice", [shape, ctx.const([start]), ctx.const([end])])


@register("Split", inputs=(0,))
def _split(ctx: RuleContext) -> list[ir.Value | None]:
    # Concat of the output gradients, zeros for outputs without one.
    x = ctx.inputs[0]
    axis = ctx.node.attributes.get_int("axis", 0) % ctx.rank(x)

    def grad() -> ir.Value:
        parts = [dy if dy is not None else ctx.zeros_like(out) for dy, out in zip(ctx.dys, ctx.node.outputs)]
        return ctx.op("Concat", parts, {"axis": axis}, like=x)

    return ctx.wanted_grads(grad)


@linear("Trilu")
def _trilu(ctx: RuleContext, dy: ir.Value) -> ir.Value:
    inputs = [dy, ctx.inputs[1]] if ctx.has_input(1) else [dy]
    attrs: dict[str, Any] = {"upper": ctx.node.attributes.get_int("upper", 1)}
    return ctx.op("Trilu", inputs, attrs, like=ctx.inputs[0])


@linear("Tile")
def _tile(ctx: RuleContext, dy: ir.Value) -> ir.Value:
    # dy has dims r_i * d_i: view it as (r_0, d_0, r_1, d_1, ...) and sum the r axes.
    x, repeats = ctx.inputs[0], ctx.inputs[1]
    rank = ctx.rank(x)
    pieces = []
    for i in range(rank):
        pieces.append(ctx.op("Slice", [repeats, ctx.const([i]), ctx.const([i + 1])]))
        pieces.append(ctx.shape_of(x, i, i + 1))
    split = ctx.op("Concat", pieces, {"axis": 0})
    viewed = ctx.op("Reshape", [dy, split])
    return ctx.op("ReduceSum", [viewed, ctx.const(list(range(0, 2 * rank, 2)))], {"keepdims": 0}, like=x)


@linear("Pad")
def _pad(ctx: RuleContext, dy: ir.Value) -> ir.Value:
    # Constant mode only: the transpose crops what was padded, i.e. Pad by the negated pads
    # (negative pads crop; forward crops, negative pads, become zero padding).
    mode = ctx.node.attributes.get_string("mode", "constant")
    if mode != "constant":
        raise ctx.error(f"mode={mode!r} is not supported (constant mode only)")
    negated = ctx.op("Neg", [ctx.inputs[1]])
    inputs: list[ir.Value | None] = [dy, negated]
    if ctx.has_input(3):
        inputs += [None, ctx.inputs[3]]
    return ctx.op("Pad", inputs, like=ctx.inputs[0])


def _nd_indices(ctx: RuleContext, indices: ir.Value, data: ir.Value, batch_dims: int) -> ir.Value:
    """GatherND's index tuples with negative components wrapped by the data's dims they index."""
    if ir.convenience.get_const_tensor(indices) is not None and not (ctx.const_input(1) < 0).any():
        return indices
    source = producer_of(indices, "Transpose")
    if producer_of(indices if source is None else source.inputs[0], "NonZero") is not None:
        return indices  # boolean-mask indexing (x[mask]): NonZero's positions are never negative
    depth = indices.shape[-1] if indices.shape is not None and indices.shape.rank() else None
    if not isinstance(depth, int):
        raise ctx.error("the length of the index tuples (the last dim of indices) is unknown")
    dims = ctx.shape_of(data, batch_dims, batch_dims + depth)
    negative = ctx.op("Less", [indices, ctx.const(np.array(0, dtype=np.int64))])
    return ctx.op("Where", [negative, ctx.op("Add", [indices, dims]), indices])


@register("GatherND", inputs=(0,))
def _gather_nd(ctx: RuleContext) -> list[ir.Value | None]:
    # dy has shape indices.shape[:-1] + data.shape[batch_dims + k:]: exactly ScatterND's updates for
    # those indices, so the gradient is ScatterND(reduction=add) into zeros (tuples may repeat).
    # ScatterND has no batch_dims: the leading batch_dims axes are flattened into one, B, and each
    # index tuple gets its row number in front.
    data, indices = ctx.inputs
    batch_dims = ctx.node.attributes.get_int("batch_dims", 0)

    def grad() -> ir.Value:
        idx = _nd_indices(ctx, indices, data, batch_dims)
        if not batch_dims:
            return ctx.op("ScatterND", [ctx.zeros_like(data), idx, ctx.dy], {"reduction": "add"}, like=data)
        rows = ctx.const([-1])

        def flat(value: ir.Value, shape_source: ir.Value) -> ir.Value:
            return ctx.op("Reshape", [value, ctx.op("Concat", [rows, ctx.shape_of(shape_source, batch_dims)],
                                                    {"axis": 0})])

        tuples = flat(idx, indices)  # (B, i_b, ..., k)
        depth = ctx.rank(indices) - batch_dims  # rank of `tuples` minus 1
        count = ctx.op("Slice", [ctx.op("Shape", [tuples]), ctx.const([0]), ctx.const([1])])
        row = ctx.op("Range", [ctx.const(np.array(0, dtype=np.int64)), ctx.op("Squeeze", [count, ctx.const([0])]),
                               ctx.const(np.array(1, dtype=np.int64))])
        row = ctx.op("Reshape", [row, ctx.const([-1] + [1] * depth)])
        target = ctx.op("Concat", [ctx.op("Shape", [tuples], {"end": -1}), ctx.const([1])], {"axis": 0})
        tuples = ctx.op("Concat", [ctx.op("Expand", [row, target]), tuples], {"axis": -1})
        scattered = ctx.op("ScatterND", [flat(ctx.zeros_like(data), data), tuples, flat(ctx.dy, ctx.output)],
                           {"reduction": "add"})
        return ctx.op("Reshape", [scattered, ctx.shape_of(data)], like=data)

    return ctx.wanted_grads(grad)
