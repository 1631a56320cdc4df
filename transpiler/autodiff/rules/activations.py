"""Activations and piecewise functions: Softmax/LogSoftmax (from the output), Erf, Gelu, Abs, Clip,
LeakyRelu, HardSigmoid, HardSwish, and the variadic Max/Min."""

from __future__ import annotations

import math

import onnx_ir as ir

from transpiler.autodiff._context import RuleContext, unbroadcast
from transpiler.autodiff._registry import register


def _softmax_axis(ctx: RuleContext) -> int:
    # Opset >= 13: one axis, default -1 (the old "flatten from axis" form is opset < 13).
    return ctx.node.attributes.get_int("axis", -1)


@register("Softmax")
def _softmax(ctx: RuleContext) -> list[ir.Value | None]:
    # dx = y * (dy - sum(dy * y, axis))
    y = ctx.output

    def grad() -> ir.Value:
        axis = ctx.const([_softmax_axis(ctx)])
        dot = ctx.op("ReduceSum", [ctx.op("Mul", [ctx.dy, y]), axis], {"keepdims": 1})
        return ctx.op("Mul", [y, ctx.op("Sub", [ctx.dy, dot])], like=y)

    return ctx.wanted_grads(grad)


@register("LogSoftmax")
def _log_softmax(ctx: RuleContext) -> list[ir.Value | None]:
    # dx = dy - softmax * sum(dy, axis), softmax = exp(y)
    y = ctx.output

    def grad() -> ir.Value:
        total = ctx.op("ReduceSum", [ctx.dy, ctx.const([_softmax_axis(ctx)])], {"keepdims": 1})
        return ctx.op("Sub", [ctx.dy, ctx.op("Mul", [ctx.op("Exp", [y]), total])], like=y)

    return ctx.wanted_grads(grad)


def _mul_dy(ctx: RuleContext, local: ir.Value) -> ir.Value:
    return ctx.op("Mul", [ctx.dy, local], like=ctx.inputs[0])


@register("Erf")
def _erf(ctx: RuleContext) -> list[ir.Value | None]:
    x = ctx.inputs[0]

    def grad() -> ir.Value:
        gauss = ctx.op("Exp", [ctx.op("Neg", [ctx.op("Mul", [x, x])])])
        return _mul_dy(ctx, ctx.op("Mul", [gauss, ctx.scalar(2 / math.sqrt(math.pi), like=x)]))

    return ctx.wanted_grads(grad)


@register("Gelu")
def _gelu(ctx: RuleContext) -> list[ir.Value | None]:
    x = ctx.inputs[0]
    approximate = ctx.node.attributes.get_string("approximate", "none")

    def c(number: float) -> ir.Value:
        return ctx.scalar(number, like=x)

    def grad() -> ir.Value:
        if approximate == "tanh":
            # y = x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)
            # y' = (1 + t)/2 + x/2 (1 - t^2) sqrt(2/pi) (1 + 3*0.044715 x^2)
            k = math.sqrt(2 / math.pi)
            x2 = ctx.op("Mul", [x, x])
            inner = ctx.op("Mul", [x, ctx.op("Add", [c(1.0), ctx.op("Mul", [x2, c(0.044715)])])])
            t = ctx.op("Tanh", [ctx.op("Mul", [inner, c(k)])])
            du = ctx.op("Mul", [ctx.op("Add", [c(1.0), ctx.op("Mul", [x2, c(3 * 0.044715)])]), c(k)])
            sech2 = ctx.op("Sub", [c(1.0), ctx.op("Mul", [t, t])])
            half_x = ctx.op("Mul", [x, c(0.5)])
            local = ctx.op(
                "Add",
                [
                    ctx.op("Mul", [ctx.op("Add", [c(1.0), t]), c(0.5)]),
                    ctx.op("Mul", [half_x, ctx.op("Mul", [sech2, du])]),
                ],
            )
        elif approximate == "none":
            # y' = Phi(x) + x phi(x)
            cdf = ctx.op(
                "Mul",
                [ctx.op("Add", [c(1.0), ctx.op("Erf", [ctx.op("Mul", [x, c(1 / math.sqrt(2))])])]), c(0.5)],
            )
            pdf = ctx.op(
                "Mul",
                [
                    ctx.op("Exp", [ctx.op("Mul", [ctx.op("Mul", [x, x]), c(-0.5)])]),
                    c(1 / math.sqrt(2 * math.pi)),
                ],
            )
            local = ctx.op("Add", [cdf, ctx.op("Mul", [x, pdf])])
        else:
            raise ctx.error(f"unknown approximate={approximate!r}")
        return _mul_dy(ctx, local)

    return ctx.wanted_grads(grad)


