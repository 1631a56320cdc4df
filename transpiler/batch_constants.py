"""Sizes the exporter baked into the graph from the example batch, found before anything runs.

TorchScript records Python ints as constants: ``torch.arange(len(logits))`` in a CLIP-style
contrastive loss becomes the constant ``[0, 1, 2, 3]`` for an example batch of 4, whatever
``dynamic_axes`` says (``len()`` is a Python int to the tracer; ``x.shape[0]`` is traced). dynamo
specializes the batch to 4 for the same ``len()`` and, from ``torch.onnx.export``, silently exports
with static shapes (an ``Expand`` to ``[4, 16]`` in F.normalize is then the first to show it). Each rank
then runs the graph on its own share of the batch and onnxruntime fails at run time, far from the
cause. Here the batch axis shows it: a dim of the batch axis meets a fixed size > 1 where an op
needs the two equal (broadcasting, Concat, MatMul, Gemm, the losses' sample axis), or a Reshape gives
a tensor of the batch axis a shape that is fixed whole.

Which dims are of the batch axis: the loader's symbolic batch (``load.BATCH_DIM``, axis 0 of every
data input), where shape inference carries it, and the dims that differ between two shape
inferences with the batch set to two sizes (``load._shapes_at``). The symbol alone is lost at the
first ``Reshape(x, [-1, n])``, which real models do at once (transformers' CLIP text tower views
its input_ids as ``(-1, seq)``): onnx names the -1 dim anew. With concrete sizes inference
computes it, and a dim equal in both runs is fixed.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
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
BATCH = "batch axis"  # a dim that follows the batch
Runs = dict[int, dict[str, list]]  # batch size -> value name -> dims (None: unknown)


class _Dims:
    """Each value's dims as fixed ints, BATCH, or None (unknown)."""

    def __init__(self, batch: str, runs: Runs) -> None:
        self.batch = batch
        self.runs = [runs[rows] for rows in sorted(runs)][:2] if len(runs) >= 2 else []
        self.rows = sorted(runs)[:2] if len(runs) >= 2 else []

    def concrete(self, value: ir.Value) -> list[list | None]:
        return [run.get(value.name) for run in self.runs]

    def __call__(self, value: ir.Value | None) -> list | None:
        if value is None:
            return None
        symbolic = None if value.shape is None else list(value.shape)
        concrete = self.concrete(value)
        rank = len(symbolic) if symbolic is not None else next((len(c) for c in concrete if c is not None), None)
        if rank is None:
            return None
        usable = [c for c in concrete if c is not None and len(c) == rank]
        dims: list = []
        for axis in range(rank):
            s = symbolic[axis] if symbolic is not None and len(symbolic) == rank else None
            sizes = [c[axis] for c in usable] if len(usable) == 2 else []
            if (isinstance(s, ir.SymbolicDim) and s.value == self.batch) or (
                    None not in sizes and len(set(sizes)) == 2):
                dims.append(BATCH)
            elif isinstance(s, int):
                dims.append(s)
            elif sizes and None not in sizes:
                dims.append(sizes[0])  # equal at both batch sizes: fixed
            else:
                dims.append(None)
        return dims

    def example_batch(self, x: ir.Value, fixed: int, axis: int | None = None) -> int | None:
        """The batch size at which x's dim ``axis`` (None: its element count), which follows the
        batch linearly, equals ``fixed``; None where that cannot be told."""
        concrete = self.concrete(x)
        if len(concrete) != 2 or any(c is None for c in concrete):
            return None
        if axis is None:
            if any(None in c for c in concrete):
                return None
            sizes = [int(np.prod(c)) for c in concrete]
        else:
            sizes = [c[axis] if axis < len(c) else None for c in concrete]
            if None in sizes:
                return None
        per_row, rest = divmod(sizes[1] - sizes[0], self.rows[1] - self.rows[0])
        offset = sizes[0] - per_row * self.rows[0]
        if rest or per_row <= 0 or (fixed - offset) % per_row or fixed <= offset:
            return None
        return (fixed - offset) // per_row


