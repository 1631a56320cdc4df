"""The rest of ONNX's activation set: Elu, Selu, Celu, PRelu, Softplus, Softsign, Mish, Swish,
ThresholdedRelu and Shrink. Each follows PyTorch's backward where PyTorch has the function (the
branch taken at a kink, the form of the derivative), so N ranks can match torch's own steps."""

from __future__ import annotations

import onnx_ir as ir

from transpiler.autodiff._context import RuleContext, unbroadcast
from transpiler.autodiff._registry import register
from transpiler.autodiff.rules.activations import dy_where


def _positive(ctx: RuleContext, x: ir.Value) -> ir.Value:
    return ctx.op("Greater", [x, ctx.scalar(0, like=x)])


def _exp_branch(ctx: RuleContext, positive_slope: float, negative_scale: float, input_scale: float) -> ir.Value:
    """Gradient of torch's elu family: ``positive_slope`` where x > 0, else
    ``negative_scale * input_scale * exp(x * input_scale)`` (torch's elu_backward on the input:
    the exponential branch at x = 0 too)."""
    x = ctx.inputs[0]
    scaled = x if input_scale == 1.0 else ctx.op("Mul", [x, ctx.scalar(input_scale, like=x)])
    below = ctx.op("Mul", [ctx.op("Exp", [scaled]), ctx.scalar(negative_scale * input_scale, like=x)])
    above = ctx.dy if positive_slope == 1.0 else ctx.op("Mul", [ctx.dy, ctx.scalar(positive_slope, like=x)])
    return ctx.op("Where", [_positive(ctx, x), above, ctx.op("Mul", [ctx.dy, below])], like=x)


@register("Elu")
def _elu(ctx: RuleContext) -> list[ir.Value | None]:
    # y = x for x > 0, alpha (exp(x) - 1) below.
    alpha = ctx.node.attributes.get_float("alpha", 1.0)
    return ctx.wanted_grads(lambda: _exp_branch(ctx, 1.0, alpha, 1.0))


@register("Selu")
def _selu(ctx: RuleContext) -> list[ir.Value | None]:
    # y = gamma x for x > 0, gamma alpha (exp(x) - 1) below (ONNX's defaults are torch's constants).
    alpha = ctx.node.attributes.get_float("alpha", 1.67326319217681884765625)
    gamma = ctx.node.attributes.get_float("gamma", 1.05070102214813232421875)
    return ctx.wanted_grads(lambda: _exp_branch(ctx, gamma, gamma * alpha, 1.0))


@register("Celu")
def _celu(ctx: RuleContext) -> list[ir.Value | None]:
    # y = max(0, x) + min(0, alpha (exp(x / alpha) - 1)): 1 above 0, exp(x / alpha) below.
    alpha = ctx.node.attributes.get_float("alpha", 1.0)
    return ctx.wanted_grads(lambda: _exp_branch(ctx, 1.0, alpha, 1.0 / alpha))


@register("PRelu")
def _prelu(ctx: RuleContext) -> list[ir.Value | None]:
    # y = x for x > 0, slope x below; slope broadcasts to x (unidirectionally), so its gradient is
    # summed back to its shape. As torch's prelu backward: the slope branch at x = 0.
    x, slope = ctx.inputs
    zero = ctx.scalar(0, like=x)

    def grad_x() -> ir.Value:
        scaled = ctx.op("Mul", [ctx.dy, slope], like=x)
        return ctx.op("Where", [_positive(ctx, x), ctx.dy, scaled], like=x)

    def grad_slope() -> ir.Value:
        below = ctx.op("Where", [_positive(ctx, x), zero, ctx.op("Mul", [ctx.dy, x])], like=x)
        return unbroadcast(ctx, below, slope)

    return ctx.wanted_grads(grad_x, grad_slope)


@register("Softplus")
def _softplus(ctx: RuleContext) -> list[ir.Value | None]:
    # y = log(1 + exp(x)), y' = sigmoid(x).
    x = ctx.inputs[0]
    return ctx.wanted_grads(lambda: ctx.op("Mul", [ctx.dy, ctx.op("Sigmoid", [x])], like=x))


@register("Softsign")
def _softsign(ctx: RuleContext) -> list[ir.Value | None]:
    # y = x / (1 + |x|), y' = 1 / (1 + |x|)^2.
    x = ctx.inputs[0]

    def grad() -> ir.Value:
        denominator = ctx.op("Add", [ctx.op("Abs", [x]), ctx.scalar(1, like=x)])
        return ctx.op("Div", [ctx.dy, ctx.op("Mul", [denominator, denominator])], like=x)

    return ctx.wanted_grads(grad)


@register("Mish")
def _mish(ctx: RuleContext) -> list[ir.Value | None]:
    # y = x tanh(softplus(x)); y' = t + x sigmoid(x) (1 - t^2), t = tanh(softplus(x)): the terms of
    # torch's mish_backward.
    x = ctx.inputs[0]

    def grad() -> ir.Value:
        t = ctx.op("Tanh", [ctx.op("Softplus", [x])])
        sech2 = ctx.op("Sub", [ctx.scalar(1, like=x), ctx.op("Mul", [t, t])])
        local = ctx.op("Add", [t, ctx.op("Mul", [ctx.op("Mul", [x, ctx.op("Sigmoid", [x])]), sech2])])
        return ctx.op("Mul", [ctx.dy, local], like=x)

    return ctx.wanted_grads(grad)


@register("Swish")
def _swish(ctx: RuleContext) -> list[ir.Value | None]:
    # Opset 24: y = x sigmoid(alpha x); y' = s (1 + alpha x (1 - s)), s = sigmoid(alpha x).
    x = ctx.inputs[0]
    alpha = ctx.node.attributes.get_float("alpha", 1.0)

    def grad() -> ir.Value:
        ax = ctx.op("Mul", [x, ctx.scalar(alpha, like=x)])
        s = ctx.op("Sigmoid", [ax])
        one = ctx.scalar(1, like=x)
        local = ctx.op("Mul", [s, ctx.op("Add", [one, ctx.op("Mul", [ax, ctx.op("Sub", [one, s])])])])
        return ctx.op("Mul", [ctx.dy, local], like=x)

    return ctx.wanted_grads(grad)


@register("ThresholdedRelu")
def _thresholded_relu(ctx: RuleContext) -> list[ir.Value | None]:
    # y = x where x > alpha, else 0.
    x = ctx.inputs[0]
    alpha = ctx.node.attributes.get_float("alpha", 1.0)

    def grad() -> ir.Value:
        above = ctx.op("Greater", [x, ctx.scalar(alpha, like=x)])
        return dy_where(ctx, above)

    return ctx.wanted_grads(grad)


@register("Shrink")
def _shrink(ctx: RuleContext) -> list[ir.Value | None]:
    # y = x - bias above lambd, x + bias below -lambd, 0 between (torch's hardshrink with bias 0,
    # softshrink with bias lambd): dy outside [-lambd, lambd], 0 inside, bounds included as torch.
    x = ctx.inputs[0]
    lambd = ctx.node.attributes.get_float("lambd", 0.5)

    def grad() -> ir.Value:
        outside = ctx.op("Greater", [ctx.op("Abs", [x]), ctx.scalar(lambd, like=x)])
        return dy_where(ctx, outside)

    return ctx.wanted_grads(grad)
