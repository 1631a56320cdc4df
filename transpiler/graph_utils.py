"""Graph helpers the rank builder shares: collective ordering, dead-code removal, constants."""

from __future__ import annotations

import onnx_ir as ir

from transpiler.collectives import DOMAIN
from transpiler.names import AFTER_GRADIENTS


def number_collectives(graph: ir.Graph) -> None:
    """Give every collective its ``order``: the sequence every rank issues them in.

    The key must be the same on every rank although the graphs differ (a non-root Broadcast has no
    inputs, only roots run updates). It is built from the forward/backward, which every rank shares
    node for node:
    - a collective inside the forward/backward (--sync-bn statistics; created with order -1) is
      keyed by its own position;
    - a gradient collective (appended afterwards, in the strategy's sequence) by the position of
      the last of its input gradients, so a bucket's collective comes as early as its gradients
      allow and never waits behind a later part of the backward;
    - the sum of the ranks' squared gradient norms (--clip-grad-norm; created with order
      AFTER_GRADIENTS) after every gradient collective, since it reads all their results;
    - collectives that follow optimizer updates (Broadcast, AllGather) come last, in their appended
      sequence.
    The result is a topological order of the collectives, so issuing them in it cannot deadlock.
    """
    nodes = list(graph)
    position = {out: i for i, node in enumerate(nodes) for out in node.outputs}
    ranked = []
    for sequence, node in enumerate(n for n in nodes if n.domain == DOMAIN):
        if node.attributes["order"].as_int() == AFTER_GRADIENTS:
            key = (len(nodes), -1)
        elif node.attributes["order"].as_int() < 0:
            key = (nodes.index(node), sequence)
        elif node.op_type in ("Broadcast", "AllGather"):
            key = (len(nodes), sequence)
        else:
            key = (max((position.get(v, -1) for v in node.inputs if v is not None), default=-1), sequence)
        ranked.append((key, node))
    for order, (_, node) in enumerate(sorted(ranked, key=lambda item: item[0])):
        node.attributes["order"] = ir.AttrInt64("order", order)


def register_constant(graph: ir.Graph, tensor: ir.TensorProtocol) -> ir.Value:
    value = ir.val(tensor.name, tensor.dtype, tensor.shape, const_value=tensor)
    graph.register_initializer(value)
    return value


def remove_unused(graph: ir.Graph) -> None:
    """Drop nodes whose outputs nothing uses (e.g. gradients of a frozen branch)."""
    live = set(graph.outputs)
    keep = []
    for node in reversed(list(graph)):
        if node.domain == DOMAIN or any(out in live for out in node.outputs):
            keep.append(node)
            live.update(v for v in node.inputs if v is not None)
    dead = [n for n in graph if n not in keep]
    if dead:
        graph.remove(dead, safe=False)
    for name in [n for n, v in graph.initializers.items() if v not in live]:
        graph.initializers.pop(name)
