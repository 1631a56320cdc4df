"""BatchNormalization (inference mode; the training-mode gradient when fed its own batch statistics,
as transpiler/batchnorm.py writes it) and transpiler/batchnorm.py's BatchNormTraining node (one
BatchNormTrainingGrad node)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from contract.ops import BATCHNORM_DOMAIN, BATCHNORM_TRAINING, BATCHNORM_TRAINING_GRAD
from transpiler.autodiff._context import RuleContext, producer_of
from transpiler.autodiff._registry import register
from transpiler.autodiff.rules._native_node import grad_node
from transpiler.autodiff.rules.collectives import DOMAIN as COLLECTIVES_DOMAIN


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
    return grad_node(ctx, BATCHNORM_DOMAIN, BATCHNORM_TRAINING_GRAD, [ctx.dy, x, scale, saved_mean, saved_inv_std],
                     {"epsilon": epsilon}, (x, scale, bias))


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