def _must_agree(node: ir.Node, dims_of: _Dims) -> Iterator[list[Slot]]:
    """Groups of (input, axis) whose sizes the op needs equal (1 broadcasts where the op broadcasts)."""
    inputs = list(node.inputs)
    op = node.op_type
    if op in _BROADCAST:
        ranked = [(v, len(d)) for v in inputs if (d := dims_of(v)) is not None]
        for back in range(1, max((r for _, r in ranked), default=0) + 1):
            yield [(v, r - back) for v, r in ranked if r >= back]
    elif op in _LOSSES and len(inputs) >= 2:
        scores, labels = dims_of(inputs[0]), dims_of(inputs[1])
        if scores is not None and labels is not None and len(scores) == len(labels) + 1:
            yield [(inputs[0], 0), (inputs[1], 0)]
            for axis in range(1, len(labels)):
                yield [(inputs[0], axis + 1), (inputs[1], axis)]
    elif op == "Concat":
        ranked = [(v, d) for v in inputs if (d := dims_of(v)) is not None]
        if ranked:
            rank = len(ranked[0][1])
            axis = node.attributes.get_int("axis", 0) % max(rank, 1)
            for a in range(rank):
                if a != axis:
                    yield [(v, a) for v, d in ranked if len(d) == rank]
    elif op in ("MatMul", "Gemm") and len(inputs) >= 2:
        a, b = dims_of(inputs[0]), dims_of(inputs[1])
        if a is None or b is None or len(a) < 2 or len(b) < 2:
            return
        if op == "Gemm":
            yield [(inputs[0], 0 if node.attributes.get_int("transA", 0) else 1),
                   (inputs[1], 1 if node.attributes.get_int("transB", 0) else 0)]
        else:
            yield [(inputs[0], len(a) - 1), (inputs[1], len(b) - 2)]


def _source(value: ir.Value, dims_of: _Dims) -> str:
    """Where ``value``'s fixed size comes from: the node or initializer, through the _CARRIERS."""
    while True:
        node = value.producer()
        if node is None:
            return f"initializer '{value.name}'" if value.is_initializer() else f"input '{value.name}'"
        head = node.inputs[0] if node.inputs else None
        if node.op_type in _CARRIERS and head is not None and BATCH not in (dims_of(head) or []):
            value = head
            continue
        name = node.name or value.name or "?"
        if name.endswith("/folded"):  # load.py folds integer-only nodes (a Range of constants) into Constants
            return f"node '{name.removesuffix('/folded')}' (computed from constants only)"
        return f"{node.op_type} node '{name}'"


def _symbol_at(value: ir.Value, axis: int, batch: str) -> bool:
    dim = None if value.shape is None or axis >= len(value.shape) else value.shape[axis]
    return isinstance(dim, ir.SymbolicDim) and dim.value == batch


def _baked(source: str, what: str, node: ir.Node, size: int | None) -> str:
    size_text = f" ({size})" if size is not None else ""
    return (f"{source} ({what}) meets the batch axis in {node.op_type} node '{node.name or '?'}': the exporter baked "
            f"the example batch size{size_text} into the graph, which then runs at that batch only, not at each "
            f"rank's share; {FIX}")


def baked_batch_size(graph: ir.Graph, batch: str, runs: Runs | None = None) -> str | None:
    """One line naming the first value with a baked batch size and the node where it meets the batch
    axis, or None. ``batch`` is the symbolic name of the data inputs' axis 0; ``runs`` maps two batch
    sizes to every value's dims inferred at that size (without them, the symbol alone)."""
    dims_of = _Dims(batch, runs or {})
    for node in graph:
        for group in _must_agree(node, dims_of):
            dims = [(value, dims_of(value)[axis]) for value, axis in group if value is not None]
            if not any(d == BATCH for _, d in dims):
                continue
            fixed = next(((v, d) for v, d in dims if isinstance(d, int) and d > 1), None)
            if fixed is None:
                continue
            value, size = fixed
            if dims_of.runs:  # the batch at which the dim that follows it has this size (2B rows: B = size / 2)
                follower, axis = next((v, a) for v, a in group if v is not None and dims_of(v)[a] == BATCH)
                size = dims_of.example_batch(follower, size, axis) or (size if _symbol_at(follower, axis, batch)
                                                                        else None)
            shape = ["?" if d is None else d if isinstance(d, int) else "batch" for d in dims_of(value)]
            return _baked(_source(value, dims_of), f"value '{value.name}', shape {shape}", node, size)
        if node.op_type == "Reshape" and len(node.inputs) >= 2 and node.inputs[1] is not None:
            # A tensor of the batch axis given a shape fixed whole: it reshapes at one batch size only.
            x, target = node.inputs[0], node.inputs[1]
            out = dims_of(node.outputs[0])
            if BATCH in (dims_of(x) or []) and out and all(isinstance(d, int) for d in out):
                return _baked(_source(target, dims_of), f"value '{target.name}', the shape {out}", node,
                              dims_of.example_batch(x, int(np.prod(out))))
    return None
