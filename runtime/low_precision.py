"""bfloat16 and float16 graphs on the CPU backend: computed in float32, rounded as a GPU rounds.

onnxruntime's CPU execution provider has no bfloat16 kernel for MatMul, Gemm, Conv, Add, Softmax
or almost anything else (tests/test_precision_runtime.py lists what it lacks), and its Python API
takes no bfloat16 array (numpy has no such dtype; ml_dtypes' is refused). So the CPU backend runs a
low-precision graph (``--precision bf16|fp16``, ``--grad-dtype``) as float32 throughout, each
low-precision value held as the float32 number it equals:

- a node that computes a low-precision output computes it in float32 from its (exactly widened)
  inputs and rounds it once, ``Cast(to=low) -> Cast(to=float)``: what a GPU kernel does (a bf16
  GEMM multiplies bf16 numbers exactly, accumulates in float32 and rounds its output once; an
  elementwise bf16 kernel computes in float32 and rounds once); ops that only move or select
  elements (Reshape, Transpose, Where, Relu, ...) cannot make an unrepresentable number and are
  left as they are;
- ``Cast(to=low)`` rounds the same way; ``Cast(low -> float)`` is an Identity; constants,
  initializers and attributes of a low dtype are widened (exactly);
- the graph's inputs and outputs and the collectives' tensors of a low dtype are float32 (holding
  low-precision numbers): a collective sums them in float32 and its result is rounded once, on
  its way out. With 2 ranks that is bit for bit what NCCL's bfloat16 sum gives (one addition of
  two bf16 numbers, rounded); with more, NCCL rounds each partial sum and this path is closer to
  the exact sum.

``lower(model)`` returns the float32 model (the model itself where nothing is low precision), for a
whole step graph before the cut (``CpuBackend.prepare_step_graph``) or one segment
(``CpuBackend.compile``, for graphs that skip the preparation: the accumulate graph).
The transpiler knows nothing of this: the rank graphs stay standard ONNX with bf16/fp16 nodes, which
a GPU backend runs natively.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.inliner
from onnx import TensorProto, helper, numpy_helper

from runtime.graph_names import FreshNames
from runtime.onnx_types import value_types, with_inferred_types

__all__ = ["LOW_DTYPES", "EXACT_OPS", "has_low_precision", "lower"]

LOW_DTYPES = frozenset({TensorProto.BFLOAT16, TensorProto.FLOAT16})
FLOAT = TensorProto.FLOAT
# Ops whose float outputs are elements of their float inputs (moved, selected, negated, or zero):
# exact in any dtype, so no rounding after them.
EXACT_OPS = frozenset({
    "Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Split", "Slice", "Gather",
    "GatherElements", "GatherND", "Expand", "Tile", "Pad", "Where", "Neg", "Abs", "Relu", "Max", "Min", "ReduceMax",
    "ReduceMin", "MaxPool", "Trilu", "DepthToSpace", "SpaceToDepth", "Compress", "ScatterElements", "ScatterND",
    "Constant", "ConstantOfShape",  # their low-precision values, widened, are exact
})
_DEFAULT = ("", "ai.onnx")


def has_low_precision(model: onnx.ModelProto) -> bool:
    """Whether anything in ``model`` is (or is cast to) a low-precision float, other than the
    roundings ``lower`` writes (a cast to the low dtype read only by casts back to float32: a model
    already lowered, whole or cut into segments, is not lowered again). Exact: a low value comes
    from a typed input, an initializer, a constant, or a cast, all of which this sees."""
    graph = model.graph
    roundings = _roundings(graph)
    for vi in (*graph.input, *graph.output, *graph.value_info):
        if vi.type.tensor_type.elem_type in LOW_DTYPES and vi.name not in roundings:
            return True
    if any(t.data_type in LOW_DTYPES for t in graph.initializer):
        return True
    for node in graph.node:
        if node.op_type == "Cast" and node.domain in _DEFAULT and node.output[0] in roundings:
            continue
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.INT and attr.name in ("to", "dtype") and attr.i in LOW_DTYPES:
                return True
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in LOW_DTYPES:
                return True
        if node.op_type == "CastLike":
            return True  # its target's type decides; look closer
    return False


def _roundings(graph: onnx.GraphProto) -> set[str]:
    """Outputs of casts to a low dtype that only casts back to float32 read (``lower``'s roundings)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    found = set()
    for node in graph.node:
        if node.op_type != "Cast" or node.domain not in _DEFAULT or node.output[0] in outputs:
            continue
        if next((a.i for a in node.attribute if a.name == "to"), None) not in LOW_DTYPES:
            continue
        users = readers.get(node.output[0], [])
        if users and all(u.op_type == "Cast" and next((a.i for a in u.attribute if a.name == "to"), None) == FLOAT
                         for u in users):
            found.add(node.output[0])
    return found


def lower(model: onnx.ModelProto) -> onnx.ModelProto:
    """The float32 form of ``model`` (the module docstring); ``model`` itself if nothing in it is
    low precision."""
    if not has_low_precision(model):
        return model
    inferred = with_inferred_types(model)
    inlined = _inline_low_functions(inferred, value_types(inferred.graph))
    if inlined is not inferred:
        inferred = with_inferred_types(inlined)
    graph = inferred.graph
    types = value_types(graph)
    _fill_missing(graph, types)
    rewriter = _Rewriter(graph, types)
    nodes = []
    for node in graph.node:
        nodes.extend(rewriter.node(rewriter.aliased(node)))
    out = onnx.ModelProto()
    out.CopyFrom(inferred)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    for vi in (*out.graph.input, *out.graph.output, *out.graph.value_info):
        if vi.type.tensor_type.elem_type in LOW_DTYPES:
            vi.type.tensor_type.elem_type = FLOAT
    out.graph.value_info.extend(rewriter.value_info)
    for i, tensor in enumerate(out.graph.initializer):
        if tensor.data_type in LOW_DTYPES:
            out.graph.initializer[i].CopyFrom(_widened(tensor))
    return out


def _inline_low_functions(model: onnx.ModelProto, types: dict) -> onnx.ModelProto:
    """``model`` with the model-local functions that low-precision nodes call inlined: their bodies
    may round inside (the fused Attention's probabilities, transpiler/attention_ops.py), which
    computing the node in float32 and rounding its outputs once would lose."""
    local = {(f.domain, f.name) for f in model.functions}
    called = {(n.domain, n.op_type) for n in model.graph.node
              if (n.domain, n.op_type) in local and any(_elem(types, i) in LOW_DTYPES for i in n.input if i)}
    if not called:
        return model
    return onnx.inliner.inline_selected_functions(model, sorted(called))


def _elem(types: dict, name: str) -> int | None:
    t = types.get(name)
    if t is None or t.WhichOneof("value") != "tensor_type":
        return None
    return t.tensor_type.elem_type or None


def _fill_missing(graph: onnx.GraphProto, types: dict) -> None:
    """Element types inference left out (outputs of nodes of unknown domains), from the schema
    where there is one: an output of the same type parameter as a typed input has its type."""
    for node in graph.node:
        missing = [o for o in node.output if o and _elem(types, o) is None]
        if not missing or node.domain not in _DEFAULT:
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, max(1, _opset(graph)), "")
        except Exception:
            continue
        params = {}
        for i, name in enumerate(node.input):
            if name and i < len(schema.inputs) and _elem(types, name) is not None:
                params.setdefault(schema.inputs[i].type_str, _elem(types, name))
        for i, name in enumerate(node.output):
            if name in missing and i < len(schema.outputs) and schema.outputs[i].type_str in params:
                types[name] = helper.make_tensor_type_proto(params[schema.outputs[i].type_str], None)


