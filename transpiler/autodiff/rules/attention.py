"""Opset 23's Attention (what dynamo writes for torch's scaled_dot_product_attention at opset 23),
and the transpiler's own fused Attention node (transpiler/attention.py), whose gradient is ONE
AttentionGrad node (transpiler/attention_ops.py) fed the forward's output and row log-sum-exps.

For opset 23's, the backward recomputes the attention probabilities P from Q and K with standard ops (the forward
node does not expose them in the form needed) and applies the textbook gradient:
``dV = P^T dY``, ``dS = P * (dP - rowsum(dP * P))`` with ``dP = dY V^T``, ``dQ = scale dS K``,
``dK = scale dS^T Q``; a float mask gets ``dS`` summed to its shape. Grouped-query attention (fewer
K/V heads than Q heads) repeats each K/V head for its group of Q heads in the forward, so their
gradients are summed over the group.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from contract.ops import ATTENTION, ATTENTION_DOMAIN, ATTENTION_GRAD
from transpiler.autodiff._context import RuleContext, unbroadcast
from transpiler.autodiff._registry import register
from transpiler.autodiff.rules._native_node import grad_node


@register(f"{ATTENTION_DOMAIN}::{ATTENTION}")
def _fused_attention(ctx: RuleContext) -> list[ir.Value | None]:
    if ctx.dys[1] is not None:
        raise ctx.error("no gradient flows through the rows' log-sum-exp (output 1)")
    q, k, v = ctx.inputs[:3]
    y, lse = ctx.node.outputs
    attributes = {"scale": ctx.node.attributes.get_float("scale"), "causal": ctx.node.attributes.get_int("causal")}
    return grad_node(ctx, ATTENTION_DOMAIN, ATTENTION_GRAD, [ctx.dy, q, k, v, y, lse], attributes, (q, k, v))


@register("Attention", inputs=(0, 1, 2, 3))
def _attention(ctx: RuleContext) -> list[ir.Value | None]:
    node = ctx.node
    q, k, v = ctx.inputs[0], ctx.inputs[1], ctx.inputs[2]
    mask = ctx.inputs[3] if ctx.has_input(3) else None
    attributes = node.attributes
    if any(ctx.has_input(i) for i in range(4, len(node.inputs))):
        raise ctx.error("past key/value (and nonpad_kv_seqlen) inputs are not supported")
    if any(dy is not None for dy in ctx.dys[1:]):
        raise ctx.error("gradients through present_key/present_value/qk_matmul_output are not supported")
    if attributes.get_float("softcap", 0.0) != 0.0:
        raise ctx.error("softcap is not supported")
    if ctx.rank(q) != 4 or ctx.rank(k) != 4 or ctx.rank(v) != 4:
        raise ctx.error("only 4-D (batch, heads, sequence, head size) Q, K, V are supported")
    q_heads, k_heads, head_size = q.shape[1], k.shape[1], q.shape[3]
    if isinstance(q_heads, int) and isinstance(k_heads, int):
        if q_heads % k_heads:
            raise ctx.error(f"{q_heads} query heads are not a multiple of {k_heads} key/value heads")
        group = ctx.const([q_heads // k_heads]) if q_heads != k_heads else None
    elif q_heads == k_heads:  # the same symbol
        group = None
    else:  # told at run time
        group = ctx.op("Div", [ctx.shape_of(q, 1, 2), ctx.shape_of(k, 1, 2)])
    causal = attributes.get_int("is_causal", 0)
    cache: dict[str, ir.Value] = {}

    def scale() -> ir.Value:
        if "scale" not in cache:
            if attributes.get("scale") is not None:
                cache["scale"] = ctx.scalar(attributes.get_float("scale"), like=q)
            elif isinstance(head_size, int):
                cache["scale"] = ctx.scalar(1 / math.sqrt(head_size), like=q)
            else:
                size = ctx.op("Cast", [ctx.shape_of(q, 3, 4)], {"to": ctx.dtype(q)})
                cache["scale"] = ctx.op("Reciprocal", [ctx.op("Sqrt", [size])])
        return cache["scale"]

    def transposed(value: ir.Value) -> ir.Value:
        return ctx.op("Transpose", [value], {"perm": [0, 1, 3, 2]})

    def repeated(value: ir.Value) -> ir.Value:
        # (B, Hkv, S, D) -> (B, Hkv * G, S, D): head j serves query heads j*G ... (j+1)*G - 1.
        if group is None:
            return value
        repeats = ctx.op("Concat", [ctx.const([1, 1]), group, ctx.const([1, 1])], {"axis": 0})
        expanded = ctx.op("Expand", [ctx.op("Unsqueeze", [value, ctx.const([2])]), repeats])
        target = ctx.op("Concat", [ctx.const([0, -1]), ctx.shape_of(value, 2, 4)], {"axis": 0})
        return ctx.op("Reshape", [expanded, target])

    def summed_over_group(grad: ir.Value, like: ir.Value) -> ir.Value:
        if group is None:
            return ctx.op("Identity", [grad], like=like)
        target = ctx.op("Concat", [ctx.const([0]), ctx.shape_of(like, 1, 2), ctx.const([-1]), ctx.shape_of(like, 2, 4)],
                        {"axis": 0})
        grouped = ctx.op("Reshape", [grad, target])
        return ctx.op("ReduceSum", [grouped, ctx.const([2])], {"keepdims": 0}, like=like)

    def forward() -> tuple[ir.Value, ir.Value, ir.Value]:
        # (P, K repeated, V repeated)
        if not cache:
            kr, vr = repeated(k), repeated(v)
            scores = ctx.op("Mul", [ctx.op("MatMul", [q, transposed(kr)]), scale()])
            lowest = ctx.scalar(float("-inf"), like=q)
            if mask is not None:
                if mask.dtype == ir.DataType.BOOL:
                    scores = ctx.op("Where", [mask, scores, lowest])
                else:
                    scores = ctx.op("Add", [scores, mask])
            if causal:
                square = ctx.op("ConstantOfShape", [ctx.op("Shape", [scores], {"start": -2})],
                                {"value": ir.tensor(np.array([1], dtype=np.int64))})
                keep = ctx.op("Cast", [ctx.op("Trilu", [square], {"upper": 0})], {"to": ir.DataType.BOOL})
                scores = ctx.op("Where", [keep, scores, lowest])
            cache["p"] = ctx.op("Softmax", [scores], {"axis": -1})
            cache["kr"], cache["vr"] = kr, vr
        return cache["p"], cache["kr"], cache["vr"]

    def grad_scores() -> ir.Value:
        # dS = P * (dP - rowsum(dP * P)), before the scale
        if "ds" not in cache:
            p, _, vr = forward()
            dp = ctx.op("MatMul", [ctx.dy, transposed(vr)])
            row = ctx.op("ReduceSum", [ctx.op("Mul", [dp, p]), ctx.const([-1])], {"keepdims": 1})
            scores_shape = [q.shape[0], q.shape[1], q.shape[2], k.shape[2]]
            cache["ds"] = ctx.op("Mul", [p, ctx.op("Sub", [dp, row])], like=q, shape=scores_shape)
        return cache["ds"]

    def grad_q() -> ir.Value:
        _, kr, _ = forward()
        product = ctx.op("MatMul", [grad_scores(), kr])
        return ctx.op("Mul", [product, scale()], like=q)

    def grad_k() -> ir.Value:
        product = ctx.op("MatMul", [transposed(grad_scores()), q])
        return summed_over_group(ctx.op("Mul", [product, scale()]), k)

    def grad_v() -> ir.Value:
        p, _, _ = forward()
        return summed_over_group(ctx.op("MatMul", [transposed(p), ctx.dy]), v)

    def grad_mask() -> ir.Value | None:
        if mask is None or mask.dtype == ir.DataType.BOOL:
            return None
        return unbroadcast(ctx, grad_scores(), mask)

    return ctx.wanted_grads(grad_q, grad_k, grad_v, grad_mask)
