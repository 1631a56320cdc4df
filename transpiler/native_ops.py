"""The model-local functions of the transpiler's own ops (contract/ops.py), one table.

Every such node is something a backend may run natively; its function says in standard ops what it
computes, so onnx.checker, plain onnxruntime (which inlines it), Netron and the CPU backend read
and compute it. Whoever writes such nodes into a model calls ``add_op_functions`` on it (the
BatchNorm decomposition, the autodiff pass, test helpers).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from contract.ops import (
    ATTENTION,
    ATTENTION_DOMAIN,
    ATTENTION_GRAD,
    ATTENTION_VERSION,
    BATCHNORM_DOMAIN,
    BATCHNORM_TRAINING,
    BATCHNORM_TRAINING_GRAD,
    BATCHNORM_VERSION,
    CONV_GRAD_DOMAIN,
    CONV_GRAD_VERSION,
    CONV_WEIGHT_GRAD,
    CROSS_ENTROPY_GRAD,
    LAYERNORM_DOMAIN,
    LAYERNORM_GRAD,
    LAYERNORM_VERSION,
    LOSS_DOMAIN,
    LOSS_VERSION,
)
from transpiler.attention_ops import forward_function as attention_function
from transpiler.attention_ops import grad_function as attention_grad_function
from transpiler.batchnorm_ops import training_function, training_grad_function
from transpiler.conv_grad import weight_grad_function
from transpiler.layernorm_ops import grad_function as layernorm_grad_function
from transpiler.loss_ops import grad_function as cross_entropy_grad_function

# (domain, op type) -> (domain version, the function for the model's default-domain opset)
FUNCTIONS: dict[tuple[str, str], tuple[int, Callable[[int], ir.Function]]] = {
    (CONV_GRAD_DOMAIN, CONV_WEIGHT_GRAD): (CONV_GRAD_VERSION, weight_grad_function),
    (BATCHNORM_DOMAIN, BATCHNORM_TRAINING): (BATCHNORM_VERSION, training_function),
    (BATCHNORM_DOMAIN, BATCHNORM_TRAINING_GRAD): (BATCHNORM_VERSION, training_grad_function),
    (LAYERNORM_DOMAIN, LAYERNORM_GRAD): (LAYERNORM_VERSION, layernorm_grad_function),
    (ATTENTION_DOMAIN, ATTENTION): (ATTENTION_VERSION, attention_function),
    (ATTENTION_DOMAIN, ATTENTION_GRAD): (ATTENTION_VERSION, attention_grad_function),
    (LOSS_DOMAIN, CROSS_ENTROPY_GRAD): (LOSS_VERSION, cross_entropy_grad_function),
}


def add_op_functions(model: ir.Model) -> set[tuple[str, str]]:
    """Give ``model`` the function (and the opset import) of each of these ops its graph uses and it
    lacks; returns the (domain, op type) pairs its graph uses."""
    used = {(node.domain, node.op_type) for node in model.graph} & FUNCTIONS.keys()
    for domain, op_type in sorted(used):
        version, build = FUNCTIONS[(domain, op_type)]
        if (domain, op_type, "") not in model.functions:
            model.functions[(domain, op_type, "")] = build(model.graph.opset_imports.get("", 18))
        model.graph.opset_imports[domain] = version
    if used:
        model.ir_version = max(model.ir_version, 8)  # model-local functions need IR version 8
    return used
