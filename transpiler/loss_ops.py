"""The gradient of a mean-reduced SoftmaxCrossEntropyLoss as one node a backend can run natively
(docs/contracts.md):

    graph_transpiler.loss::SoftmaxCrossEntropyGrad(dloss, scores, labels, log_prob) -> dscores

Why: written in standard ops the gradient is Exp over the log-probabilities, a gather and a scatter
at the labels and a product, each a pass over a (rows, classes) tensor: for a language model's
logits (GPT-2-small: 4,096 x 50,257, 0.77 GiB in float32) four passes and as many tensors of that
size at the memory peak, besides the forward's log_prob. The GPU backend fuses the node with its
forward node into one kernel that reads the scores once for the loss and once for the gradient,
and writes the gradient straight in its consumer's dtype (runtime/gpu/cross_entropy.py).

The function is the autodiff's standard-op gradient (transpiler/autodiff/rules/losses.py) node for
node, so the CPU backend and plain onnxruntime compute the same bits as before the node existed.
"""

from __future__ import annotations

import onnx_ir as ir

from contract.ops import CROSS_ENTROPY_GRAD, LOSS_DOMAIN
from transpiler.function_body import FunctionBody


def _int(name: str, value: int | None = None, ref: str | None = None) -> ir.Attr:
    if ref is not None:
        return ir.RefAttr(name, ref, ir.AttributeType.INT)
    return ir.Attr(name, ir.AttributeType.INT, value)


def grad_function(opset: int) -> ir.Function:
    dloss, scores, labels, log_prob = (ir.Value(name=n) for n in ("dloss", "scores", "labels", "log_prob"))
    b = FunctionBody()
    to_float = [_int("to", int(ir.DataType.FLOAT))]
    wide = b.op("Cast", [labels], [_int("to", int(ir.DataType.INT64))])
    ignore = b.op("Constant", [], [_int("value_int", ref="ignore_index")])
    ignored = b.op("Equal", [wide, ignore])
    # Ignored labels may be out of range (-100): point them at class 0, their weight is 0.
    safe = b.op("Where", [ignored, b.op("Constant", [], [_int("value_int", 0)]), wide])
    weight = b.op("Cast", [b.op("Not", [ignored])], to_float)
    total = b.op("ReduceSum", [weight], [_int("keepdims", 0)])
    coefficient = b.op("Mul", [b.op("Div", [dloss, total]), weight])
    coefficient = b.op("Unsqueeze", [coefficient, b.ints([1])])
    prob = b.op("Exp", [log_prob])
    index = b.op("Unsqueeze", [safe, b.ints([1])])
    axis = [_int("axis", 1)]
    picked = b.op("GatherElements", [prob, index], axis)
    one = b.op("Constant", [], [ir.Attr("value_float", ir.AttributeType.FLOAT, 1.0)])
    diff = b.op("ScatterElements", [prob, index, b.op("Sub", [picked, one])], axis)
    return b.function(LOSS_DOMAIN, CROSS_ENTROPY_GRAD, [dloss, scores, labels, log_prob],
                      {"dscores": b.op("Mul", [coefficient, diff])}, {"ignore_index": ir.AttributeType.INT},
                      opset, "the gradient of a mean-reduced SoftmaxCrossEntropyLoss; see transpiler/loss_ops.py")
