"""Which values lie on a differentiable path between the parameters and the loss."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import onnx_ir as ir
from onnx_ir.traversal import RecursiveGraphIterator

from transpiler.errors import UnsupportedOpsError

from ._context import carries_gradient, subgraphs_of
from ._registry import is_non_differentiable, rule_for


def _captured_values(node: ir.Node) -> list[ir.Value]:
    """Outer-scope values that the subgraphs of ``node`` (If, Loop, Scan bodies) read."""
    defined: set[ir.Value] = set()
    used: list[ir.Value] = []
    scopes = [g for attr in node.attributes.values() for g in subgraphs_of(attr)]
    for subgraph in scopes:
        for inner in RecursiveGraphIterator(subgraph):
            defined.update(inner.outputs)
            used.extend(v for v in inner.inputs if v is not None)
            scopes.extend(g for attr in inner.attributes.values() for g in subgraphs_of(attr))
    for subgraph in scopes:
        defined.update(subgraph.inputs)
        defined.update(subgraph.initializers.values())
    return [v for v in dict.fromkeys(used) if v not in defined]


def gradient_inputs(node: ir.Node) -> list[ir.Value]:
    """The inputs of ``node`` a gradient can flow into.

    An op without a rule is assumed to pass a gradient to every input, subgraph captures included:
    the parameters behind it are then found, and `check_supported` reports the op, instead of those
    parameters being silently frozen.
    """
    rule = rule_for(node)
    if rule is not None:
        candidates: Iterable[ir.Value | None] = (
            node.inputs[i] for i in rule.differentiable_inputs(node) if i < len(node.inputs)
        )
    elif is_non_differentiable(node):
        return []
    else:
        candidates = [*node.inputs, *_captured_values(node)]
    return [v for v in candidates if v is not None and carries_gradient(v)]


def differentiable_values(graph: ir.Graph, loss: ir.Value) -> set[ir.Value]:
    """Every value the loss depends on through ops that pass a gradient (the loss included).

    Non-differentiable ops (Shape, comparisons, ...), non-differentiable inputs (Reshape's shape) and
    non-float values cut the path. The trainable parameters are the float initializers in this set.
    """
    found: set[ir.Value] = set()
    stack = [loss] if carries_gradient(loss) else []
    while stack:
        value = stack.pop()
        if value in found:
            continue
        found.add(value)
        producer = value.producer()
        if producer is not None and producer.graph is graph:
            stack.extend(v for v in gradient_inputs(producer) if v not in found)
    return found


def path_values(graph: ir.Graph, loss: ir.Value, wrt: Sequence[ir.Value]) -> set[ir.Value]:
    """Values on a differentiable path from some ``wrt`` value to the loss: exactly those whose
    gradient the backward has to build."""
    to_loss = differentiable_values(graph, loss)
    reached = {w for w in wrt if w in to_loss}
    for node in graph:  # topological order, so one pass propagates reachability
        if any(v in reached for v in gradient_inputs(node)):
            reached.update(v for v in node.outputs if v in to_loss)
    return reached


def check_supported(graph: ir.Graph, loss: ir.Value, wrt: Sequence[ir.Value]) -> None:
    """Raise `UnsupportedOpsError` naming every node without a gradient rule on a path from ``wrt``
    to ``loss``, all at once, so the user sees the whole list in one run."""
    on_path = path_values(graph, loss, wrt)
    unsupported = []
    for index, node in enumerate(graph):
        if rule_for(node) is not None or is_non_differentiable(node):
            continue
        if any(v in on_path for v in gradient_inputs(node)) and any(v in on_path for v in node.outputs):
            op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
            # Exporters often leave nodes unnamed: then the node's position and first output say where.
            first = node.outputs[0].name if node.outputs else "?"
            unsupported.append((op, node.name or f"#{index} -> {first}"))
    if unsupported:
        raise UnsupportedOpsError(nodes=unsupported)
