"""The evaluation graph (OUT/eval.onnx): the user's forward and loss in PyTorch's ``model.eval()`` mode.

One graph for every rank (it has no collectives): ``transpile run --eval-data`` feeds each rank's
shard of an evaluation batch and the rank's current parameters and buffers, and reads the loss.

What it is, from the loaded forward (``Problem.model``: opset >= 18, batch axes symbolic):
- inputs: the data inputs (as in the step graphs), then every trained parameter and every buffer
  (BatchNorm running statistics), named like the user's initializers, i.e. like the state inputs of
  the step graphs that hold their current values; frozen initializers stay constants in the graph;
- output: the loss only; nodes the loss does not need are dropped;
- BatchNormalization in inference mode (``training_mode`` 0): it normalizes with the running
  statistics fed in and updates nothing. A consumer of its running-statistics outputs (rare) reads
  the statistics unchanged, as PyTorch's eval mode leaves them;
- Dropout in inference mode (its ``training_mode`` input removed): the identity.
Those are the only standard ops whose result depends on train/eval mode. No gradient, no update.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx import helper

from contract.collectives import consumed
from contract.plan import EVAL_FILE
from transpiler.load import Problem

# The standard domain, as node.domain spells it.
_DEFAULT_DOMAINS = ("", "ai.onnx")


def eval_entry(problem: Problem) -> dict:
    """plan.json's ``eval`` field (docs/contracts.md): the graph, its loss output and the state it reads."""
    return {"graph": EVAL_FILE, "loss": problem.loss, "state": [*problem.params, *problem.buffers]}


def build_eval_graph(problem: Problem) -> onnx.ModelProto:
    """The evaluation graph of ``problem`` (see the module docstring)."""
    model = problem.model
    graph = model.graph
    fed = [*problem.params, *problem.buffers]
    data = {d.name for d in problem.data_inputs}
    # Built node by node rather than by serializing the model: the trained weights become inputs,
    # so their bytes are never copied (on a large model that copy would be the whole model).
    nodes = [ir.serde.serialize_node(node) for node in graph]
    inputs = [ir.serde.serialize_value(v) for v in graph.inputs if v.name in data]
    inputs += [ir.serde.serialize_value(graph.initializers[name]) for name in fed]
    fed_names = set(fed)
    constants = [ir.serde.serialize_tensor(v.const_value) for name, v in graph.initializers.items()
                 if name not in fed_names and v.const_value is not None]
    outputs = [ir.serde.serialize_value(v) for v in graph.outputs if v.name == problem.loss]
    nodes = _inference_mode(nodes)
    nodes, constants = _needed(nodes, constants, problem.loss)
    return helper.make_model(
        helper.make_graph(nodes, "eval", inputs, outputs, constants),
        opset_imports=[helper.make_opsetid(domain, version) for domain, version in model.opset_imports.items()],
        functions=[ir.serde.serialize_function(f) for f in model.functions.values()],
        ir_version=model.ir_version,
    )


def _inference_mode(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with BatchNormalization and Dropout switched to inference (in place)."""
    out = []
    for node in nodes:
        out.append(node)
        if node.domain in _DEFAULT_DOMAINS and node.op_type == "BatchNormalization":
            for attr in node.attribute:
                if attr.name == "training_mode":
                    attr.i = 0
            # Outputs 1 and 2 (the updated running statistics) exist only in training mode; whoever
            # reads them gets the running statistics themselves, which eval mode leaves unchanged.
            for position in (1, 2):
                if len(node.output) > position and node.output[position] and len(node.input) > position + 2:
                    out.append(helper.make_node("Identity", [node.input[position + 2]], [node.output[position]],
                                                name=f"{node.name}/eval/running_stat_{position}"))
            del node.output[1:]
        elif node.domain in _DEFAULT_DOMAINS and node.op_type == "Dropout":
            del node.input[2:]  # no training_mode input: inference, the identity (the mask is all true)
    return out


def _needed(nodes: list[onnx.NodeProto], constants: list[onnx.TensorProto], loss: str):
    """The nodes and constants the loss depends on (names a subgraph reads count as read)."""
    live = {loss}
    kept = []
    for node in reversed(nodes):
        if any(o in live for o in node.output):
            kept.append(node)
            live.update(consumed(node))
    return kept[::-1], [t for t in constants if t.name in live]
