"""The functions of the fused attention nodes (contract/ops.py, docs/contracts.md):

    graph_transpiler.attention::Attention(Q, K, V) -> (Y, LSE)
    graph_transpiler.attention::AttentionGrad(dY, Q, K, V, Y, LSE) -> (dQ, dK, dV)

Why one node each way: written as MatMul, scale, mask, Softmax, MatMul the attention of GPT-2-small
(8 x 512 tokens, 12 heads) materializes (batch, heads, queries, keys) scores and probabilities, forward
and backward, about 10 passes over 25 M elements per layer and their memory kept for the backward;
the GPU backend runs each node as one cuDNN fused kernel (runtime/gpu/attention.py), which keeps
none of them (only LSE, one float per row) and recomputes P in the backward, as flash attention does.

Semantics, heads taken as (batch, heads, sequence, head size) and everything computed in float32 from
the inputs widened exactly: ``S = scale * Q K^T``, masked to -inf where ``causal`` and key > query;
``LSE = log sum_j exp S``, ``P = exp(S - LSE)``, ``Y = P V``; the gradient recomputes P from LSE:
``dV = P^T dY``, ``dS = P * (dY V^T - rowsum(dY * Y))``, ``dQ = scale dS K``, ``dK = scale dS^T Q``.
Each output is rounded once to the inputs' dtype, and so are P and scale * dS before the products
that read them, as the fused kernels (cuDNN's, flash attention's) round them for their tensor-core
products; what is left between the two is float32 summation order (the GPU test holds it to the
I/O dtype's rounding: tests/test_attention_gpu.py).

Bodies are polymorphic in the float dtype (Cast to float32, CastLike back), so onnx.checker, plain
onnxruntime (CPU included: it has Cast for bfloat16), Netron and the CPU backend read and run them.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from contract.ops import ATTENTION, ATTENTION_DOMAIN, ATTENTION_GRAD
from transpiler.function_body import FunctionBody

_ATTRIBUTES = {"scale": ir.AttributeType.FLOAT, "causal": ir.AttributeType.INT}
_INT = ir.AttributeType.INT


def _attr(name: str, kind: ir.AttributeType, value) -> ir.Attr:
    return ir.Attr(name, kind, value)


class _Body(FunctionBody):
    def __init__(self, opset: int):
        super().__init__()
        self.opset = opset

    def heads(self, x: ir.Value) -> ir.Value:
        """(B, S, H, D) of any float dtype -> (B, H, S, D) float32."""
        wide = self.op("Cast", [x], [_attr("to", _INT, int(ir.DataType.FLOAT))])
        return self.transpose(wide, [0, 2, 1, 3])

    def transpose(self, x: ir.Value, perm: list[int]) -> ir.Value:
        return self.op("Transpose", [x], [_attr("perm", ir.AttributeType.INTS, perm)])

    def back(self, x: ir.Value, like: ir.Value) -> ir.Value:
        """(B, H, S, D) float32 -> (B, S, H, D) rounded to ``like``'s dtype."""
        return self.op("CastLike", [self.transpose(x, [0, 2, 1, 3]), like])

    def row_reduce(self, op_type: str, x: ir.Value) -> ir.Value:
        # ReduceMax took its axes as an attribute before opset 18; ReduceSum as an input from 13.
        keep = [_attr("keepdims", _INT, 1)]
        if op_type == "ReduceMax" and self.opset < 18:
            return self.op(op_type, [x], [*keep, _attr("axes", ir.AttributeType.INTS, [-1])])
        return self.op(op_type, [x, self.ints([-1])], keep)

    def scale(self) -> ir.Value:
        return self.op("Constant", [], [ir.RefAttr("value_float", "scale", ir.AttributeType.FLOAT)])

    def scores(self, q: ir.Value, k: ir.Value) -> ir.Value:
        """scale * Q K^T, -inf where ``causal`` hides the key: (B, H, queries, keys) float32."""
        raw = self.op("MatMul", [q, self.transpose(k, [0, 1, 3, 2])])
        scaled = self.op("Mul", [raw, self.scale()])
        zero, one = (self.op("Constant", [], [_attr("value_int", _INT, n)]) for n in (0, 1))
        queries = self.op("Range", [zero, self.length(q), one])
        keys = self.op("Range", [zero, self.length(k), one])
        below = self.op("GreaterOrEqual", [self.op("Unsqueeze", [queries, self.ints([1])]), keys])
        causal = self.op("Constant", [], [ir.RefAttr("value_int", "causal", _INT)])
        free = self.op("Not", [self.op("Cast", [causal], [_attr("to", _INT, int(ir.DataType.BOOL))])])
        hidden = self.op("Constant", [], [_attr("value_float", ir.AttributeType.FLOAT, -math.inf)])
        return self.op("Where", [self.op("Or", [below, free]), scaled, hidden])

    def rounded(self, x: ir.Value, like: ir.Value) -> ir.Value:
        """float32 ``x`` rounded to ``like``'s dtype and widened again (nothing for float32 I/O)."""
        return self.op("Cast", [self.op("CastLike", [x, like])], [_attr("to", _INT, int(ir.DataType.FLOAT))])

    def length(self, heads: ir.Value) -> ir.Value:
        """The sequence length of (B, H, S, D) heads, as a scalar."""
        size = self.op("Shape", [heads], [_attr("start", _INT, 2), _attr("end", _INT, 3)])
        return self.op("Squeeze", [size, self.ints([0])])

    def function(self, op_type, inputs, outputs, doc):
        return super().function(ATTENTION_DOMAIN, op_type, inputs, outputs, _ATTRIBUTES, self.opset, doc)


