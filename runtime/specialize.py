"""Specialize a segment to the shapes it runs with: every value computable from constants and static
shapes becomes an initializer.

Why: the rank graphs keep the batch dimension symbolic, so the backward computes shapes at run time
(Shape -> Sub -> ConstantOfShape -> Equal -> NonZero -> ReduceSum axes, say). On a GPU those small
integer computations run on the CPU and onnxruntime inserts device<->host copies around them, which
stalls the stream and rules out CUDA graphs (they need every node on the CUDA EP). A run knows its
per-rank batch when it starts, so it can fold all of it away once: then only the tensor arithmetic
is left, with constant shapes, axes and indices.

Invariant: the specialized model computes exactly what the original computes for inputs of the
given shapes (folding evaluates the same ONNX ops on the same constant values; float arithmetic on
activations is never folded, since it never depends on constants alone).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from contract.collectives import DOMAIN as COLLECTIVE_DOMAIN
from contract.collectives import SHAPED_BY_INPUT

# A folded value becomes an initializer: shape computations are tiny; a large constant tensor is
# cheaper computed on the device (ConstantOfShape) than stored and copied.
# (1 << 18 elements: a [512, 512] attention mask, folded here once instead of rebuilt each step
# where onnxruntime's own constant folding is off: runtime/gpu/session.py.)
FOLD_LIMIT = 1 << 18  # elements
# Ops that must never be evaluated ahead of time (random, or with side effects on state).
_NEVER = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                    "Bernoulli", "Dropout"})
NEVER_FOLDED = _NEVER  # for other passes that must not evaluate these ahead of time either
_MAX_ROUNDS = 8  # folding then re-inferring converges in 2-3 rounds on the graphs seen
# Float results are folded only where every implementation rounds the same way (IEEE basic
# operations, data movement); a transcendental (Exp, Pow, Erf...) may differ by an ulp between numpy
# and the device, so it stays in the graph and the device computes it as it would have.
_EXACT_FLOAT_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sqrt", "Cast", "CastLike", "Identity", "Reshape", "Flatten",
    "Squeeze", "Unsqueeze", "Concat", "Slice", "Gather", "Transpose", "Expand", "Tile", "Where",
    "ConstantOfShape", "Max", "Min", "Equal", "Less", "Greater", "Not", "And", "Or",
})


def specialize(model: onnx.ModelProto, input_shapes: dict[str, tuple[int, ...]], *,
               world: int | None = None) -> onnx.ModelProto:
    """A copy of ``model`` whose graph inputs named in ``input_shapes`` have those static shapes and
    whose shape computations are folded into initializers. ``world``: the ranks, for the outputs of
    collectives shaped by their input (contract SHAPED_BY_INPUT: an AllConcat kept in the segment),
    which onnx's inference cannot type; without it they stay untyped."""
    model = _with_static_inputs(model, input_shapes)
    if not any(n.domain == COLLECTIVE_DOMAIN and n.op_type in SHAPED_BY_INPUT for n in model.graph.node):
        world = None  # nothing to type: no round of typing (the usual segment)
    for _ in range(_MAX_ROUNDS):
        model = _infer(model)
        # An output typed here is typed downstream by the next round's inference.
        typed = world is not None and _type_concatenations(model.graph, world)
        if not _fold_once(model) and not typed:
            break
    _drop_unused_initializers(model.graph)
    return model


def remaining_shape_ops(model: onnx.ModelProto) -> list[str]:
    """Names of nodes that still compute shapes at run time (a diagnostic for CUDA-graph refusals)."""
    return [n.name or n.op_type for n in model.graph.node if n.op_type in ("Shape", "Size", "NonZero")]


def _with_static_inputs(model: onnx.ModelProto, input_shapes: dict[str, tuple[int, ...]]) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    for value in graph.input:
        shape = input_shapes.get(value.name)
        if shape is None or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape.dim
        del dims[:]
        for size in shape:
            dims.add().dim_value = int(size)
    # Intermediate and output shapes were inferred for the symbolic batch: infer them again, except
    # the static shapes of what ops onnx can neither look up nor expand compute (no schema, no
    # function: a collective's outputs where the cut keeps it in the segment), which inference
    # could not give again.
    functions = {(f.domain, f.name) for f in copy.functions}
    foreign = {o for n in graph.node if n.domain not in ("", "ai.onnx") and (n.domain, n.op_type) not in functions
               for o in n.output}
    keep = [v for v in graph.value_info if v.name in foreign and v.type.HasField("tensor_type")
            and all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)]
    del graph.value_info[:]
    graph.value_info.extend(keep)
    for value in graph.output:
        if value.type.HasField("tensor_type") and not (
                value.name in foreign and all(d.HasField("dim_value") for d in value.type.tensor_type.shape.dim)):
            value.type.tensor_type.ClearField("shape")
    return copy


