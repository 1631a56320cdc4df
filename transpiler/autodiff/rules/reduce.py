"""Reductions: the gradient is the output gradient broadcast back over the reduced axes, times the
local derivative (ReduceSumSquare, ReduceL1, ReduceL2, ReduceLogSum, ReduceLogSumExp, ReduceProd)."""

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
        count = _reduce_like_node(ctx, "ReduceSum", hit)  # the tie count per output
        return ctx.op("Mul", [hit, _expand_back(ctx, ctx.op("Div", [ctx.dy, count], like=y))], like=x)

    return ctx.wanted_grads(grad)


def _reduce_like_node(ctx: RuleContext, op_type: str, x: ir.Value) -> ir.Value:
    """``op_type`` over ``x`` with this node's own axes and flags (its output is shaped like y)."""
    attrs = {
        name: ctx.node.attributes.get_int(name, default)
        for name, default in (("keepdims", 1), ("noop_with_empty_axes", 0))
    }
    axes = ctx.node.inputs[1] if len(ctx.node.inputs) > 1 else None
    return ctx.op(op_type, [x, axes] if axes is not None else [x], attrs, like=ctx.output)


def _times_expanded(ctx: RuleContext, local: ir.Value, per_output: ir.Value) -> ir.Value:
    """``local`` (shaped like x) times ``per_output`` (shaped like y) broadcast back over x."""
    return ctx.op("Mul", [local, _expand_back(ctx, per_output)], like=ctx.inputs[0])


@register("ReduceSumSquare", inputs=(0,))
def _reduce_sum_square(ctx: RuleContext) -> list[ir.Value | None]:
    # y = sum x^2: dx = 2 x dy.
    x, y = ctx.inputs[0], ctx.output
    return ctx.wanted_grads(lambda: _times_expanded(ctx, x, ctx.op("Mul", [ctx.dy, ctx.scalar(2, like=y)], like=y)))


@register("ReduceL1", inputs=(0,))
def _reduce_l1(ctx: RuleContext) -> list[ir.Value | None]:
    # y = sum |x|: dx = sign(x) dy (0 at 0, as torch's norm(p=1) backward).
    x = ctx.inputs[0]
    return ctx.wanted_grads(lambda: _times_expanded(ctx, ctx.op("Sign", [x]), ctx.dy))


@register("ReduceL2", inputs=(0,))
def _reduce_l2(ctx: RuleContext) -> list[ir.Value | None]:
    # y = sqrt(sum x^2): dx = x dy / y, and 0 where y = 0 (torch's norm backward masks those).
    x, y = ctx.inputs[0], ctx.output

    def grad() -> ir.Value:
        zero = ctx.scalar(0, like=y)
        scale = ctx.op("Where", [ctx.op("Equal", [y, zero]), zero, ctx.op("Div", [ctx.dy, y])], like=y)
        return _times_expanded(ctx, x, scale)

    return ctx.wanted_grads(grad)


@register("ReduceLogSum", inputs=(0,))
def _reduce_log_sum(ctx: RuleContext) -> list[ir.Value | None]:
    # y = log(sum x): dx = dy / sum x, the sum recomputed (exp(y) would round it).
    x = ctx.inputs[0]

    def grad() -> ir.Value:
        total = _reduce_like_node(ctx, "ReduceSum", x)
        return _expand_back(ctx, ctx.op("Div", [ctx.dy, total], like=ctx.output))

    return ctx.wanted_grads(grad)


@register("ReduceLogSumExp", inputs=(0,))
def _reduce_log_sum_exp(ctx: RuleContext) -> list[ir.Value | None]:
    # y = log(sum exp x): dx = dy exp(x - y), as torch's logsumexp backward.
    x, y = ctx.inputs[0], ctx.output

    def grad() -> ir.Value:
        softmax = ctx.op("Exp", [ctx.op("Sub", [x, _expand_back(ctx, y)])], like=x)
        return _times_expanded(ctx, softmax, ctx.dy)

    return ctx.wanted_grads(grad)


@register("ReduceProd", inputs=(0,))
def _reduce_prod(ctx: RuleContext) -> list[ir.Value | None]:
    # dx_i = dy * prod_{j != i} x_j. Without zeros in the group that is y / x_i. With one zero, only
    # the zero gets a gradient, the product of the others; with two or more, nothing does. So:
    # Where(x == 0, [one zero] * prod(nonzero x), y / x), with y / x = 0 where the group has a zero.
    x, y = ctx.inputs[0], ctx.output

    def grad() -> ir.Value:
        zero = ctx.scalar(0, like=x)
        is_zero = ctx.op("Equal", [x, zero])
        zeros = _reduce_like_node(ctx, "ReduceSum", ctx.op("Cast", [is_zero], {"to": ctx.dtype(x)}))
        others = _reduce_like_node(ctx, "ReduceProd", ctx.op("Where", [is_zero, ctx.scalar(1, like=x), x]))
        lone = ctx.op("Where", [ctx.op("Equal", [zeros, ctx.scalar(1, like=y)]), others, zero], like=y)
        at_zero = _expand_back(ctx, ctx.op("Mul", [ctx.dy, lone], like=y))
        elsewhere = ctx.op("Div", [_expand_back(ctx, ctx.op("Mul", [ctx.dy, y], like=y)), x], like=x)
        return ctx.op("Where", [is_zero, at_zero, elsewhere], like=x)

    return ctx.wanted_grads(grad)
