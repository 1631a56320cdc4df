"""Elementwise ops (arithmetic, Reciprocal, Sin, Cos, ...). Binary ones broadcast, so each input
gradient goes through `unbroadcast`."""

from __future__ import annotations

import onnx_ir as ir

from transpiler.autodiff._context import RuleContext, unbroadcast
from transpiler.autodiff._registry import linear, register, unary_from_output
from transpiler.autodiff.rules.activations import erf_gelu_grads, erf_gelu_operand


@register("Add")
def _add(ctx: RuleContext) -> list[ir.Value | None]:
    a, b = ctx.inputs
    return ctx.wanted_grads(lambda: unbroadcast(ctx, ctx.dy, a), lambda: unbroadcast(ctx, ctx.dy, b))


@register("Sub")
def _sub(ctx: RuleContext) -> list[ir.Value | None]:
    a, b = ctx.inputs
    # Negating after the reduction touches fewer elements than before it.
    return ctx.wanted_grads(
        lambda: unbroadcast(ctx, ctx.dy, a),
        lambda: ctx.op("Neg", [unbroadcast(ctx, ctx.dy, b)], like=b),
    )


@register("Mul")
def _mul(ctx: RuleContext) -> list[ir.Value | None]:
    gelu = erf_gelu_operand(ctx)
    if gelu is not None:  # x * (1 + erf(x / sqrt 2)): the exact GELU's core, differentiated whole
        return erf_gelu_grads(ctx, gelu)
    a, b = ctx.inputs
    y = ctx.output
    return ctx.wanted_grads(
        lambda: unbroadcast(ctx, ctx.op("Mul", [ctx.dy, b], like=y), a),
        lambda: unbroadcast(ctx, ctx.op("Mul", [ctx.dy, a], like=y), b),
    )


@register("Div")
def _div(ctx: RuleContext) -> list[ir.Value | None]:
    a, b = ctx.inputs
    y = ctx.output

    def grad_b() -> ir.Value:
        # d(a/b)/db = -a/b^2 = -y/b: reuses the output instead of squaring b.
        dy_y_over_b = ctx.op("Div", [ctx.op("Mul", [ctx.dy, y]), b], like=y)
        return ctx.op("Neg", [unbroadcast(ctx, dy_y_over_b, b)], like=b)

    return ctx.wanted_grads(lambda: unbroadcast(ctx, ctx.op("Div", [ctx.dy, b], like=y), a), grad_b)


@register("Pow")
def _pow(ctx: RuleContext) -> list[ir.Value | None]:
    base, exponent = ctx.inputs
    y = ctx.output

    def grad_base() -> ir.Value:
        # ONNX allows an integer exponent with a float base; compute in the base's type.
        e = exponent
        if exponent.dtype != base.dtype:
            e = ctx.op("Cast", [exponent], {"to": ctx.dtype(base)})
        # b * a^(b-1) rather than b * y / a, which is 0/0 at a = 0.
        e_minus_1 = ctx.op("Sub", [e, ctx.scalar(1, like=base)])
        local = ctx.op("Mul", [e, ctx.op("Pow", [base, e_minus_1])])
        return unbroadcast(ctx, ctx.op("Mul", [ctx.dy, local], like=y), base)

    def grad_exponent() -> ir.Value:
        local = ctx.op("Mul", [y, ctx.op("Log", [base])])
        return unbroadcast(ctx, ctx.op("Mul", [ctx.dy, local], like=y), exponent)

    return ctx.wanted_grads(grad_base, grad_exponent)


@register("Where", inputs=(1, 2))
def _where(ctx: RuleContext) -> list[ir.Value | None]:
    condition, a, b = ctx.inputs
    y = ctx.output
    zero = ctx.scalar(0, like=y)
    return ctx.wanted_grads(
        lambda: None,
        lambda: unbroadcast(ctx, ctx.op("Where", [condition, ctx.dy, zero], like=y), a),
        lambda: unbroadcast(ctx, ctx.op("Where", [condition, zero, ctx.dy], like=y), b),
    )


@linear("Identity")
def _identity(ctx: RuleContext, dy: ir.Value) -> ir.Value:
    return dy