@register("Abs")
def _abs(ctx: RuleContext) -> list[ir.Value | None]:
    # Sign(0) = 0: the subgradient at 0 is 0, as in PyTorch.
    return ctx.wanted_grads(lambda: _mul_dy(ctx, ctx.op("Sign", [ctx.inputs[0]])))


@register("Clip", inputs=(0,))
def _clip(ctx: RuleContext) -> list[ir.Value | None]:
    # Gradient where min <= x <= max (bounds included, as torch.clamp); min/max get none.
    x = ctx.inputs[0]

    def grad() -> ir.Value:
        inside = None
        for index, compare in ((1, "GreaterOrEqual"), (2, "LessOrEqual")):
            if ctx.has_input(index):
                test = ctx.op(compare, [x, ctx.inputs[index]])
                inside = test if inside is None else ctx.op("And", [inside, test])
        if inside is None:
            return ctx.dy
        return ctx.op("Where", [inside, ctx.dy, ctx.scalar(0, like=x)], like=x)

    return ctx.wanted_grads(grad)


@register("LeakyRelu")
def _leaky_relu(ctx: RuleContext) -> list[ir.Value | None]:
    x = ctx.inputs[0]
    alpha = ctx.node.attributes.get_float("alpha", 0.01)

    def grad() -> ir.Value:
        scaled = ctx.op("Mul", [ctx.dy, ctx.scalar(alpha, like=x)])
        return ctx.op("Where", [ctx.op("Greater", [x, ctx.scalar(0, like=x)]), ctx.dy, scaled], like=x)

    return ctx.wanted_grads(grad)


def _extremum(ctx: RuleContext) -> list[ir.Value | None]:
    # Each input gets dy where it equals the result; tied inputs share it equally (torch.maximum /
    # torch.minimum give each of two tied inputs half). Then unbroadcast to the input's shape.
    y, xs = ctx.output, list(ctx.inputs)
    if len(xs) == 1:
        return ctx.wanted_grads(lambda: ctx.dy)
    dtype = ctx.dtype(y)
    hits = [ctx.op("Cast", [ctx.op("Equal", [x, y])], {"to": dtype}) for x in xs]
    share = ctx.op("Div", [ctx.dy, ctx.op("Sum", hits)])
    return ctx.wanted_grads(
        *(
            lambda x=x, hit=hit: unbroadcast(ctx, ctx.op("Mul", [share, hit], like=y), x)
            for x, hit in zip(xs, hits)
        )
    )


register("Max")(_extremum)
register("Min")(_extremum)


@register("HardSigmoid")
def _hard_sigmoid(ctx: RuleContext) -> list[ir.Value | None]:
    # y = max(0, min(1, alpha x + beta)): alpha dy strictly inside the linear part (0 < y < 1), as
    # torch's hardsigmoid_backward (-3 < x < 3 for alpha 1/6, beta 1/2), else 0.
    y = ctx.output
    alpha = ctx.node.attributes.get_float("alpha", 0.2)

    def grad() -> ir.Value:
        zero = ctx.scalar(0, like=y)
        inside = ctx.op("And", [ctx.op("Greater", [y, zero]), ctx.op("Less", [y, ctx.scalar(1, like=y)])])
        return ctx.op("Where", [inside, ctx.op("Mul", [ctx.dy, ctx.scalar(alpha, like=y)]), zero], like=y)

    return ctx.wanted_grads(grad)


@register("HardSwish")
def _hard_swish(ctx: RuleContext) -> list[ir.Value | None]:
    # y = x max(0, min(1, x/6 + 1/2)); y' = 0 for x < -3, x/3 + 1/2 for -3 <= x <= 3, 1 above: the
    # branches and bounds of torch's hardswish_backward.
    x = ctx.inputs[0]

    def grad() -> ir.Value:
        def c(number: float) -> ir.Value:
            return ctx.scalar(number, like=x)

        middle = ctx.op("Add", [ctx.op("Div", [x, c(3.0)]), c(0.5)])
        upper = ctx.op("Where", [ctx.op("LessOrEqual", [x, c(3.0)]), middle, c(1.0)])
        local = ctx.op("Where", [ctx.op("Less", [x, c(-3.0)]), c(0.0), upper])
        return _mul_dy(ctx, local)

    return ctx.wanted_grads(grad)
