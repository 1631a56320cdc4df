"""LayerNormalization (from its Mean/InvStdDev outputs; over the last axis in float32, one LayerNormGrad
node), RMSNormalization (statistics recomputed), Dropout (from its mask output),
BatchNormalization (inference mode; the training-mode gradient when fed its own batch statistics),
InstanceNormalization and GroupNormalization (statistics recomputed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from contract.ops import (
    BATCHNORM_DOMAIN,
    BATCHNORM_TRAINING,
    BATCHNORM_TRAINING_GRAD,
    LAYERNORM_DOMAIN,
    LAYERNORM_GRAD,
)
from transpiler.autodiff._context import RuleContext, annotate, producer_of, unbroadcast
from transpiler.autodiff._registry import register
from transpiler.autodiff.rules.collectives import DOMAIN as COLLECTIVES_DOMAIN

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
        return _grad_node(ctx, LAYERNORM_DOMAIN, LAYERNORM_GRAD, [dy, x, scale, mean, inv], {},
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
# BatchNormalization


@dataclass
class _BatchStatistics:
    """How transpiler/batchnorm.py computes a training BatchNormalization's mean and variance."""

    centered: ir.Value  # x - mean, (N, C, ...)
    mean: ir.Value  # (1, C, 1, ...), all-reduced when synced
    var: ir.Value  # biased, around ``mean``, (1, C, 1, ...), all-reduced when synced
    synced: bool  # --sync-bn: both statistics went through an AllReduce(mean)


def _unsynced(value: ir.Value) -> tuple[ir.Value | None, bool]:
    """(the local statistic, whether an AllReduce(mean) made it global); None: another collective."""
    reduce = producer_of(value, "AllReduce", COLLECTIVES_DOMAIN)
    if reduce is None:
        return value, False
    if reduce.attributes.get_string("reduction", "") != "mean" or len(reduce.inputs) != 1:
        return None, True
    return reduce.inputs[0], True


def _is_channel_mean(value: ir.Value, source: ir.Value, rank: int) -> bool:
    """``value`` = ReduceMean(source) over every axis but 1, dims kept."""
    node = producer_of(value, "ReduceMean")
    if node is None or node.inputs[0] is not source or len(node.inputs) < 2:
        return False
    axes = ir.convenience.get_const_tensor(node.inputs[1]) if node.inputs[1] is not None else None
    if axes is None:
        return False
    wanted = [0, *range(2, rank)]
    return sorted(int(a) % rank for a in axes.numpy().reshape(-1)) == wanted and node.attributes.get_int(
        "keepdims", 1
    ) == 1


def batch_statistics(node: ir.Node) -> _BatchStatistics | None:
    """The statistics when ``node`` (inference-mode BatchNormalization) is fed the batch mean and
    biased variance of its own input ``x``, as transpiler/batchnorm.py writes them:

        mean = [AllReduce(mean)] ReduceMean(x, all axes but 1, keepdims)
        var  = [AllReduce(mean)] ReduceMean(Mul(c, c), same axes), c = Sub(x, mean)
        y    = BatchNormalization(x, scale, bias, Reshape(mean, [C]), Reshape(var, [C]))

    None for anything else: the statistics are then ordinary inputs with their own gradients.
    """
    if node.attributes.get_int("training_mode", 0) or len(node.inputs) < 5:
        return None
    x = node.inputs[0]
    if x is None or x.shape is None or x.shape.rank() < 2:
        return None
    rank = x.shape.rank()
    stats = []
    for index in (3, 4):
        flat = producer_of(node.inputs[index], "Reshape")
        if flat is None:
            return None
        stats.append(flat.inputs[0])
    mean, var = stats
    mean_local, mean_synced = _unsynced(mean)
    var_local, var_synced = _unsynced(var)
    if mean_local is None or var_local is None or mean_synced != var_synced:
        return None
    if not _is_channel_mean(mean_local, x, rank):
        return None
    square_node = producer_of(var_local, "ReduceMean")
    if square_node is None or not _is_channel_mean(var_local, square_node.inputs[0], rank):
        return None
    square = producer_of(square_node.inputs[0], "Mul")
    if square is None or square.inputs[0] is not square.inputs[1]:
        return None
    centered = square.inputs[0]
    sub = producer_of(centered, "Sub")
    if sub is None or sub.inputs[0] is not x or sub.inputs[1] is not mean:
        return None
    return _BatchStatistics(centered, mean, var, mean_synced)


