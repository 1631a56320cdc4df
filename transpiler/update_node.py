"""The optimizer update as one fused node per parameter (or ``zero`` slice): domain
``graph_transpiler.optimizer``, ops ``SGD``/``Momentum``/``Adam``/``AdamW`` (docs/contracts.md).

The node's model-local function is ``transpiler.optimizer.emit_update``'s exact ops, so onnx.checker,
onnxruntime (which inlines it) and Netron read the node as those ops and compute the same numbers;
a backend with a native kernel for the domain (the GPU's multi-tensor kernel) runs it instead.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from contract.ops import FUSED_UPDATE_DOMAIN, FUSED_UPDATE_VERSION
from transpiler.optimizer import Emitter, check_update_arguments, emit_update, unique_name
from transpiler.optimizer_table import OptimizerConfig

__all__ = ["emit_fused_update", "fused_attributes"]

_FLOAT = ir.DataType.FLOAT

# One op per optimizer, in the fused-update domain (contract/ops.py), apart from the collectives'
# domain "graph_transpiler" so that the runtime tells them apart.
_FUSED_OP = {"sgd": "SGD", "momentum": "Momentum", "adam": "Adam", "adamw": "AdamW"}


def fused_attributes(config: OptimizerConfig) -> dict[str, float | int]:
    """The hyper-parameters a fused update node carries, as the runtime reads them (docs/contracts.md).

    Floats are the Python (float64) values the user gave: the update rounds each to float32 where
    torch's kernels take it, and keeps float64 where torch's Python scalar math does (beta powers,
    AdamW's ``1 - lr*wd``), so the node stores them as float64 scalar tensors, not float attributes.
    """
    if config.name == "sgd":
        return {"weight_decay": config.weight_decay}
    if config.name == "momentum":
        return {"momentum": config.momentum, "weight_decay": config.weight_decay, "nesterov": int(config.nesterov)}
    beta1, beta2 = config.betas
    return {"beta1": beta1, "beta2": beta2, "eps": config.eps, "weight_decay": config.weight_decay}


def emit_fused_update(
    model: ir.Model,
    config: OptimizerConfig,
    *,
    param: ir.Value,
    grad: ir.Value,
    lr: ir.Value,
    step: ir.Value | None,
    state: dict[str, ir.Value],
    name: str,
) -> tuple[ir.Value, dict[str, ir.Value]]:
    """Append the update of one parameter (or zero slice) to ``model.graph`` as one fused node.

    Same arguments, results and output names as ``emit_update``. The node is
    ``graph_transpiler.optimizer::{SGD|Momentum|Adam|AdamW}(param, grad, lr, [step], *slots) ->
    (param.next, *slots.next)`` with the hyper-parameters as attributes (``fused_attributes``). Its
    model-local function, added to ``model.functions`` once, is ``emit_update``'s exact (float64-FMA)
    ops, so onnx.checker, onnxruntime (which inlines it) and Netron read the node as those ops and
    compute today's numbers; a backend with a native kernel for the domain runs it instead.
    The function's body bakes the configuration in, so one graph holds updates of one configuration.
    """
    check_update_arguments(config, param, state, step, name)
    graph = model.graph
    function = _update_function(model, config)
    inputs = [param, grad, lr, *([step] if config.uses_step() else []), *(state[slot] for slot in config.slots())]
    emitter = Emitter(graph, prefix=f"{name}.{config.name}")
    attributes = [
        ir.AttrInt64(key, value) if isinstance(value, int) else
        ir.AttrTensor(key, ir.tensor(np.array(value, dtype=np.float64), name=key))
        for key, value in fused_attributes(config).items()
    ]  # fmt: skip
    node = ir.Node(
        FUSED_UPDATE_DOMAIN, function.name, inputs, attributes, num_outputs=1 + len(config.slots()),
        name=unique_name(f"{name}.{config.name}", emitter.node_names),
    )
    graph.append(node)
    graph.opset_imports[FUSED_UPDATE_DOMAIN] = FUSED_UPDATE_VERSION
    model.ir_version = max(model.ir_version, 8)  # model-local functions need IR version 8
    names = [f"{name}.next", *(f"{name}.{slot}.next" for slot in config.slots())]
    for value, wanted in zip(node.outputs, names):
        value.name = emitter.unique_value_name(wanted)
        value.dtype, value.shape = _FLOAT, ir.Shape(param.shape) if param.shape is not None else None
    return node.outputs[0], dict(zip(config.slots(), node.outputs[1:]))


def _update_function(model: ir.Model, config: OptimizerConfig) -> ir.Function:
    """The model-local function of ``config``'s fused op: created on first use, then reused."""
    op_type = _FUSED_OP[config.name]
    signature = f"torch.optim {config.name} update, {fused_attributes(config)}"
    key = (FUSED_UPDATE_DOMAIN, op_type, "")
    existing = model.functions.get(key)
    if existing is not None:
        if existing.doc_string != signature:
            raise ValueError(f"{FUSED_UPDATE_DOMAIN}::{op_type}: one graph holds updates of one configuration "
                             f"(has: {existing.doc_string!r}; asked: {signature!r})")
        return existing
    body = ir.Graph([], [], nodes=[], opset_imports={"": model.graph.opset_imports.get("", 18)}, name=op_type)

    def formal(formal_name: str) -> ir.Value:
        value = ir.val(formal_name, _FLOAT, None)
        body.inputs.append(value)
        return value

    param, grad, lr = formal("param"), formal("grad"), formal("lr")
    step = formal("step") if config.uses_step() else None
    state = {slot: formal(slot) for slot in config.slots()}
    new_param, new_state = emit_update(body, config, param=param, grad=grad, lr=lr, step=step, state=state, name="param")
    new_param.name = "new_param"
    for slot, value in new_state.items():
        value.name = f"new_{slot}"
    body.outputs.extend([new_param, *(new_state[slot] for slot in config.slots())])
    # Untyped formals and values: a function is polymorphic in shape, and typed values would be written
    # as function value_info, which models of IR version < 10 may not carry.
    for value in [*body.inputs, *(out for node in body for out in node.outputs)]:
        value.type, value.shape = None, None
    declared = [ir.Attr(key, ir.AttributeType.INT if isinstance(value, int) else ir.AttributeType.TENSOR, None)
                for key, value in fused_attributes(config).items()]
    function = ir.Function(FUSED_UPDATE_DOMAIN, op_type, graph=body, attributes=declared)
    function.doc_string = signature
    model.functions[key] = function
    return function
