"""The gradient of a node's inputs as the outputs of ONE backend-native node, written only if one
is wanted: LayerNormGrad (normalization.py) and BatchNormTrainingGrad (batchnorm.py)."""

from __future__ import annotations

import onnx_ir as ir

from transpiler.autodiff._context import RuleContext, annotate


def grad_node(ctx: RuleContext, domain: str, op_type: str, inputs: list[ir.Value], attributes: dict,
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
