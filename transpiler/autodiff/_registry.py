"""The gradient rule table: one entry per ONNX op type (default domain), filled by decorators.

A rule receives a ``RuleContext`` (the forward node, the gradients of its outputs, an emitter for
backward ops) and returns one gradient per node input, ``None`` where no gradient flows. Rules only
have to build the gradients the backward asks for (``ctx.wants(i)``); ``ctx.wanted_grads`` does that
bookkeeping.

Adding a rule is one decorated function in a module of ``transpiler/autodiff/rules/`` (see
docs/ops.md), plus one line in the spec table of ``tests/test_autodiff_rules.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import onnx_ir as ir

from ._context import RuleContext

Rule = Callable[[RuleContext], Sequence["ir.Value | None"]]

# ONNX writes the default domain either as "" or as "ai.onnx".
_DEFAULT_DOMAINS = frozenset({"", "ai.onnx"})


@dataclass(frozen=True)
class GradientRule:
    op_type: str
    compute: Rule
    # Indices of the inputs a gradient can flow into; the others (shapes, axes, conditions) cut the
    # path, which is what `differentiable_values` relies on to find trainable parameters.
    differentiable_inputs: Callable[[ir.Node], Sequence[int]]


_RULES: dict[str, GradientRule] = {}
_NON_DIFFERENTIABLE: set[str] = set()


def _claim(op_type: str) -> None:
    if op_type in _RULES or op_type in _NON_DIFFERENTIABLE:
        raise ValueError(f"op type {op_type!r} already has a gradient rule or is marked non-differentiable")


def register(
    *op_types: str, inputs: Sequence[int] | Callable[[ir.Node], Sequence[int]] | None = None
) -> Callable[[Rule], Rule]:
    """Register ``fn(ctx) -> [grad of input 0, grad of input 1, ...]`` for ``op_types``.

    ``inputs`` lists the input indices that can receive a gradient; ``None`` means all of them; a
    callable decides per node (BatchNormalization fed with its own batch statistics differentiates
    through them itself, so those inputs pass nothing).
    """
    if callable(inputs):
        selector = inputs
    elif inputs is None:

        def selector(node: ir.Node) -> Sequence[int]:
            return range(len(node.inputs))
    else:
        fixed = tuple(inputs)

        def selector(node: ir.Node) -> Sequence[int]:
            return fixed

    def decorate(fn: Rule) -> Rule:
        for op_type in op_types:
            _claim(op_type)
            _RULES[op_type] = GradientRule(op_type, fn, selector)
        return fn

    return decorate


def linear(*op_types: str) -> Callable[[Callable[[RuleContext, ir.Value], ir.Value]], Rule]:
    """Register ops that are linear in input 0, whose other inputs are parameters (shape, axes, perm).

    The decorated ``fn(ctx, dy) -> dx`` is the transpose of the op applied to the output gradient.
    """

    def decorate(transpose: Callable[[RuleContext, ir.Value], ir.Value]) -> Rule:
        def rule(ctx: RuleContext) -> list[ir.Value | None]:
            return ctx.wanted_grads(lambda: transpose(ctx, ctx.dy))

        register(*op_types, inputs=(0,))(rule)
        return rule

    return decorate


def unary_from_output(*op_types: str) -> Callable[[Callable[[RuleContext, ir.Value], ir.Value]], Rule]:
    """Register elementwise unary ops whose derivative is cheapest written in terms of the output.

    The decorated ``fn(ctx, y) -> dy/dx`` builds the local derivative; the rule multiplies it by the
    output gradient. Using the output (tanh' = 1 - y^2) avoids recomputing the forward op.
    """

    def decorate(derivative: Callable[[RuleContext, ir.Value], ir.Value]) -> Rule:
        def rule(ctx: RuleContext) -> list[ir.Value | None]:
            y = ctx.output
            return ctx.wanted_grads(lambda: ctx.op("Mul", [ctx.dy, derivative(ctx, y)], like=y))

        register(*op_types, inputs=(0,))(rule)
        return rule

    return decorate


def non_differentiable(*op_types: str) -> None:
    """Mark ops that pass no gradient: integer/boolean results, piecewise-constant functions, sources.

    They may sit on the path to the loss without an error; the path is cut there.
    """
    for op_type in op_types:
        _claim(op_type)
        _NON_DIFFERENTIABLE.add(op_type)


def op_key(node: ir.Node) -> str:
    """The table key: the op type for the default domain, ``domain::OpType`` for others."""
    return node.op_type if node.domain in _DEFAULT_DOMAINS else f"{node.domain}::{node.op_type}"


def rule_for(node: ir.Node) -> GradientRule | None:
    return _RULES.get(op_key(node))


def is_non_differentiable(node: ir.Node) -> bool:
    return op_key(node) in _NON_DIFFERENTIABLE


def registered_ops() -> frozenset[str]:
    """Default-domain op types that have a gradient rule (each has a finite-difference spec)."""
    return frozenset(k for k in _RULES if "::" not in k)


def registered_collective_ops() -> frozenset[str]:
    """``domain::OpType`` of the collectives that have a rule. onnxruntime cannot run them alone, so
    their check is end to end: N ranks == one device through them (tests/test_batchnorm.py)."""
    return frozenset(k for k in _RULES if "::" in k)


def non_differentiable_ops() -> frozenset[str]:
    """Op types known to pass no gradient."""
    return frozenset(_NON_DIFFERENTIABLE)
