"""Reductions: the gradient is the output gradient broadcast back over the reduced axes."""

from __future__ import annotations

import math

import onnx_ir as ir

from transpiler.autodiff._context import RuleContext
from transpiler.autodiff._registry import register


def _reduced_axes(ctx: RuleContext) -> ir.Value | None:
    """The axes input (opset >= 18 for ReduceMean, 13 for ReduceSum), or None when the node names no
    axes: input absent, or a constant empty tensor, which the op treats the same way."""
    node = ctx.node
    if len(node.inputs) < 2 or node.inputs[1] is None:
        return None
    axes = node.inputs[1]
    const = ir.convenience.get_const_tensor(axes)
    if const is not None and const.size == 0:
        return None
    return axes


def _expand_back(ctx: RuleContext, dy: ir.Value) -> ir.Value:
    """``dy`` broadcast to the input's shape, undoing the removal of the reduced axes."""
    x = ctx.inputs[0]
    axes = _reduced_axes(ctx)
    if axes is None and ctx.node.attributes.get_int("noop_with_empty_axes", 0):
        return dy
    # Reducing over all axes without keepdims gives a scalar, which Expand broadcasts as it is.
    if axes is not None and not ctx.node.attributes.get_int("keepdims", 1):
        dy = ctx.op("Unsqueeze", [dy, axes])
    return ctx.op("Expand", [dy, ctx.shape_of(x)], like=x)


def _static_size(value: ir.Value) -> int | None:
    if value.shape is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return math.prod(value.shape)


@register("ReduceSum", inputs=(0,))
def _reduce_sum(ctx: RuleContext) -> list[ir.Value | None]:
    return ctx.wanted_grads(lambda: _expand_back(ctx, ctx.dy))


@register("ReduceMean", inputs=(0,))
def _reduce_mean(ctx: RuleContext) -> list[ir.Value | None]:
    x, y = ctx.inputs[0], ctx.output

    def grad() -> ir.Value:
        # Divide before expanding: the output has fewer elements than the input.
        x_size, y_size = _static_size(x), _static_size(y)
        if x_size is not None and y_size is not None:
            # An empty output has no gradient elements to scale, whatever the count.
            count = ctx.scalar(x_size // y_size if y_size else 1, like=y)
        else:
            ratio = ctx.op("Div", [ctx.op("Size", [x]), ctx.op("Size", [y])])
            count = ctx.op("Cast", [ratio], {"to": ctx.dtype(y)})
        return _expand_back(ctx, ctx.op("Div", [ctx.dy, count], like=y))

    return ctx.wanted_grads(grad)


@register("ReduceMax", "ReduceMin", inputs=(0,))
def _reduce_extremum(ctx: RuleContext) -> list[ir.Value | None]:
    # The gradient goes to the positions equal to the result; ties share it equally (as
    # torch.amax/amin do; torch.max(dim) instead gives it all to one index).
    x, y = ctx.inputs[0], ctx.output

    def grad() -> ir.Value:
        hit = ctx.op("Cast", [ctx.op("Equal", [x, _expand_back(ctx, y)])], {"to": ctx.dtype(x)}, like=x)
        # The tie count per output: ReduceSum of the hits with this node's own axes and flags.
        attrs = {
            name: ctx.node.attributes.get_int(name, default)
            for name, default in (("keepdims", 1), ("noop_with_empty_axes", 0))
        }
        axes = ctx.node.inputs[1] if len(ctx.node.inputs) > 1 else None
        count = ctx.op("ReduceSum", [hit, axes] if axes is not None else [hit], attrs, like=y)
        return ctx.op("Mul", [hit, _expand_back(ctx, ctx.op("Div", [ctx.dy, count], like=y))], like=x)

    return ctx.wanted_grads(grad)