def _type_concatenations(graph: onnx.GraphProto, world: int) -> bool:
    """Give each AllConcat output whose input has a static shape its type (N times the input's first
    dimension), as value_info or, for a graph output, on the output itself; whether any was new."""
    known = static_values(graph)
    outputs = {v.name: v for v in graph.output}
    new = False
    for node in graph.node:
        if node.domain != COLLECTIVE_DOMAIN or node.op_type not in SHAPED_BY_INPUT:
            continue
        name = node.output[0]
        if name in known or node.input[0] not in known:
            continue
        shape, dtype = known[node.input[0]]
        typed = helper.make_tensor_value_info(name, dtype, [world * shape[0], *shape[1:]])
        if name in outputs:
            outputs[name].type.CopyFrom(typed.type)
        else:
            graph.value_info.append(typed)
        new = True
    return new


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    """Initializers that only fed folded nodes (onnxruntime would warn about each)."""
    used = {name for node in graph.node for name in node.input} | {value.name for value in graph.output}
    keep = [t for t in graph.initializer if t.name in used]
    if len(keep) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(keep)


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # a model inference cannot take (e.g. over 2 GB): folding does what it can
        return model


def static_values(graph: onnx.GraphProto) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (static shape, element type: TensorProto's code, 0 if unknown) of every value of
    ``graph`` whose shape is fully known (as inference left it, and every initializer)."""
    values: dict[str, tuple[tuple[int, ...], int]] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        t = value.type.tensor_type if value.type.HasField("tensor_type") else None
        if t is None or not t.HasField("shape"):
            continue
        if all(d.HasField("dim_value") for d in t.shape.dim):
            values[value.name] = (tuple(d.dim_value for d in t.shape.dim), t.elem_type)
    for init in graph.initializer:
        values[init.name] = (tuple(init.dims), init.data_type)
    return values


def _static_shapes(graph: onnx.GraphProto) -> dict[str, tuple[int, ...]]:
    return {name: shape for name, (shape, _) in static_values(graph).items()}


def _fold_once(model: onnx.ModelProto) -> bool:
    """Fold every node whose value is known; True if any node was folded."""
    graph = model.graph
    shapes = _static_shapes(graph)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
    fed = {value.name for value in graph.input}
    known: dict[str, np.ndarray] = {
        t.name: numpy_helper.to_array(t) for t in graph.initializer
        if t.name not in fed and int(np.prod(t.dims, dtype=np.int64)) <= FOLD_LIMIT
    }
    outputs = {value.name for value in graph.output}
    folded: list[onnx.NodeProto] = []
    # A folded node that writes a graph output becomes Constant nodes (an initializer cannot be a
    # graph output of a segment); the runtime then sees the output is a constant (session.py).
    as_constants: dict[int, list[onnx.NodeProto]] = {}
    for node in graph.node:
        value = _evaluate(node, known, shapes, opset)
        if value is None:
            continue
        for name, array in zip(node.output, value):
            known[name] = array
        if node.op_type == "Constant":
            continue
        folded.append(node)
        if outputs.intersection(node.output):
            as_constants[id(node)] = [helper.make_node("Constant", [], [name], value=numpy_helper.from_array(known[name], name))
                                      for name in node.output if name in outputs]
    if not folded:
        return False
    gone = {id(node) for node in folded}
    keep = [new for node in graph.node for new in (as_constants.get(id(node), []) if id(node) in gone else [node])]
    used = {name for node in keep for name in node.input} | outputs
    for node in folded:
        for name in node.output:
            if name in used and name not in outputs:
                graph.initializer.append(numpy_helper.from_array(known[name], name))
    del graph.node[:]
    graph.node.extend(keep)
    return True


def _evaluate(node: onnx.NodeProto, known: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]],
              opset: int) -> list[np.ndarray] | None:
    """The node's output values if they follow from constants and static shapes and are small."""
    if node.domain not in ("", "ai.onnx") or node.op_type in _NEVER:
        return None
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return None
    if node.op_type == "Shape":
        shape = shapes.get(node.input[0])
        if shape is None:
            return None
        attrs = {a.name: a.i for a in node.attribute}
        start, end = attrs.get("start", 0), attrs.get("end", len(shape))
        return [np.array(shape[start:end] if end is not None else shape[start:], dtype=np.int64)]
    if node.op_type == "Size":
        shape = shapes.get(node.input[0])
        return None if shape is None else [np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)]
    if node.op_type == "Constant":
        attr = node.attribute[0]
        if attr.name != "value":
            return None
        array = numpy_helper.to_array(attr.t)
        return [array] if array.size <= FOLD_LIMIT else None
    inputs = [name for name in node.input if name]
    if not inputs or any(name not in known for name in inputs):
        return None
    for name in node.output:
        shape = shapes.get(name)
        if shape is not None and int(np.prod(shape, dtype=np.int64)) > FOLD_LIMIT:
            return None
    results = _run_one(node, known, opset)
    if results is None or any(r.size > FOLD_LIMIT for r in results):
        return None
    if node.op_type not in _EXACT_FLOAT_OPS and any(np.issubdtype(r.dtype, np.floating) for r in results):
        return None
    return results


def _run_one(node: onnx.NodeProto, known: dict[str, np.ndarray], opset: int) -> list[np.ndarray] | None:
    """Evaluate one standard node with onnx's reference implementation."""
    from onnx.reference import ReferenceEvaluator

    inputs = [name for name in node.input if name]
    graph = helper.make_graph(
        [node], "fold", inputs=[],
        outputs=[helper.make_empty_tensor_value_info(name) for name in node.output if name],
        initializer=[numpy_helper.from_array(known[name], name) for name in dict.fromkeys(inputs)],
    )
    try:
        evaluator = ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))
        results = evaluator.run(None, {})
    except Exception:  # an op the reference lacks, or inputs it rejects: leave it to run time
        return None
    return [np.asarray(r) for r in results]
