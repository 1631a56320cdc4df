"""The gradient of LayerNormalization over the last axis as one node a backend can run natively
(docs/contracts.md):

    graph_transpiler.layernorm::LayerNormGrad(dY, X, scale, mean, inv_std_dev) -> (dX, dscale, dB)

Why: written in standard ops the gradient is about 13 kernels per LayerNorm (x-hat, the two row
means, four elementwise passes for dX, the products and column sums of dscale and dB; onnxruntime
fuses none of them): on GPT-2-small (25 LayerNorms) about 3 ms of a 34 ms step on one H200, where
PyTorch runs two kernels per LayerNorm (0.7 ms). The GPU backend runs the node as two kernels
(runtime/gpu/layernorm.py): one block per row for dX, one pass over the columns for dscale and dB.

Semantics (xhat = (X - mean) * inv_std_dev, g = dY * scale, means over the last axis, sums over
all the others):
    dX = inv_std_dev * (g - mean(g) - xhat * mean(g * xhat))
    dscale = sum(dY * xhat),  dB = sum(dY)
mean and inv_std_dev are LayerNormalization's optional outputs 1 and 2 (shape (..., 1), float32).

The node carries a model-local function in standard ops (the LayerNormalization rule's formulas),
so onnx.checker, plain onnxruntime (which inlines it), Netron and the CPU backend read and compute it.
"""

from __future__ import annotations

import onnx_ir as ir

from contract.ops import LAYERNORM_DOMAIN, LAYERNORM_GRAD
from transpiler.function_body import FunctionBody


def grad_function(opset: int) -> ir.Function:
    dy, x, scale, mean, inv = (ir.Value(name=n) for n in ("dY", "X", "scale", "mean", "inv_std_dev"))
    b = FunctionBody()
    keepdims = [ir.Attr("keepdims", ir.AttributeType.INT, 1)]
    last, rows = b.ints([-1]), b.ints([0])
    width = b.op("Shape", [x], [ir.Attr("start", ir.AttributeType.INT, -1)])  # [C]
    xhat = b.op("Mul", [b.op("Sub", [x, mean]), inv])
    g = b.op("Mul", [dy, scale])

    def row_mean(value: ir.Value) -> ir.Value:
        # ReduceMean takes its axes as an input from opset 18; below, a sum over the count.
        if opset >= 18:
            return b.op("ReduceMean", [value, last], keepdims)
        count = b.op("Cast", [width], [ir.Attr("to", ir.AttributeType.INT, int(ir.DataType.FLOAT))])
        return b.op("Div", [b.op("ReduceSum", [value, last], keepdims), count])

    mean_g = row_mean(g)
    mean_gx = row_mean(b.op("Mul", [g, xhat]))
    dx = b.op("Mul", [b.op("Sub", [b.op("Sub", [g, mean_g]), b.op("Mul", [xhat, mean_gx])]), inv])
    matrix = b.op("Concat", [b.ints([-1]), width], [ir.Attr("axis", ir.AttributeType.INT, 0)])  # (rows, C)
    drop = [ir.Attr("keepdims", ir.AttributeType.INT, 0)]
    dscale = b.op("ReduceSum", [b.op("Reshape", [b.op("Mul", [dy, xhat]), matrix]), rows], drop)
    dbias = b.op("ReduceSum", [b.op("Reshape", [dy, matrix]), rows], drop)
    return b.function(LAYERNORM_DOMAIN, LAYERNORM_GRAD, [dy, x, scale, mean, inv],
                      {"dX": dx, "dscale": dscale, "dB": dbias}, {}, opset,
                      "the gradient of LayerNormalization over the last axis; see transpiler/layernorm_ops.py")