@linear("Neg")
def _neg(ctx: RuleContext, dy: ir.Value) -> ir.Value:
    return ctx.op("Neg", [dy], like=ctx.output)


@linear("Cast", "CastLike")
def _cast(ctx: RuleContext, dy: ir.Value) -> ir.Value:
    # Only reached for float -> float casts: non-float values carry no gradient, so the backward
    # never asks for one through an int or bool cast.
    x = ctx.inputs[0]
    # A float32 dy that is a bf16/fp16 value widened (the backward of a cast down, --precision):
    # cast back to that dtype it is that value, exactly, so it is returned without the round trip.
    source = dy.producer()
    if (source is not None and source.op_type == "Cast" and source.domain in ("", "ai.onnx")
            and dy.dtype == ir.DataType.FLOAT and source.inputs[0] is not None
            and source.inputs[0].dtype == ctx.dtype(x) in (ir.DataType.BFLOAT16, ir.DataType.FLOAT16)):
        return source.inputs[0]
    return ctx.op("Cast", [dy], {"to": ctx.dtype(x)}, like=x)


@register("Log", inputs=(0,))
def _log(ctx: RuleContext) -> list[ir.Value | None]:
    x = ctx.inputs[0]
    return ctx.wanted_grads(lambda: ctx.op("Div", [ctx.dy, x], like=x))


@unary_from_output("Exp")
def _exp(ctx: RuleContext, y: ir.Value) -> ir.Value:
    return y


@unary_from_output("Sqrt")
def _sqrt(ctx: RuleContext, y: ir.Value) -> ir.Value:
    return ctx.op("Div", [ctx.scalar(0.5, like=y), y])


@register("Relu", inputs=(0,))
def _relu(ctx: RuleContext) -> list[ir.Value | None]:
    # dy where the output is positive, else 0 (the subgradient at 0 is taken as 0, as PyTorch's
    # threshold_backward does): two kernels (Greater, Where) rather than a mask Cast and a Mul.
    y = ctx.output
    zero = ctx.scalar(0, like=y)
    return ctx.wanted_grads(lambda: ctx.op("Where", [ctx.op("Greater", [y, zero]), ctx.dy, zero], like=y))


@unary_from_output("Tanh")
def _tanh(ctx: RuleContext, y: ir.Value) -> ir.Value:
    return ctx.op("Sub", [ctx.scalar(1, like=y), ctx.op("Mul", [y, y])])


@unary_from_output("Sigmoid")
def _sigmoid(ctx: RuleContext, y: ir.Value) -> ir.Value:
    return ctx.op("Mul", [y, ctx.op("Sub", [ctx.scalar(1, like=y), y])])


@register("Sum")
def _sum(ctx: RuleContext) -> list[ir.Value | None]:
    # Variadic and broadcasting: every input gets dy summed back to its shape.
    return ctx.wanted_grads(*(lambda x=x: unbroadcast(ctx, ctx.dy, x) for x in ctx.inputs))


@register("Mean")
def _mean(ctx: RuleContext) -> list[ir.Value | None]:
    y = ctx.output
    share = ctx.op("Div", [ctx.dy, ctx.scalar(len(ctx.inputs), like=y)], like=y)
    return ctx.wanted_grads(*(lambda x=x: unbroadcast(ctx, share, x) for x in ctx.inputs))


@unary_from_output("Reciprocal")
def _reciprocal(ctx: RuleContext, y: ir.Value) -> ir.Value:
    # d(1/x)/dx = -1/x^2 = -y^2
    return ctx.op("Neg", [ctx.op("Mul", [y, y])])


@register("Sin")
def _sin(ctx: RuleContext) -> list[ir.Value | None]:
    x = ctx.inputs[0]
    return ctx.wanted_grads(lambda: ctx.op("Mul", [ctx.dy, ctx.op("Cos", [x])], like=x))


@register("Cos")
def _cos(ctx: RuleContext) -> list[ir.Value | None]:
    x = ctx.inputs[0]
    return ctx.wanted_grads(lambda: ctx.op("Neg", [ctx.op("Mul", [ctx.dy, ctx.op("Sin", [x])])], like=x))
