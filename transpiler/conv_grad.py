"""The Conv weight gradient as one node: ``graph_transpiler.conv::ConvWeightGrad(X, dY) -> dW``
(docs/contracts.md).

Why: onnxruntime has no weight-gradient op, and every formulation in standard ops (the Conv over
transposed tensors, one GEMM per kernel tap over shifted copies of X) costs several times what
cuDNN's backward-filter costs (ResNet-18 on an H100: ~8.7 ms against ~1.9 ms per step). As one node
the gradient is something a backend can run natively (the GPU backend: cuDNN's
``cudnnConvolutionBackwardFilter``, runtime/gpu/conv_grad.py); the node's model-local function is
the Conv formulation in standard ops, so onnx.checker, plain onnxruntime (which inlines it), Netron
and the CPU backend read and compute it like before.

The node: inputs X (N, C, H, W) and dY (N, M, Ho, Wo) of a forward ``Y = Conv(X, W)`` with group 1
and two spatial axes; output dW (M, C, kh, kw), all three of one element type: float32, or
bfloat16 or float16 under --precision (dW then rounded once from a float32 sum, as cuDNN's
backward-filter with float accumulation gives it; the Cast rule casts it up to the float32
parameter's gradient). Attributes, all present: ``kernel_shape`` (kh, kw), ``strides``,
``dilations``, ``pads`` (begin..., end..., with auto_pad already resolved). The function is
polymorphic (attribute references, no shapes, no types), so one function serves every node.
"""

from __future__ import annotations

import onnx_ir as ir

from contract.ops import CONV_GRAD_DOMAIN, CONV_WEIGHT_GRAD, CONV_WEIGHT_GRAD_ATTRIBUTES
from transpiler.function_body import FunctionBody

_INTS = ir.AttributeType.INTS


def weight_grad_function(opset: int) -> ir.Function:
    """dW = Transpose(Conv(X^T, dY^T)) cropped to the kernel: a Conv whose "batch" is X's channels and
    whose "channels" are the batch (X transposed to (C, N, H, W)), with dY transposed to (M, N, Ho, Wo)
    as the kernel; the forward's strides become the dilations and its dilations the strides. The
    last window of the forward may leave input rows unread: those give extra taps, cropped away."""
    x, dy = ir.Value(name="X"), ir.Value(name="dY")
    swap = [1, 0, 2, 3]
    b = FunctionBody()

    def ints(name: str, values: list[int]) -> ir.Attr:
        return ir.Attr(name, _INTS, values)

    def ref(name: str, parent: str) -> ir.Attr:
        return ir.RefAttr(name, parent, _INTS)

    xt = b.op("Transpose", [x], [ints("perm", swap)])
    dyt = b.op("Transpose", [dy], [ints("perm", swap)])
    full = b.op("Conv", [xt, dyt], [ref("strides", "dilations"), ref("dilations", "strides"), ref("pads", "pads")])
    ends = b.op("Constant", [], [ref("value_ints", "kernel_shape")])
    cropped = b.op("Slice", [full, b.ints([0, 0]), ends, b.ints([2, 3])])
    dw = b.op("Transpose", [cropped], [ints("perm", swap)])
    return b.function(CONV_GRAD_DOMAIN, CONV_WEIGHT_GRAD, [x, dy], {"dW": dw},
                      dict.fromkeys(CONV_WEIGHT_GRAD_ATTRIBUTES, _INTS), opset,
                      "Conv weight gradient (group 1, 2 spatial axes); see transpiler/conv_grad.py")
