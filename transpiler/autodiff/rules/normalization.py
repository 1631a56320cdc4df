"""LayerNormalization (from its Mean/InvStdDev outputs) and Dropout (from its mask output)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from transpiler.autodiff._context import RuleContext, unbroadcast
from transpiler.autodiff._registry import register

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
