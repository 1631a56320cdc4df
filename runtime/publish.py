"""The publish of a step graph that publishes at its start (`sharded`; transpiler/strategies/sharded.py):
its leading Broadcasts alone, as a graph of their own that the Trainer runs before anything reads
the state on the host.

Such a step graph begins with one Broadcast per bucket whose inputs are the root's parameter
inputs (none on the other ranks) and whose outputs the step reads in their place. Between steps,
a rank's state of a parameter it is not the root of is what it received at the last step's start,
one update behind; the root's is current. ``publish_graph`` cuts those Broadcasts out: run on the
state, they give every rank the root's values, which is what a checkpoint, an evaluation or an
export must read. Every rank runs it at the same points (a collective), and again only after a
step (``Trainer.publish``).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from contract.names import PUBLISHED
from runtime.collectives import COLLECTIVE_DOMAIN
from runtime.errors import RunError


@dataclass(frozen=True)
class Publish:
    model: onnx.ModelProto  # inputs: the root's state inputs; outputs: STATE + PUBLISHED
    state: dict[str, str]  # publish output -> the state input it replaces


def leading_broadcasts(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The Broadcasts of ``graph`` that publish at its start: every input a graph input, and read by
    a node of the graph (a publish at the step's end is read by none: its outputs are state)."""
    inputs = {i.name for i in graph.input}
    read = {name for node in graph.node for name in node.input}
    return [n for n in graph.node if n.domain == COLLECTIVE_DOMAIN and n.op_type == "Broadcast"
            and all(name in inputs for name in n.input) and any(name in read for name in n.output)]


def publish_graph(model: onnx.ModelProto, state: dict[str, str], where: str) -> Publish | None:
    """The publish of step graph ``model`` (its file named by ``where``); ``state``: each state
    output -> its input. None where the step publishes at its end (or has nothing to publish)."""
    graph = model.graph
    nodes = sorted(leading_broadcasts(graph), key=_order)
    if not nodes:
        return None
    types = {i.name: i.type for i in graph.input}
    published: dict[str, str] = {}
    copies = []
    for k, node in enumerate(nodes):
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        for j, name in enumerate(node.output):
            # The root received its own inputs; another rank carries what it received as state.
            target = node.input[j] if node.input else state.get(name)
            if target is None or target not in types:
                raise RunError(f"{where}: Broadcast '{node.name}' publishes '{name}' at the step's start, which is "
                               "no parameter state of this rank")
            copy.output[j] = target + PUBLISHED
            published[copy.output[j]] = target
        for a in copy.attribute:
            if a.name == "order":
                a.i = k  # the same on every rank: the step's orders are
        copies.append(copy)
    inputs = [i for i in graph.input if any(i.name in n.input for n in nodes)]
    outputs = [helper.make_value_info(name, types[target]) for name, target in published.items()]
    publish = helper.make_graph(copies, f"{graph.name}.publish", inputs, outputs)
    return Publish(helper.make_model(publish, opset_imports=list(model.opset_import), ir_version=model.ir_version),
                   published)


def _order(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "order"), 0)
