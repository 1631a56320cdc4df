"""The reverse sweep: seed dL/dL = 1, run the rules from the loss back, sum fan-in, name results."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from transpiler.errors import TranspileError

from . import rules as _rules  # noqa: F401  (importing the package fills the rule table)
from ._context import Emitter, RuleContext, annotate, carries_gradient
from ._paths import check_supported, path_values
from ._registry import rule_for


@dataclass
class Gradients:
    """The result of `build_gradients`.

    ``grads`` maps each wrt value to its gradient (same shape and dtype), named ``grad.<name>``.
    ``order`` lists the wrt values by the position of the node producing their final gradient: the
    order the backward finishes them in, which is the order gradient buckets are formed in.
    """

    grads: dict[ir.Value, ir.Value]
    order: list[ir.Value]


def build_gradients(graph: ir.Graph, loss: ir.Value, wrt: Sequence[ir.Value]) -> Gradients:
    """Append the backward of ``loss`` with respect to ``wrt`` to ``graph`` (after its nodes).

    Raises `UnsupportedOpsError` (before changing the graph) if an op on the path has no rule.
    """
    if not (
        loss.dtype is not None
        and carries_gradient(loss)
        and loss.shape is not None
        and loss.shape.rank() == 0
    ):
        raise TranspileError(
            f"loss {loss.name!r} must be a float scalar (shape []), got {loss.dtype} with shape {loss.shape}"
        )
    check_supported(graph, loss, wrt)
    return _Backward(graph, loss, wrt).run()


class _Backward:
    def __init__(self, graph: ir.Graph, loss: ir.Value, wrt: Sequence[ir.Value]):
        self.graph = graph
        self.loss = loss
        self.wrt = list(dict.fromkeys(wrt))
        self.wrt_set = set(self.wrt)
        self.forward = list(graph)  # snapshot: the walk must not see the nodes it appends
        self.on_path = path_values(graph, loss, self.wrt)
        self.emitter = Emitter(graph)
        self.contributions: dict[ir.Value, list[ir.Value]] = {}
        # How many times each value appears in some contributions list: a value held more than
        # once (a rule passing dy through to two inputs) must not be renamed for one of them.
        self.held: Counter[ir.Value] = Counter()
        self.final: dict[ir.Value, ir.Value | None] = {}
        self.published: dict[ir.Value, ir.Value] = {}
        # A value's gradient is final once every (consumer, input slot) pair that sends it one has
        # run; counting them first lets the sum happen right after the last one, so each parameter
        # gradient appears as early in the graph as it can (communication overlaps the rest).
        self.pending: Counter[ir.Value] = Counter()
        for node in self.forward:
            for index in self._wanted_slots(node):
                self.pending[node.inputs[index]] += 1

    def _wanted_slots(self, node: ir.Node) -> list[int]:
        rule = rule_for(node)
        if rule is None or not any(v in self.on_path for v in node.outputs):
            return []
        return [
            i
            for i in rule.differentiable_inputs(node)
            if i < len(node.inputs) and node.inputs[i] in self.on_path
        ]

    def run(self) -> Gradients:
        # Not a shared constant: the seed may become a published gradient (when the loss is in wrt)
        # and be renamed.
        one = ir.tensor(np.array(1, dtype=self.loss.dtype.numpy()))
        seed = self.emitter.op("Constant", [], {"value": one}, scope=f"{self.loss.name}/grad")[0]
        self._contribute(self.loss, seed)
        self._finalize(self.loss)
        for node in reversed(self.forward):
            slots = self._wanted_slots(node)
            if not slots:
                continue
            dys = [self.final.get(v) for v in node.outputs]
            if any(dy is not None for dy in dys):
                self._apply_rule(node, dys, slots)
            for index in slots:
                value = node.inputs[index]
                self.pending[value] -= 1
                if self.pending[value] == 0:
                    self._finalize(value)
        for value in self.wrt:
            if value not in self.published:  # off the path: its gradient is zero
                self._publish(value, None)
        self._drop_superseded()
        positions = {node: i for i, node in enumerate(self.graph)}
        order = sorted(self.wrt, key=lambda v: positions[self.published[v].producer()])
        return Gradients(grads={v: self.published[v] for v in self.wrt}, order=order)

    def _drop_superseded(self) -> None:
        """Remove backward nodes nothing reads: ones a later rule replaced by a cheaper equivalent
        (``RuleContext.backward_producer``). Published gradients and graph outputs are kept."""
        published = set(self.published.values())
        for node in reversed(list(self.graph)):
            if node in self.emitter.created and not any(
                out.uses() or out.is_graph_output() or out in published for out in node.outputs
            ):
                self.graph.remove(node, safe=True)
                self.emitter.created.discard(node)

    def _apply_rule(self, node: ir.Node, dys: list[ir.Value | None], slots: list[int]) -> None:
        ctx = RuleContext(self.emitter, node, dys, slots, on_path=self.on_path)
        input_grads = list(rule_for(node).compute(ctx))
        if len(input_grads) != len(node.inputs):
            raise ctx.error(f"rule returned {len(input_grads)} gradients for {len(node.inputs)} inputs")
        for index in slots:
            if input_grads[index] is not None:
                self._contribute(node.inputs[index], input_grads[index])

    def _contribute(self, value: ir.Value, grad: ir.Value) -> None:
        annotate(grad, value)
        self.contributions.setdefault(value, []).append(grad)
        self.held[grad] += 1

    def _finalize(self, value: ir.Value) -> None:
        parts = self.contributions.pop(value, [])
        for part in parts:
            self.held[part] -= 1
        if len(parts) > 1:
            total = self.emitter.op("Sum", parts, scope=f"{value.name}/grad")[0]
            # A sequence's gradient is one dense tensor (rules/sequences.py): typed like its parts.
            annotate(total, parts[0] if isinstance(value.type, ir.SequenceType) else value)
        else:
            total = parts[0] if parts else None  # no part: every consumer's gradient was zero
        self.final[value] = total
        if value in self.wrt_set:
            self._publish(value, total)

    def _publish(self, value: ir.Value, grad: ir.Value | None) -> None:
        name = f"grad.{value.name}"
        scope = f"{value.name}/grad"
        if grad is None:
            zero = ir.tensor(np.zeros([1], dtype=value.dtype.numpy()))
            shape = self.emitter.shape_of(value, scope=scope)
            grad = self.emitter.op(
                "ConstantOfShape", [shape], {"value": zero}, scope=scope, output_names=[name]
            )[0]
        elif self._owned(grad):
            grad.name = self.emitter.unique(name)
        else:
            grad = self.emitter.op("Identity", [grad], scope=scope, output_names=[name])[0]
        annotate(grad, value)
        self.published[value] = grad

    def _owned(self, grad: ir.Value) -> bool:
        """Whether renaming ``grad`` to the published name renames nothing else: the backward made
        it, and no one else uses or holds it."""
        return (
            grad.producer() in self.emitter.created
            and not grad.uses()
            and not grad.is_graph_output()
            and self.held[grad] == 0
            and sum(1 for g in self.final.values() if g is grad) <= 1
        )
