"""Classification losses: SoftmaxCrossEntropyLoss (from its log_prob output) and
NegativeLogLikelihoodLoss. Gradients flow into the scores only (labels are integers, per-class
weights are treated as constants)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from contract.ops import CROSS_ENTROPY_GRAD, LOSS_DOMAIN, NO_IGNORED_LABEL
from transpiler.autodiff._context import RuleContext
from transpiler.autodiff._registry import register
from transpiler.autodiff.rules._native_node import grad_node


def _class_mask(ctx: RuleContext, scores: ir.Value, labels: ir.Value) -> ir.Value:
    """One-hot of the labels along axis 1, shaped like the scores (float): Equal with a Range."""
    rank = ctx.rank(scores)
    classes = ctx.op("Squeeze", [ctx.shape_of(scores, 1, 2), ctx.const([0])])
    label_type = ctx.dtype(labels)
    zero = ctx.const(np.array(0, dtype=label_type.numpy()))
    one = ctx.const(np.array(1, dtype=label_type.numpy()))
    if label_type != ir.DataType.INT64:
        classes = ctx.op("Cast", [classes], {"to": label_type})
    ids = ctx.op("Range", [zero, classes, one])
    ids = ctx.op("Reshape", [ids, ctx.const([1, -1] + [1] * (rank - 2))])
    hit = ctx.op("Equal", [ctx.op("Unsqueeze", [labels, ctx.const([1])]), ids])
    return ctx.op("Cast", [hit], {"to": ctx.dtype(scores)}, like=scores)


def _minus_one_at_labels(ctx: RuleContext, prob: ir.Value, labels: ir.Value) -> ir.Value:
    """``prob - onehot(labels)`` along axis 1, bit for bit, without the one-hot: each label's own
    element gets ``p - 1`` by ScatterElements, every other element is ``p - 0 = p`` already. Over a
    [rows, vocabulary] tensor (a language model's logits) that is one pass over it instead of
    three (Equal, Cast, Sub), and no float one-hot as large as the logits at the memory peak."""
    index = ctx.op("Unsqueeze", [labels, ctx.const([1])])
    picked = ctx.op("GatherElements", [prob, index], {"axis": 1})
    minus_one = ctx.op("Sub", [picked, ctx.scalar(1.0, like=prob)])
    return ctx.op("ScatterElements", [prob, index, minus_one], {"axis": 1}, like=prob)


def _per_sample_coefficient(ctx: RuleContext, dloss: ir.Value, scores: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(safe labels, c) with c the gradient of the loss w.r.t. each sample's -log p[label]:
    dloss times the sample's class weight (0 for ignored samples), over the weight total for 'mean'.
    c has the labels' shape, or is a scalar when every sample weighs the same."""
    labels = ctx.inputs[1]
    attributes = ctx.node.attributes
    reduction = attributes.get_string("reduction", "mean")
    ignore_index = attributes.get_int("ignore_index", None)
    dtype = ctx.dtype(scores)
    label_dtype = ctx.dtype(labels).numpy()

    weight = None
    safe = labels
    if ignore_index is not None:
        ignored = ctx.op("Equal", [labels, ctx.const(np.array(ignore_index, dtype=label_dtype))])
        # Ignored labels may be out of range (-100): point them at class 0, their weight is 0.
        safe = ctx.op("Where", [ignored, ctx.const(np.array(0, dtype=label_dtype)), labels], like=labels)
        weight = ctx.op("Cast", [ctx.op("Not", [ignored])], {"to": dtype})
    if ctx.has_input(2):
        class_weight = ctx.op("Gather", [ctx.inputs[2], safe])
        weight = class_weight if weight is None else ctx.op("Mul", [weight, class_weight])

    if reduction == "none":
        coefficient = dloss
    elif reduction in ("sum", "mean"):
        coefficient = dloss
        if reduction == "mean":
            if weight is not None:
                total = ctx.op("ReduceSum", [weight], {"keepdims": 0})
            elif labels.shape is not None and all(isinstance(d, int) for d in labels.shape):
                total = ctx.scalar(float(np.prod(list(labels.shape))), like=scores)
            else:
                total = ctx.op("Cast", [ctx.op("Size", [labels])], {"to": dtype})
            coefficient = ctx.op("Div", [coefficient, total])
    else:
        raise ctx.error(f"unknown reduction {reduction!r}")
    if weight is not None:
        coefficient = ctx.op("Mul", [coefficient, weight])
        return safe, ctx.op("Unsqueeze", [coefficient, ctx.const([1])])
    if reduction == "none":
        return safe, ctx.op("Unsqueeze", [coefficient, ctx.const([1])])
    return safe, coefficient


@register("SoftmaxCrossEntropyLoss", inputs=(0,))
def _softmax_cross_entropy(ctx: RuleContext) -> list[ir.Value | None]:
    # loss_i = -w_i log_prob[i, label_i]; d/dscores = c_i (softmax - onehot), softmax = exp(log_prob).
    scores = ctx.inputs[0]
    dloss = ctx.dys[0]
    dlog_prob = ctx.dys[1] if len(ctx.dys) > 1 else None
    if _one_node_applies(ctx, scores, dloss, dlog_prob):
        # One SoftmaxCrossEntropyGrad node (transpiler/loss_ops.py), whose function is grad() below.
        log_prob = ctx.forward_output(1, "log_prob", ctx.dtype(scores), scores.shape)
        ignore_index = ctx.node.attributes.get_int("ignore_index", NO_IGNORED_LABEL)
        return grad_node(ctx, LOSS_DOMAIN, CROSS_ENTROPY_GRAD, [dloss, scores, ctx.inputs[1], log_prob],
                         {"ignore_index": ignore_index}, (scores,))

    def grad() -> ir.Value:
        log_prob = ctx.forward_output(1, "log_prob", ctx.dtype(scores), scores.shape)
        prob = ctx.op("Exp", [log_prob], like=scores)
        total = None
        if dloss is not None:
            safe, coefficient = _per_sample_coefficient(ctx, dloss, scores)
            diff = _minus_one_at_labels(ctx, prob, safe)
            total = ctx.op("Mul", [coefficient, diff], like=scores)
        if dlog_prob is not None:
            # The log_prob output is a LogSoftmax over axis 1.
            summed = ctx.op("ReduceSum", [dlog_prob, ctx.const([1])], {"keepdims": 1})
            through = ctx.op("Sub", [dlog_prob, ctx.op("Mul", [prob, summed])], like=scores)
            total = through if total is None else ctx.op("Add", [total, through], like=scores)
        return total

    return ctx.wanted_grads(grad)


def _one_node_applies(ctx: RuleContext, scores: ir.Value, dloss: ir.Value | None,
                      dlog_prob: ir.Value | None) -> bool:
    """Whether the gradient is one SoftmaxCrossEntropyGrad node (its contract, contract/ops.py):
    float32 (N, C) scores, (N,) labels, the mean over the samples, no class weights, and only the
    loss read downstream (not log_prob)."""
    labels = ctx.inputs[1]
    return (dloss is not None and dlog_prob is None and not ctx.has_input(2)
            and ctx.node.attributes.get_string("reduction", "mean") == "mean"
            and ctx.dtype(scores) == ir.DataType.FLOAT and scores.shape is not None and scores.shape.rank() == 2
            and labels.shape is not None and labels.shape.rank() == 1)


@register("NegativeLogLikelihoodLoss", inputs=(0,))
def _negative_log_likelihood(ctx: RuleContext) -> list[ir.Value | None]:
    # loss_i = -w_i input[i, target_i]; d/dinput = -c_i onehot.
    scores = ctx.inputs[0]

    def grad() -> ir.Value:
        safe, coefficient = _per_sample_coefficient(ctx, ctx.dy, scores)
        picked = ctx.op("Mul", [coefficient, _class_mask(ctx, scores, safe)], like=scores)
        return ctx.op("Neg", [picked], like=scores)

    return ctx.wanted_grads(grad)