def _batch_norm_inputs(node: ir.Node) -> Sequence[int]:
    # Fed its own batch statistics, the rule differentiates through them (the full training-mode
    # gradient goes to x), so the statistics' inputs carry none: the nodes computing them are then
    # off the differentiable path and need no rules of their own.
    return (0, 1, 2) if batch_statistics(node) is not None else range(len(node.inputs))


@register("BatchNormalization", inputs=_batch_norm_inputs)
def _batch_norm(ctx: RuleContext) -> list[ir.Value | None]:
    # Inference mode: y = (x - mean) * inv * scale + bias per channel (axis 1), inv = 1/sqrt(var + eps).
    node = ctx.node
    if node.attributes.get_int("training_mode", 0):
        raise ctx.error("training_mode=1 is not differentiated here; transpiler/batchnorm.py decomposes it")
    if any(dy is not None for dy in ctx.dys[1:]):
        raise ctx.error("gradients through the running-statistics outputs are not supported")
    x, scale = ctx.inputs[0], ctx.inputs[1]
    rank = ctx.rank(x)
    axes = ctx.const([0, *range(2, rank)])
    per_channel = ctx.const([0, *range(2, rank)])
    epsilon = ctx.scalar(node.attributes.get_float("epsilon", 1e-5), like=x)
    dy = ctx.dy

    def channel(value: ir.Value) -> ir.Value:  # (C,) -> (1, C, 1, ...)
        return ctx.op("Unsqueeze", [value, per_channel])

    def flat(value: ir.Value, like: ir.Value) -> ir.Value:  # (1, C, 1, ...) -> (C,)
        return ctx.op("Reshape", [value, ctx.const([-1])], like=like)

    def channel_sum(value: ir.Value) -> ir.Value:
        return ctx.op("ReduceSum", [value, axes], {"keepdims": 1})

    stats = batch_statistics(node)
    cache: dict[str, ir.Value] = {}

    def sums() -> tuple[ir.Value, ir.Value, ir.Value]:
        """(sum dy, sum dy * (x - mean), inv) per channel, shaped (1, C, 1, ...): the only two
        reductions of the backward."""
        if not cache:
            if stats is not None:
                centered, var = stats.centered, stats.var
            else:
                centered = ctx.op("Sub", [x, channel(ctx.inputs[3])], like=x)
                var = channel(ctx.inputs[4])
            cache["var_eps"] = ctx.op("Add", [var, epsilon])
            cache["inv"] = ctx.op("Reciprocal", [ctx.op("Sqrt", [cache["var_eps"]])])
            cache["sum_dy"] = channel_sum(dy)
            cache["sum_dyc"] = channel_sum(ctx.op("Mul", [dy, centered], like=x))
            cache["centered"] = centered
        return cache["sum_dy"], cache["sum_dyc"], cache["inv"]

    def grad_x() -> ir.Value:
        sum_dy, sum_dyc, inv = sums()
        k1 = ctx.op("Mul", [channel(scale), inv])  # dy/dx holding the statistics fixed
        if stats is None:
            return ctx.op("Mul", [dy, k1], like=x)
        # Through the statistics too (PyTorch's training-mode formula):
        # dx = scale * inv * (dy - mean(dy) - xhat * mean(dy * xhat)), xhat = (x - mean) * inv,
        # means over the batch (the global batch with --sync-bn: the two local means all-reduced,
        # the transpose of the forward's all-reduced statistics).
        count = _count_per_channel(ctx, x, stats.mean)
        mean_dy = ctx.op("Div", [sum_dy, count])
        mean_dyc = ctx.op("Div", [sum_dyc, count])
        if stats.synced:
            mean_dy = _all_reduce_mean(ctx, mean_dy, x, stats.mean)
            mean_dyc = _all_reduce_mean(ctx, mean_dyc, x, stats.mean)
        # dx = dy * k1 - k3 - (x - mean) * k2, k1 = scale * inv, k3 = k1 * mean(dy),
        # k2 = k1 * inv^2 * mean(dy * (x - mean)): per-channel factors, then 4 elementwise passes.
        k2 = ctx.op("Mul", [k1, ctx.op("Div", [mean_dyc, cache["var_eps"]])])
        k3 = ctx.op("Mul", [k1, mean_dy])
        scaled = ctx.op("Sub", [ctx.op("Mul", [dy, k1]), k3])
        return ctx.op("Sub", [scaled, ctx.op("Mul", [cache["centered"], k2])], like=x)

    def grad_scale() -> ir.Value:
        _, sum_dyc, inv = sums()
        return flat(ctx.op("Mul", [sum_dyc, inv]), scale)

    def grad_bias() -> ir.Value:
        sum_dy, _, _ = sums()
        return flat(sum_dy, ctx.inputs[2])

    def grad_mean() -> ir.Value:
        sum_dy, _, inv = sums()
        return flat(ctx.op("Neg", [ctx.op("Mul", [ctx.op("Mul", [channel(scale), inv]), sum_dy])]), ctx.inputs[3])

    def grad_var() -> ir.Value:
        # d inv / d var = -inv^3 / 2
        _, sum_dyc, inv = sums()
        cube = ctx.op("Mul", [inv, ctx.op("Mul", [inv, inv])])
        half = ctx.scalar(-0.5, like=x)
        return flat(ctx.op("Mul", [ctx.op("Mul", [channel(scale), ctx.op("Mul", [cube, half])]), sum_dyc]), ctx.inputs[4])

    return ctx.wanted_grads(grad_x, grad_scale, grad_bias, grad_mean, grad_var)


