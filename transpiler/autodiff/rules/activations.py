"""Activations and piecewise functions: Softmax/LogSoftmax (from the output), Erf, Gelu, Abs, Clip,
LeakyRelu, HardSigmoid, HardSwish, and the variadic Max/Min."""

from __future__ import annotations

import math
import re

import numpy as np
import onnx_ir as ir

from transpiler.autodiff._context import RuleContext, producer_of, same_dim, unbroadcast
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
        dot = _attention_row_dot(ctx, y, axis)
        if dot is None:
            dot = ctx.op("ReduceSum", [ctx.op("Mul", [ctx.dy, y]), axis], {"keepdims": 1})
        return ctx.op("Mul", [y, ctx.op("Sub", [ctx.dy, dot])], like=y)

    return ctx.wanted_grads(grad)


def _attention_row_dot(ctx: RuleContext, y: ir.Value, axis: ir.Value) -> ir.Value | None:
    """sum(dy * y) over the last axis, taken on the attention output instead of the scores.

    When the softmax's only reader is O = MatMul(y, V) and dy = dO @ V^T came from that MatMul's
    rule, sum_j y_ij dy_ij = sum_d dO_id O_id (FlashAttention's D): two passes over the
    [..., T, head_dim] output replace two over the [..., T, T] probabilities (8x smaller for
    GPT-2's T=512, head_dim=64). None where the pattern does not hold.
    """
    rank = y.shape.rank() if y.shape is not None else None
    uses = ctx.forward_uses(y)
    if rank is None or rank < 2 or _softmax_axis(ctx) not in (-1, rank - 1) or len(uses) != 1:
        return None
    matmul, slot = uses[0].node, uses[0].idx
    if matmul.op_type != "MatMul" or matmul.domain not in ("", "ai.onnx") or slot != 0:
        return None
    product = ctx.backward_producer(ctx.dy)
    if product is None or product.op_type != "MatMul" or len(product.inputs) != 2:
        return None
    swapped = producer_of(product.inputs[1], "Transpose")
    perm = [*range(rank - 2), rank - 1, rank - 2]
    v, out = matmul.inputs[1], matmul.outputs[0]
    if (swapped is None or swapped.inputs[0] is not v
            or v.shape is None or v.shape.rank() != rank
            or list(swapped.attributes.get_ints("perm", [])) != perm):
        return None
    d_out = product.inputs[0]
    return ctx.op("ReduceSum", [ctx.op("Mul", [d_out, out], like=out), axis], {"keepdims": 1})


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


def dy_where(ctx: RuleContext, mask: ir.Value) -> ir.Value:
    """dy where ``mask``, else 0: the gradient of a piecewise identity."""
    x = ctx.inputs[0]
    return ctx.op("Where", [mask, ctx.dy, ctx.scalar(0, like=x)], like=x)


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


# The exporters' exact GELU below opset 20: y = Mul(Mul(x, Add(Erf(Div(x, sqrt 2)), 1)), 0.5).
_SQRT2 = math.sqrt(2.0)


def _scalar_const(value: ir.Value | None) -> float | None:
    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    array = tensor.numpy()
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def _is_near(ctx: RuleContext, value: ir.Value | None, target: float) -> bool:
    """``value`` is a constant ``target``: a trained initializer (one the backward differentiates)
    is no constant here, its gradient must not be folded away."""
    number = _scalar_const(value)
    return number is not None and not ctx.differentiated(value) and math.isclose(number, target, rel_tol=1e-6)


def _erf_argument_is(ctx: RuleContext, value: ir.Value, x: ir.Value) -> bool:
    """``value`` is x / sqrt(2), written as Div(x, sqrt 2) or Mul(x, 1/sqrt 2) in either order."""
    div = producer_of(value, "Div")
    if div is not None:
        return div.inputs[0] is x and _is_near(ctx, div.inputs[1], _SQRT2)
    mul = producer_of(value, "Mul")
    return mul is not None and any(
        mul.inputs[i] is x and _is_near(ctx, mul.inputs[1 - i], 1 / _SQRT2) for i in (0, 1))


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
    return a.shape is not None and b.shape is not None and a.shape.rank() == b.shape.rank() and all(
        same_dim(p, q) for p, q in zip(a.shape, b.shape))


def erf_gelu_operand(ctx: RuleContext) -> int | None:
    """The index of x when the node is Mul(x, 1 + erf(x / sqrt 2)) (either order) with constants
    that are not trained and that broadcast nothing (the product is shaped like x), else None."""
    node = ctx.node
    if node.op_type != "Mul" or len(node.inputs) != 2:
        return None
    for index in (0, 1):
        x, factor = node.inputs[index], node.inputs[1 - index]
        add = producer_of(factor, "Add")
        if x is None or add is None or not _same_shape(x, node.outputs[0]):
            continue
        for j in (0, 1):
            erf = producer_of(add.inputs[j], "Erf")
            if erf is not None and _is_near(ctx, add.inputs[1 - j], 1.0) and _erf_argument_is(ctx, erf.inputs[0], x):
                return index
    return None