def forward_function(opset: int) -> ir.Function:
    q, k, v = (ir.Value(name=n) for n in ("Q", "K", "V"))
    b = _Body(opset)
    qh, kh, vh = b.heads(q), b.heads(k), b.heads(v)
    scores = b.scores(qh, kh)
    peak = b.row_reduce("ReduceMax", scores)
    lse = b.op("Add", [b.op("Log", [b.row_reduce("ReduceSum", b.op("Exp", [b.op("Sub", [scores, peak])]))]), peak])
    p = b.op("Exp", [b.op("Sub", [scores, lse])])
    y = b.back(b.op("MatMul", [b.rounded(p, q), vh]), q)
    return b.function(ATTENTION, [q, k, v], {"Y": y, "LSE": lse},
                      "scaled dot-product attention; see transpiler/attention_ops.py")


def grad_function(opset: int) -> ir.Function:
    dy, q, k, v, y, lse = (ir.Value(name=n) for n in ("dY", "Q", "K", "V", "Y", "LSE"))
    b = _Body(opset)
    dyh, qh, kh, vh, yh = (b.heads(x) for x in (dy, q, k, v, y))
    p = b.op("Exp", [b.op("Sub", [b.scores(qh, kh), lse])])
    dv = b.op("MatMul", [b.transpose(b.rounded(p, q), [0, 1, 3, 2]), dyh])
    dp = b.op("MatMul", [dyh, b.transpose(vh, [0, 1, 3, 2])])
    delta = b.row_reduce("ReduceSum", b.op("Mul", [dyh, yh]))
    ds = b.rounded(b.op("Mul", [b.op("Mul", [p, b.op("Sub", [dp, delta])]), b.scale()]), q)
    dq = b.op("MatMul", [ds, kh])
    dk = b.op("MatMul", [b.transpose(ds, [0, 1, 3, 2]), qh])
    return b.function(ATTENTION_GRAD, [dy, q, k, v, y, lse],
                      {"dQ": b.back(dq, q), "dK": b.back(dk, k), "dV": b.back(dv, v)},
                      "the gradient of Attention; see transpiler/attention_ops.py")