def _opset(graph) -> int:
    return 10_000  # newest schema of each op: only its type parameters are read


class _Rewriter:
    def __init__(self, graph: onnx.GraphProto, types: dict):
        self.types = types
        self.value_info: list[onnx.ValueInfoProto] = []
        self.unique = FreshNames(graph, sep="_").fresh
        self.outputs = {o.name for o in graph.output}
        # A cast from a low dtype to float32 is no op here (the value is float32 already): its
        # readers read its input instead (an Identity chain trips onnxruntime's optimizer, 1.32).
        self.alias: dict[str, str] = {}

    def aliased(self, node: onnx.NodeProto) -> onnx.NodeProto:
        if not any(name in self.alias for name in node.input):
            return node
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        for i, name in enumerate(copy.input):
            copy.input[i] = self.alias.get(name, name)
        return copy

    def low(self, name: str) -> int | None:
        elem = _elem(self.types, name)
        return elem if elem in LOW_DTYPES else None

    def node(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        default = node.domain in _DEFAULT
        if default and node.op_type == "CastLike":
            target = _elem(self.types, node.input[1])
            if target is None:
                return [node]
            node = helper.make_node("Cast", [node.input[0]], list(node.output), name=node.name, to=target)
        if default and node.op_type == "Cast":
            return self.cast(node)
        if not (any(self.low(n) for n in node.input if n) or any(self.low(n) for n in node.output if n)
                or any(self._low_attr(a) for a in node.attribute)):
            return [node]
        node = self._widen_attributes(node)
        if default and node.op_type in EXACT_OPS:
            return [node]
        # Computed in float32: each low-precision output rounded once, under its own name.
        rounded = []
        outputs = list(node.output)
        for i, name in enumerate(outputs):
            dtype = self.low(name) if name else None
            if dtype is None:
                continue
            raw = self.unique(f"{name}.float32")
            node.output[i] = raw
            self._typed(raw, name)
            rounded += self.round(raw, name, dtype, node.name or node.op_type)
        return [node, *rounded]

    def cast(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        to = next(a.i for a in node.attribute if a.name == "to")
        source = _elem(self.types, node.input[0])
        if to in LOW_DTYPES:
            if source in LOW_DTYPES or source == FLOAT or source is None:
                return self.round(node.input[0], node.output[0], to, node.name or "Cast")
            # Another type (double, an integer): cast to float32 first. For integers beyond 2**24 and
            # doubles that is two roundings where a GPU makes one; none of the transpiler's casts are such.
            wide = self.unique(f"{node.output[0]}.float32")
            return [helper.make_node("Cast", [node.input[0]], [wide], name=f"{node.name}/float32", to=FLOAT),
                    *self.round(wide, node.output[0], to, node.name or "Cast")]
        if source in LOW_DTYPES and to == FLOAT:
            if node.output[0] not in self.outputs:
                self.alias[node.output[0]] = node.input[0]
                return []
            return [helper.make_node("Identity", list(node.input), list(node.output), name=node.name)]
        return [node]  # float -> int, low -> int (the float32 holds the same number), others

    def round(self, source: str, target: str, dtype: int, where: str) -> list[onnx.NodeProto]:
        """``target`` = ``source`` rounded to ``dtype``, as float32 (two Casts: round to nearest even)."""
        mid = self.unique(f"{target}.{'bf16' if dtype == TensorProto.BFLOAT16 else 'fp16'}")
        return [helper.make_node("Cast", [source], [mid], name=self.unique(f"{where}/round_to_low"), to=dtype),
                helper.make_node("Cast", [mid], [target], name=self.unique(f"{where}/as_float32"), to=FLOAT)]

    def _typed(self, raw: str, like: str) -> None:
        t = self.types.get(like)
        if t is None:
            return
        widened = onnx.TypeProto()
        widened.CopyFrom(t)
        widened.tensor_type.elem_type = FLOAT
        self.value_info.append(helper.make_value_info(raw, widened))

    @staticmethod
    def _low_attr(attr: onnx.AttributeProto) -> bool:
        return (attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in LOW_DTYPES) or (
            attr.type == onnx.AttributeProto.INT and attr.name == "dtype" and attr.i in LOW_DTYPES)

    def _widen_attributes(self, node: onnx.NodeProto) -> onnx.NodeProto:
        if not any(self._low_attr(a) for a in node.attribute):
            return node
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        for attr in copy.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in LOW_DTYPES:
                attr.t.CopyFrom(_widened(attr.t))
            elif attr.type == onnx.AttributeProto.INT and attr.name == "dtype" and attr.i in LOW_DTYPES:
                attr.i = FLOAT
        return copy


def _widened(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """A low-precision tensor as float32 (exact)."""
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)
