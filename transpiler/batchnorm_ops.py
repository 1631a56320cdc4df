"""Training BatchNormalization as two nodes a backend can run natively (docs/contracts.md):

    graph_transpiler.batchnorm::BatchNormTraining(X, scale, B, running_mean, running_var)
        -> (Y, running_mean_next, running_var_next, saved_mean, saved_inv_std)
    graph_transpiler.batchnorm::BatchNormTrainingGrad(dY, X, scale, saved_mean, saved_inv_std)
        -> (dX, dscale, dB)

Why: in standard ops a training BatchNorm costs about 23 passes over its activation per step
(statistics in two passes with the centered copy written out, the backward's product written out
before its reduction, four elementwise passes for dX; onnxruntime fuses none of them), where
cuDNN's training kernels read and write it about 8 times: ResNet-18 at batch 256 on one H100 spent
~7.6 ms per step in them against PyTorch's ~3.8 ms of cuDNN BatchNorm. As nodes, the GPU backend runs
them as kernels of its own, two passes each (runtime/gpu/batchnorm.py; first cuDNN's, which gave
each channel one block).

Semantics are PyTorch's ``train()`` BatchNorm2d: X is (N, C, H, W) float32; Y normalizes with the
batch mean and biased variance; ``running = momentum * running + (1 - momentum) * batch`` (ONNX's
momentum) with the *unbiased* batch variance; ``saved_inv_std = 1 / sqrt(var + epsilon)``. The
gradient is the training-mode one (through the statistics), from the saved statistics.

Each node carries a model-local ONNX function in standard ops (the formulas of
transpiler/batchnorm.py's "fused" form and of the BatchNormalization rule), polymorphic in its
attributes, so onnx.checker, plain onnxruntime (which inlines it), Netron and the CPU backend read
and compute it as before.
"""

from __future__ import annotations

import onnx_ir as ir

from contract.ops import BATCHNORM_DOMAIN, BATCHNORM_TRAINING, BATCHNORM_TRAINING_GRAD
from transpiler.function_body import FunctionBody

_FLOAT = ir.AttributeType.FLOAT


class _Body(FunctionBody):
    """A BatchNorm function's nodes, with the two constants both functions read."""

    def float_attr(self, name: str) -> ir.Value:
        """The node's float attribute ``name`` as a 0-d constant."""
        return self.op("Constant", [], [ir.RefAttr("value_float", name, _FLOAT)])

    def per_channel_count(self, x: ir.Value, scale: ir.Value) -> ir.Value:
        """N*H*W as a float: elements of X per element of scale."""
        to_float = [ir.Attr("to", ir.AttributeType.INT, int(ir.DataType.FLOAT))]
        return self.op("Div", [self.op("Cast", [self.op("Size", [x])], to_float),
                               self.op("Cast", [self.op("Size", [scale])], to_float)])

    def batchnorm_function(self, op_type: str, inputs: list[ir.Value], outputs: dict[str, ir.Value],
                           attributes: list[str], opset: int) -> ir.Function:
        return self.function(BATCHNORM_DOMAIN, op_type, inputs, outputs, dict.fromkeys(attributes, _FLOAT), opset,
                             f"training BatchNormalization ({op_type}); see transpiler/batchnorm_ops.py")


def training_function(opset: int) -> ir.Function:
    x, scale, bias, running_mean, running_var = (ir.Value(name=n) for n in ("X", "scale", "B", "running_mean", "running_var"))
    b = _Body()
    axes, flat = b.ints([0, 2, 3]), b.ints([-1])
    keepdims = [ir.Attr("keepdims", ir.AttributeType.INT, 1)]
    mean4 = b.op("ReduceMean", [x, axes], keepdims)
    centered = b.op("Sub", [x, mean4])
    var4 = b.op("ReduceMean", [b.op("Mul", [centered, centered]), axes], keepdims)  # the exact two-pass variance
    mean, var = b.op("Reshape", [mean4, flat]), b.op("Reshape", [var4, flat])
    y = b.op("BatchNormalization", [x, scale, bias, mean, var], [ir.RefAttr("epsilon", "epsilon", _FLOAT)])
    count = b.per_channel_count(x, scale)
    one = b.op("Constant", [], [ir.Attr("value_float", _FLOAT, 1.0)])
    keep = b.float_attr("momentum")
    take = b.op("Sub", [one, keep])
    unbiased = b.op("Mul", [var, b.op("Div", [count, b.op("Sub", [count, one])])])
    mean_next = b.op("Add", [b.op("Mul", [running_mean, keep]), b.op("Mul", [mean, take])])
    var_next = b.op("Add", [b.op("Mul", [running_var, keep]), b.op("Mul", [unbiased, take])])
    inv_std = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [var, b.float_attr("epsilon")])])])
    outputs = {"Y": y, "running_mean_next": mean_next, "running_var_next": var_next, "saved_mean": mean,
               "saved_inv_std": inv_std}
    return b.batchnorm_function(BATCHNORM_TRAINING, [x, scale, bias, running_mean, running_var], outputs,
                                ["epsilon", "momentum"], opset)


def training_grad_function(opset: int) -> ir.Function:
    """dX = k1 * (dY - mean(dY)) - (X - mean) * k1 * inv^2 * mean(dY * (X - mean)), k1 = scale * inv;
    dscale = sum(dY * (X - mean)) * inv; dB = sum(dY) (sums and means per channel)."""
    dy, x, scale, saved_mean, inv_std = (ir.Value(name=n) for n in ("dY", "X", "scale", "saved_mean", "saved_inv_std"))
    b = _Body()
    axes, flat, channel = b.ints([0, 2, 3]), b.ints([-1]), b.ints([1, -1, 1, 1])
    keepdims = [ir.Attr("keepdims", ir.AttributeType.INT, 1)]
    inv = b.op("Reshape", [inv_std, channel])
    centered = b.op("Sub", [x, b.op("Reshape", [saved_mean, channel])])
    sum_dy = b.op("ReduceSum", [dy, axes], keepdims)
    sum_dyc = b.op("ReduceSum", [b.op("Mul", [dy, centered]), axes], keepdims)
    count = b.per_channel_count(x, scale)
    k1 = b.op("Mul", [b.op("Reshape", [scale, channel]), inv])
    k3 = b.op("Mul", [k1, b.op("Div", [sum_dy, count])])
    k2 = b.op("Mul", [k1, b.op("Mul", [b.op("Div", [sum_dyc, count]), b.op("Mul", [inv, inv])])])
    dx = b.op("Sub", [b.op("Sub", [b.op("Mul", [dy, k1]), k3]), b.op("Mul", [centered, k2])])
    dscale = b.op("Reshape", [b.op("Mul", [sum_dyc, inv]), flat])
    dbias = b.op("Reshape", [sum_dy, flat])
    return b.batchnorm_function(BATCHNORM_TRAINING_GRAD, [dy, x, scale, saved_mean, inv_std],
                                {"dX": dx, "dscale": dscale, "dB": dbias}, ["epsilon"], opset)
