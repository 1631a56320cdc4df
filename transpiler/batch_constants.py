"""Sizes the exporter baked into the graph from the example batch, found before anything runs.

TorchScript records Python ints as constants: ``torch.arange(len(logits))`` in a CLIP-style
contrastive loss becomes the constant ``[0, 1, 2, 3]`` for an example batch of 4, whatever
``dynamic_axes`` says (``len()`` is a Python int to the tracer; ``x.shape[0]`` is traced). dynamo
specializes the batch to 4 for the same ``len()`` and, from ``torch.onnx.export``, silently exports
with static shapes (an ``Expand`` to ``[4, 16]`` in F.normalize is then the first to show it). Each rank
then runs the graph on its own share of the batch and onnxruntime fails at run time, far from the
cause. Here the loader's symbolic batch axis (``load.BATCH_DIM``, axis 0 of every data input, carried
by shape inference) shows it: a dim of the batch axis meets a fixed size > 1 where an op needs the
two equal (broadcasting, Concat, MatMul, Gemm, the losses' sample axis).
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx_ir as ir

_BROADCAST = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Where", "Equal", "Less", "LessOrEqual", "Greater",
    "GreaterOrEqual", "And", "Or", "Xor", "Max", "Min", "Sum", "Mean", "PRelu", "BitShift", "BitwiseAnd",
    "BitwiseOr", "BitwiseXor",
})  # fmt: skip
_LOSSES = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
# Ops that only retype or reshape one input: the blame goes through them to where the size came from.
_CARRIERS = frozenset({"Cast", "CastLike", "Identity", "Neg", "Unsqueeze", "Squeeze", "Reshape", "Transpose",
                       "Expand", "Flatten"})
FIX = ("export with a dynamic batch axis (dynamic_axes / dynamic_shapes) and take sizes from tensors (x.shape[0], "
       "not len(x): both exporters bake len(), and dynamo then drops the dynamic axis without a word)")

Slot = tuple[ir.Value, int]  # (value, axis)


def _dims(value: ir.Value | None) -> list | None:
    return None if value is None or value.shape is None else list(value.shape)


def _must_agree(node: ir.Node) -> Iterator[list[Slot]]:
    """Groups of (input, axis) whose sizes the op needs equal (1 broadcasts where the op broadcasts)."""
    inputs = list(node.inputs)
    op = node.op_type
    if op in _BROADCAST:
        ranked = [(v, len(d)) for v in inputs if (d := _dims(v)) is not None]
        for back in range(1, max((r for _, r in ranked), default=0) + 1):
            yield [(v, r - back) for v, r in ranked if r >= back]
    elif op in _LOSSES and len(inputs) >= 2:
        scores, labels = _dims(inputs[0]), _dims(inputs[1])
        if scores is not None and labels is not None and len(scores) == len(labels) + 1:
            yield [(inputs[0], 0), (inputs[1], 0)]
            for axis in range(1, len(labels)):
                yield [(inputs[0], axis + 1), (inputs[1], axis)]
    elif op == "Concat":
        ranked = [v for v in inputs if (d := _dims(v)) is not None]
        if ranked:
            rank = len(_dims(ranked[0]))
            axis = node.attributes.get_int("axis", 0) % max(rank, 1)
            for a in range(rank):
                if a != axis:
                    yield [(v, a) for v in ranked if len(_dims(v)) == rank]
    elif op in ("MatMul", "Gemm") and len(inputs) >= 2:
        a, b = _dims(inputs[0]), _dims(inputs[1])
        if a is None or b is None or len(a) < 2 or len(b) < 2:
            return
        if op == "Gemm":
            yield [(inputs[0], 0 if node.attributes.get_int("transA", 0) else 1),
                   (inputs[1], 1 if node.attributes.get_int("transB", 0) else 0)]
        else:
            yield [(inputs[0], len(a) - 1), (inputs[1], len(b) - 2)]


def _is_batch(dim, batch: str) -> bool:
    return isinstance(dim, ir.SymbolicDim) and dim.value == batch


def _has_batch(value: ir.Value | None, batch: str) -> bool:
    dims = _dims(value)
    return dims is not None and any(_is_batch(d, batch) for d in dims)


def _source(value: ir.Value, batch: str) -> str:
    """Where ``value``'s fixed size comes from: the node or initializer, through the _CARRIERS."""
    while True:
        node = value.producer()
        if node is None:
            return f"initializer '{value.name}'" if value.is_initializer() else f"input '{value.name}'"
        head = node.inputs[0] if node.inputs else None
        if node.op_type in _CARRIERS and head is not None and not _has_batch(head, batch):
            value = head
            continue
        name = node.name or value.name or "?"
        if name.endswith("/folded"):  # load.py folds integer-only nodes (a Range of constants) into Constants
            return f"node '{name.removesuffix('/folded')}' (computed from constants only)"
        return f"{node.op_type} node '{name}'"


def baked_batch_size(graph: ir.Graph, batch: str) -> str | None:
    """One line naming the first value with a baked batch size and the node where it meets the batch
    axis, or None. ``batch`` is the symbolic name of the data inputs' axis 0."""
    for node in graph:
        for group in _must_agree(node):
            dims = [(value, _dims(value)[axis]) for value, axis in group if value is not None]
            if not any(_is_batch(d, batch) for _, d in dims):
                continue
            fixed = next(((v, d) for v, d in dims if isinstance(d, int) and d > 1), None)
            if fixed is None:
                continue
            value, size = fixed
            shape = [d if isinstance(d, int) else str(d) for d in _dims(value)]
            return (f"{_source(value, batch)} (value '{value.name}', shape {shape}) meets the batch axis in "
                    f"{node.op_type} node '{node.name or '?'}': the exporter baked the example batch size "
                    f"({size}) into the graph, which then runs at that batch only, not at each rank's share; "
                    f"{FIX}")
    return None
