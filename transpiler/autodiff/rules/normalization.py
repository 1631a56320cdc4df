"""LayerNormalization (from its Mean/InvStdDev outputs; over the last axis in float32, one LayerNormGrad
node), RMSNormalization (statistics recomputed), Dropout (from its mask output), InstanceNormalization
and GroupNormalization (statistics recomputed). BatchNormalization: batchnorm.py."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from contract.ops import LAYERNORM_DOMAIN, LAYERNORM_GRAD
from transpiler.autodiff._context import RuleContext, annotate, unbroadcast
from transpiler.autodiff._registry import register
from transpiler.autodiff.rules._native_node import grad_node

_PRECISION = {ir.DataType.BFLOAT16: 0, ir.DataType.FLOAT16: 1, ir.DataType.FLOAT: 2, ir.DataType.DOUBLE: 3}


@register("LayerNormalization")
def _layer_norm(ctx: RuleContext) -> list[ir.Value | None]:
    # xhat = (x - mean) * inv_std; y = xhat * scale + bias.
    # dx = inv_std * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * scale, means over the
    # normalized axes; dscale = sum(dy * xhat), dbias = sum(dy) over the leading axes.
    x, scale = ctx.inputs[0], ctx.inputs[1]
    if any(dy is not None for dy in ctx.dys[1:]):
        raise ctx.error("gradients through the Mean/InvStdDev outputs are not supported")
    rank = ctx.rank(x)
    attributes = ctx.node.attributes
    axis = attributes.get_int("axis", -1) % rank
    epsilon = attributes.get_float("epsilon", 1e-5)
    dtype = ctx.dtype(x)
    stash = ir.DataType(attributes.get_int("stash_type", 1))
    axes = ctx.const(list(range(axis, rank)))
    dy = ctx.dy
    cache: dict[str, ir.Value] = {}

    def statistics() -> tuple[ir.Value, ir.Value]:
        if "xhat" in cache:
            return cache["xhat"], cache["inv"]
        stat_shape = None if x.shape is None else [*list(x.shape)[:axis], *([1] * (rank - axis))]
        if _PRECISION.get(stash, 0) < _PRECISION.get(dtype, 0):
            # The stashed statistics are less precise than x (float64 input, float32 stash):
            # recompute them in x's precision.
            mean = ctx.op("ReduceMean", [x, axes], {"keepdims": 1})
            centered = ctx.op("Sub", [x, mean])
            var = ctx.op("ReduceMean", [ctx.op("Mul", [centered, centered]), axes], {"keepdims": 1})
            inv = ctx.op("Reciprocal", [ctx.op("Sqrt", [ctx.op("Add", [var, ctx.scalar(epsilon, like=x)])])])
        else:
            mean = ctx.forward_output(1, "mean", stash, stat_shape)
            inv = ctx.forward_output(2, "inv_std_dev", stash, stat_shape)
            if stash != dtype:
                mean = ctx.op("Cast", [mean], {"to": dtype})
                inv = ctx.op("Cast", [inv], {"to": dtype})
            centered = ctx.op("Sub", [x, mean])
        cache["xhat"] = ctx.op("Mul", [centered, inv], like=x)
        cache["inv"] = inv
        return cache["xhat"], inv

    bias = ctx.inputs[2] if len(ctx.inputs) > 2 else None
    if _layer_norm_node_applies(ctx, x, scale, bias, axis, rank, stash):
        # One LayerNormGrad node (transpiler/layernorm_ops.py) from the saved statistics.
        stat_shape = None if x.shape is None else [*list(x.shape)[:axis], 1]
        mean = ctx.forward_output(1, "mean", stash, stat_shape)
        inv = ctx.forward_output(2, "inv_std_dev", stash, stat_shape)
        return grad_node(ctx, LAYERNORM_DOMAIN, LAYERNORM_GRAD, [dy, x, scale, mean, inv], {},
                         (x, scale, scale if bias is None else bias))

    def grad_x() -> ir.Value:
        xhat, inv = statistics()
        g = ctx.op("Mul", [dy, scale], like=x)
        mean_g = ctx.op("ReduceMean", [g, axes], {"keepdims": 1})
        mean_gx = ctx.op("ReduceMean", [ctx.op("Mul", [g, xhat]), axes], {"keepdims": 1})
        inner = ctx.op("Sub", [ctx.op("Sub", [g, mean_g]), ctx.op("Mul", [xhat, mean_gx])])
        return ctx.op("Mul", [inner, inv], like=x)

    def grad_scale() -> ir.Value:
        xhat, _ = statistics()
        return unbroadcast(ctx, ctx.op("Mul", [dy, xhat], like=x), scale)

    return ctx.wanted_grads(grad_x, grad_scale, lambda: unbroadcast(ctx, dy, ctx.inputs[2]))


def _layer_norm_node_applies(ctx: RuleContext, x: ir.Value, scale: ir.Value, bias: ir.Value | None, axis: int,
                             rank: int, stash: ir.DataType) -> bool:
    """Whether the gradient is one LayerNormGrad node: float32 x and statistics, normalized over the
    last axis only, a (C,) scale and no bias or a (C,) one (the node's contract, contract/ops.py:
    its dB is (C,)); else the standard-op form (a bias of shape (1,) or () gets its own sum)."""
    def per_channel(value: ir.Value) -> bool:
        return value.shape is not None and value.shape.rank() == 1 and value.shape[0] == x.shape[-1]

    return (ctx.dtype(x) == ir.DataType.FLOAT and stash == ir.DataType.FLOAT and axis == rank - 1
            and x.shape is not None and per_channel(scale) and (bias is None or per_channel(bias)))


@register("RMSNormalization")
def _rms_norm(ctx: RuleContext) -> list[ir.Value | None]:
    # Opset 23 (dynamo writes it for torch.nn.RMSNorm): y = x * inv * scale, inv = 1/sqrt(mean(x^2) + eps)
    # over the axes from ``axis`` on. With xhat = x * inv and g = dy * scale:
    # dx = inv * (g - xhat * mean(g * xhat)); dscale = sum(dy * xhat) over the broadcast axes.
    # The statistics are recomputed in x's precision (the node has no statistics outputs).
    x, scale = ctx.inputs[0], ctx.inputs[1]
    rank = ctx.rank(x)
    attributes = ctx.node.attributes
    axes = ctx.const(list(range(attributes.get_int("axis", -1) % rank, rank)))
    epsilon = attributes.get_float("epsilon", 1e-5)
    dy = ctx.dy
    cache: dict[str, ir.Value] = {}

    def statistics() -> tuple[ir.Value, ir.Value]:
        if "xhat" not in cache:
            mean_square = ctx.op("ReduceMean", [ctx.op("Mul", [x, x]), axes], {"keepdims": 1})
            inv = ctx.op("Reciprocal", [ctx.op("Sqrt", [ctx.op("Add", [mean_square, ctx.scalar(epsilon, like=x)])])])
            cache["inv"], cache["xhat"] = inv, ctx.op("Mul", [x, inv], like=x)
        return cache["xhat"], cache["inv"]

    def grad_x() -> ir.Value:
        xhat, inv = statistics()
        g = ctx.op("Mul", [dy, scale], like=x)
        mean_gx = ctx.op("ReduceMean", [ctx.op("Mul", [g, xhat]), axes], {"keepdims": 1})
        return ctx.op("Mul", [ctx.op("Sub", [g, ctx.op("Mul", [xhat, mean_gx])]), inv], like=x)

    def grad_scale() -> ir.Value:
        xhat, _ = statistics()
        return unbroadcast(ctx, ctx.op("Mul", [dy, xhat], like=x), scale)

    return ctx.wanted_grads(grad_x, grad_scale)


@register("Dropout", inputs=(0,))
def _dropout(ctx: RuleContext) -> list[ir.Value | None]:
    # Training: y = x * mask / (1 - ratio), so dx = dy * mask / (1 - ratio). Inference (no or false
    # training_mode) and ratio 0: identity.
    x = ctx.inputs[0]
    training = ctx.const_input(2)
    ratio = ctx.const_input(1)
    if not ctx.has_input(2) or (training is not None and not bool(training)):
        return ctx.wanted_grads(lambda: ctx.dy)
    if ratio is not None and float(ratio) == 0.0:
        return ctx.wanted_grads(lambda: ctx.dy)

    def grad() -> ir.Value:
        mask = ctx.forward_output(1, "mask", ir.DataType.BOOL, x.shape)
        if ratio is not None:
            keep = ctx.scalar(1.0 / (1.0 - float(ratio)), like=x)
        elif ctx.has_input(1):
            ratio_x = ctx.op("Cast", [ctx.inputs[1]], {"to": ctx.dtype(x)})
            keep = ctx.op("Reciprocal", [ctx.op("Sub", [ctx.scalar(1, like=x), ratio_x])])
        else:
            keep = ctx.scalar(2.0, like=x)  # default ratio 0.5
        zero = ctx.const(np.array(0, dtype=ctx.dtype(x).numpy()))
        kept = ctx.op("Where", [mask, ctx.op("Mul", [ctx.dy, keep]), zero], like=x)
        if training is None:  # training_mode fed at run time
            return ctx.op("Where", [ctx.inputs[2], kept, ctx.dy], like=x)
        return kept

    return ctx.wanted_grads(grad)


# ---------------------------------------------------------------------------------------------
# InstanceNormalization, GroupNormalization (how the exporters write torch's GroupNorm)


def _normalized_grad(ctx: RuleContext, x: ir.Value, g: ir.Value, axes: ir.Value, epsilon: float,
                     dtype_of: ir.Value):
    """(xhat, dx) of xhat = (x - mean) / sqrt(var + eps) over ``axes`` with output gradient ``g``:
    dx = inv_std * (g - mean(g) - xhat * mean(g * xhat)). The statistics are recomputed in the
    type of ``dtype_of`` (x itself may be an unannotated view)."""
    mean = ctx.op("ReduceMean", [x, axes], {"keepdims": 1})
    centered = ctx.op("Sub", [x, mean])
    var = ctx.op("ReduceMean", [ctx.op("Mul", [centered, centered]), axes], {"keepdims": 1})
    inv = ctx.op("Reciprocal", [ctx.op("Sqrt", [ctx.op("Add", [var, ctx.scalar(epsilon, like=dtype_of)])])])
    xhat = ctx.op("Mul", [centered, inv])
    mean_g = ctx.op("ReduceMean", [g, axes], {"keepdims": 1})
    mean_gx = ctx.op("ReduceMean", [ctx.op("Mul", [g, xhat]), axes], {"keepdims": 1})
    inner = ctx.op("Sub", [ctx.op("Sub", [g, mean_g]), ctx.op("Mul", [xhat, mean_gx])])
    return xhat, ctx.op("Mul", [inner, inv])


def _per_channel(ctx: RuleContext, value: ir.Value, rank: int) -> ir.Value:
    """A (C,) vector viewed as (C, 1, ...) to broadcast over an (N, C, ...) tensor."""
    return ctx.op("Unsqueeze", [value, ctx.const(list(range(1, rank - 1)))]) if rank > 2 else value


@register("InstanceNormalization")
def _instance_norm(ctx: RuleContext) -> list[ir.Value | None]:
    # y = xhat * scale[c] + B[c], xhat normalized over the spatial axes of each (n, c).
    x, scale, bias = ctx.inputs
    rank = ctx.rank(x)
    if rank < 3:
        raise ctx.error("the input must be (N, C, D1, ...)")
    epsilon = ctx.node.attributes.get_float("epsilon", 1e-5)
    spatial = ctx.const(list(range(2, rank)))
    outer = ctx.const([0, *range(2, rank)])
    cache: dict[str, ir.Value] = {}

    def both() -> tuple[ir.Value, ir.Value]:
        if not cache:
            g = ctx.op("Mul", [ctx.dy, _per_channel(ctx, scale, rank)], like=x)
            cache["xhat"], dx = _normalized_grad(ctx, x, g, spatial, epsilon, x)
            annotate(cache["xhat"], x)
            annotate(dx, x)
            cache["dx"] = dx
        return cache["xhat"], cache["dx"]

    return ctx.wanted_grads(
        lambda: both()[1],
        lambda: ctx.op("ReduceSum", [ctx.op("Mul", [ctx.dy, both()[0]]), outer], {"keepdims": 0}, like=scale),
        lambda: ctx.op("ReduceSum", [ctx.dy, outer], {"keepdims": 0}, like=bias),
    )


@register("GroupNormalization")
def _group_norm(ctx: RuleContext) -> list[ir.Value | None]:
    # x (N, C, ...) viewed as (N, G, C/G * D1 * ...) and normalized over the last axis; scale and
    # bias per channel (opset 21; opset 18's per-group form is deprecated, onnx.checker rejects it).
    x, scale, bias = ctx.inputs
    rank = ctx.rank(x)
    groups = ctx.node.attributes.get_int("num_groups", 0)
    epsilon = ctx.node.attributes.get_float("epsilon", 1e-5)
    if groups <= 0:
        raise ctx.error("num_groups must be positive")
    grouped_shape = ctx.const([0, groups, -1])
    full_shape = ctx.shape_of(x)
    last = ctx.const([2])
    cache: dict[str, ir.Value] = {}

    def grouped(value: ir.Value) -> ir.Value:
        return ctx.op("Reshape", [value, grouped_shape])

    def both() -> tuple[ir.Value, ir.Value]:
        # (xhat in the grouped view, dx in x's shape)
        if not cache:
            g = grouped(ctx.op("Mul", [ctx.dy, _per_channel(ctx, scale, rank)]))
            xhat, dx = _normalized_grad(ctx, grouped(x), g, last, epsilon, x)
            cache["xhat"], cache["dx"] = xhat, ctx.op("Reshape", [dx, full_shape], like=x)
        return cache["xhat"], cache["dx"]

    outer = ctx.const([0, *range(2, rank)])

    def grad_scale() -> ir.Value:
        product = ctx.op("Mul", [ctx.dy, ctx.op("Reshape", [both()[0], full_shape])])
        return ctx.op("ReduceSum", [product, outer], {"keepdims": 0}, like=scale)

    return ctx.wanted_grads(
        lambda: both()[1], grad_scale, lambda: ctx.op("ReduceSum", [ctx.dy, outer], {"keepdims": 0}, like=bias)
    )