@register(f"{BATCHNORM_DOMAIN}::{BATCHNORM_TRAINING}", inputs=(0, 1, 2))
def _batch_norm_training(ctx: RuleContext) -> list[ir.Value | None]:
    # transpiler/batchnorm.py's node form: the training-mode gradient of X, scale and B as ONE
    # BatchNormTrainingGrad node (transpiler/batchnorm_ops.py), fed the saved statistics. The running
    # statistics (inputs 3, 4) are buffers: no gradient flows into or out of them.
    if any(dy is not None for dy in ctx.dys[1:]):
        raise ctx.error("gradients through the running or saved statistics are not supported")
    x, scale, bias = ctx.inputs[:3]
    saved_mean, saved_inv_std = ctx.node.outputs[3], ctx.node.outputs[4]
    epsilon = ctx.node.attributes.get_float("epsilon", 1e-5)
    return _grad_node(ctx, BATCHNORM_DOMAIN, BATCHNORM_TRAINING_GRAD, [ctx.dy, x, scale, saved_mean, saved_inv_std],
                      {"epsilon": epsilon}, (x, scale, bias))


def _grad_node(ctx: RuleContext, domain: str, op_type: str, inputs: list[ir.Value], attributes: dict,
               likes: tuple[ir.Value, ...]) -> list[ir.Value | None]:
    """The gradients of a node's inputs as the outputs of ONE backend-native node (its function is
    added by native_ops.add_op_functions), each typed like ``likes``; the node is written on the first
    wanted gradient, and only if one is wanted."""
    outputs: list[ir.Value] = []

    def output(k: int) -> ir.Value:
        if not outputs:
            outputs.extend(ctx.op_multi(op_type, inputs, attributes, num_outputs=len(likes), domain=domain))
            for value, like in zip(outputs, likes):
                annotate(value, like)
        return outputs[k]

    return ctx.wanted_grads(*(lambda k=k: output(k) for k in range(len(likes))))


def _count_per_channel(ctx: RuleContext, x: ir.Value, stat: ir.Value) -> ir.Value:
    """Elements per channel of ``x`` (this rank's), as a scalar of x's dtype."""
    dims = list(x.shape)
    reduced = [d for i, d in enumerate(dims) if i != 1]
    if all(isinstance(d, int) for d in reduced):
        return ctx.scalar(float(np.prod(reduced)), like=x)
    ratio = ctx.op("Div", [ctx.op("Size", [x]), ctx.op("Size", [stat])])
    return ctx.op("Cast", [ratio], {"to": ctx.dtype(x)})


def _all_reduce_mean(ctx: RuleContext, value: ir.Value, x: ir.Value, stat: ir.Value) -> ir.Value:
    """AllReduce(mean) of a per-channel value shaped like ``stat``; typed explicitly (the plan counts
    its bytes, and shape inference knows nothing of the collectives' domain)."""
    attrs = {"reduction": "mean", "bucket": -1, "order": -1, "phase": "step"}
    out = ctx.op_multi("AllReduce", [value], attrs, num_outputs=1, domain=COLLECTIVES_DOMAIN)[0]
    shape = list(stat.shape) if stat.shape is not None else [1, x.shape[1], *([1] * (ctx.rank(x) - 2))]
    for v in (value, out):
        v.dtype, v.shape = ctx.dtype(x), ir.Shape(shape)
    return out


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