def erf_gelu_grads(ctx: RuleContext, index: int) -> list[ir.Value | None]:
    """Gradients of z = x * (1 + erf(x / sqrt 2)) (the exact GELU is z / 2): all of it to x.

    dz/dx = (1 + erf(x / sqrt 2)) + x sqrt(2/pi) exp(-x^2 / 2), computed from x alone, so the
    forward's intermediates (x / sqrt 2, erf, 1 + erf) are not kept alive until the backward (as
    PyTorch keeps only GELU's input) and the forward chain can run as one GELU kernel
    (runtime/gpu/lowering.py). The factor's slot gets None: the path through it is inside dz/dx.
    Nine backward ops, as many as the chain's own rules wrote while reading the kept values.
    """
    x = ctx.inputs[index]

    def c(number: float) -> ir.Value:
        return ctx.scalar(number, like=x)

    def grad() -> ir.Value:
        u = ctx.op("Mul", [x, c(1 / _SQRT2)])
        cdf2 = ctx.op("Add", [ctx.op("Erf", [u]), c(1.0)])
        # sqrt(2/pi) exp(-u^2) as one Exp: exp(log sqrt(2/pi) - u^2).
        pdf = ctx.op("Exp", [ctx.op("Sub", [c(0.5 * math.log(2 / math.pi)), ctx.op("Mul", [u, u])])])
        local = ctx.op("Add", [cdf2, ctx.op("Mul", [x, pdf])])
        return ctx.op("Mul", [ctx.dy, local], like=x)

    grads: list[ir.Value | None] = [None, None]
    if ctx.wants(index):
        grads[index] = grad()
    return grads


@register("Abs")
def _abs(ctx: RuleContext) -> list[ir.Value | None]:
    # Sign(0) = 0: the subgradient at 0 is 0, as in PyTorch.
    return ctx.wanted_grads(lambda: _mul_dy(ctx, ctx.op("Sign", [ctx.inputs[0]])))


# PyTorch has two backward conventions for what every exporter writes as one Clip: hardtanh's
# (nn.ReLU6, F.relu6, nn.Hardtanh, F.hardtanh) passes the gradient strictly inside the bounds,
# clamp's (torch.clamp, clamp_min/clamp_max) on the closed interval. They differ only where x sits
# exactly on a bound (a BatchNorm channel that is constant over the batch normalizes to exactly its
# bias, 0 at initialization: then ReLU6's input is exactly 0).
_ATEN_OP = re.compile(r"aten\.(\w+?)_?\.")


def _clip_is_hardtanh(ctx: RuleContext) -> bool:
    """Whether this Clip is torch's hardtanh (gradient strictly inside the bounds).

    dynamo names the aten op in the node's metadata: ``aten.hardtanh``/``aten.relu6`` or
    ``aten.clamp``. TorchScript's hardtanh symbolic feeds Constant nodes straight in as the bounds,
    its clamp (which F.relu6 exports through) casts them first: a Clip(0, 6) is taken as ReLU6
    whatever its form (torch.clamp(x, 0, 6) from TorchScript cannot be told from F.relu6).
    """
    node = ctx.node
    origin = node.metadata_props.get("pkg.torch.onnx.class_hierarchy", "") or node.metadata_props.get("namespace", "")
    ops = _ATEN_OP.findall(origin)
    if ops:
        return ops[-1] in ("hardtanh", "relu6")
    bounds = [_clip_bound(ctx, i) for i in (1, 2)]
    if all(b is not None and b.size == 1 for b in bounds) and [float(b.reshape(-1)[0]) for b in bounds] == [0.0, 6.0]:
        return True
    return all(ctx.has_input(i) and producer_of(ctx.inputs[i], "Constant") is not None for i in (1, 2))


def _clip_bound(ctx: RuleContext, index: int) -> np.ndarray | None:
    """Bound ``index`` (1: min, 2: max) as an array when it is a constant."""
    value = ctx.inputs[index] if ctx.has_input(index) else None
    while value is not None:  # through the exporters' Cast/CastLike of a constant
        tensor = ir.convenience.get_const_tensor(value)
        if tensor is not None:
            return tensor.numpy()
        producer = value.producer()
        value = producer.inputs[0] if producer is not None and producer.op_type in ("Cast", "CastLike") else None
    return None


@register("Clip", inputs=(0,))
def _clip(ctx: RuleContext) -> list[ir.Value | None]:
    # Gradient where min <= x <= max (torch.clamp), or min < x < max (torch's hardtanh: see
    # _clip_is_hardtanh); min/max get none.
    x = ctx.inputs[0]
    strict = _clip_is_hardtanh(ctx)

    def grad() -> ir.Value:
        inside = None
        for index, compare in ((1, "Greater" if strict else "GreaterOrEqual"), (2, "Less" if strict else "LessOrEqual")):
            if not ctx.has_input(index):
                continue
            test = ctx.op(compare, [x, ctx.inputs[index]])
            inside = test if inside is None else ctx.op("And", [inside, test])
        if inside is None:
            return ctx.dy
        return dy_where(ctx, inside)

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
