"""What a gradient rule works with: the emitter of backward nodes, the per-node context, unbroadcast."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.traversal import RecursiveGraphIterator

from transpiler.errors import TranspileError

FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def carries_gradient(value: ir.Value) -> bool:
    """Whether a value can have a gradient: floating point, or of unknown type (assumed to be)."""
    return value.dtype is None or value.dtype in FLOAT_TYPES


class GradientError(TranspileError):
    """A rule cannot differentiate this particular node (e.g. its rank is unknown)."""

    def __init__(self, node: ir.Node, reason: str):
        super().__init__(f"gradient of {node.op_type} node '{node.name}': {reason}")


def fresh_name(taken: set[str], base: str) -> str:
    """``base``, or ``base_1``, ``base_2``, ... : the first name not in ``taken``, which it joins."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def all_names(graph: ir.Graph) -> set[str]:
    """Every name a new value or node of ``graph`` must avoid (subgraphs' too)."""
    names: set[str] = {v.name for v in (*graph.inputs, *graph.initializers.values()) if v.name}
    for node in RecursiveGraphIterator(graph):
        if node.name:
            names.add(node.name)
        names.update(v.name for v in node.outputs if v.name)
        for attr in node.attributes.values():
            for subgraph in subgraphs_of(attr):
                names.update(v.name for v in (*subgraph.inputs, *subgraph.initializers.values()) if v.name)
    return names


def subgraphs_of(attr: ir.Attr) -> Sequence[ir.Graph]:
    """The graphs an attribute holds (If branches, Loop and Scan bodies); none for other types."""
    if attr.type == ir.AttributeType.GRAPH:
        return [attr.as_graph()]
    if attr.type == ir.AttributeType.GRAPHS:
        return list(attr.as_graphs())
    return []


class Emitter:
    """Appends backward nodes to the graph, with unique readable names and shared constants.

    Nodes are appended after everything already in the graph, so the graph stays topologically
    sorted as long as each node only consumes forward values or earlier backward values.
    """

    def __init__(self, graph: ir.Graph):
        self.graph = graph
        self.created: set[ir.Node] = set()
        self._names = all_names(graph)
        self._constants: dict[tuple[str, tuple[int, ...], bytes], ir.Value] = {}

    def unique(self, base: str) -> str:
        return fresh_name(self._names, base)

    def op(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        attributes: Mapping[str, Any] | None = None,
        *,
        scope: str,
        num_outputs: int = 1,
        output_names: Sequence[str] | None = None,
        domain: str = "",
    ) -> list[ir.Value]:
        # Named like the PyTorch exporter names things ("/fc1/Gemm/grad/MatMul_output_0"), so a
        # backward node in Netron says which forward node it differentiates.
        name = self.unique(f"{scope}/{op_type}")
        names = output_names or [f"{name}_output_{i}" for i in range(num_outputs)]
        outputs = [ir.Value(name=self.unique(n)) for n in names]
        attrs = ir.convenience.convert_attributes(attributes or {})
        node = ir.Node(domain, op_type, inputs, attrs, outputs=outputs, graph=self.graph, name=name)
        self.created.add(node)
        return outputs

    def const(self, array: np.ndarray) -> ir.Value:
        """A Constant node holding ``array``; identical constants are emitted once."""
        array = np.array(array, order="C")  # (ascontiguousarray would turn a 0-d array into 1-d)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            value = self.op("Constant", [], {"value": ir.tensor(array)}, scope="grad/const")[0]
            value.dtype = ir.DataType.from_numpy(array.dtype)
            value.shape = ir.Shape(array.shape)
            self._constants[key] = value
        return self._constants[key]

    def shape_of(self, value: ir.Value, *, scope: str, start: int = 0, end: int | None = None) -> ir.Value:
        """``Shape(value)[start:end]`` as an int64 tensor: a constant when those dims are static."""
        if value.shape is not None:
            dims = list(value.shape)[start:end]
            if all(isinstance(d, int) for d in dims):
                return self.const(np.array(dims, dtype=np.int64))
        attributes: dict[str, int] = {}
        if start != 0:
            attributes["start"] = start
        if end is not None:
            attributes["end"] = end
        return self.op("Shape", [value], attributes, scope=scope)[0]


def annotate(value: ir.Value, like: ir.Value) -> None:
    """Give ``value`` the type and shape of ``like`` where it has none (gradients mirror values)."""
    if value.type is None and like.type is not None:
        value.type = like.type
    if value.shape is None and like.shape is not None:
        value.shape = ir.Shape(list(like.shape))


class RuleContext:
    """The view a gradient rule has of one forward node."""

    def __init__(
        self, emitter: Emitter, node: ir.Node, dys: Sequence[ir.Value | None], wanted: Iterable[int],
        on_path: Collection[ir.Value] = frozenset(),
    ):
        self.node = node
        self.dys = list(dys)
        self._emitter = emitter
        self._wanted = frozenset(wanted)
        self._on_path = on_path
        self._scope = f"{node.name or node.op_type}/grad"

    @property
    def inputs(self) -> Sequence[ir.Value | None]:
        return self.node.inputs

    @property
    def output(self) -> ir.Value:
        return self.node.outputs[0]

    @property
    def dy(self) -> ir.Value:
        """The gradient of output 0 (the backward calls a rule only when some output has one)."""
        if self.dys[0] is None:
            raise self.error("output 0 has no gradient; this rule handles only single-output nodes")
        return self.dys[0]

    def wants(self, index: int) -> bool:
        return index in self._wanted

    def wanted_grads(self, *builders: Callable[[], ir.Value | None]) -> list[ir.Value | None]:
        """One entry per node input: ``builders[i]()`` where input i's gradient is wanted, else None."""
        return [
            builders[i]() if i < len(builders) and self.wants(i) else None
            for i in range(len(self.node.inputs))
        ]

    def error(self, reason: str) -> GradientError:
        return GradientError(self.node, reason)

    def unique_name(self, base: str) -> str:
        """A name no value or node of the model has yet, under this node's backward scope (for the
        values and nodes of a subgraph a rule builds, e.g. a Scan body)."""
        return self._emitter.unique(f"{self._scope}/{base}")

    def op(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        attributes: Mapping[str, Any] | None = None,
        *,
        like: ir.Value | None = None,
        shape: Sequence[Any] | None = None,
    ) -> ir.Value:
        """Emit one backward node. ``like`` copies type and shape from a value; ``shape`` sets dims.

        Annotations matter where the result goes into ``unbroadcast``: with known dims it reduces
        statically instead of building the dynamic shape computation.
        """
        value = self.op_multi(op_type, inputs, attributes, num_outputs=1)[0]
        if like is not None:
            annotate(value, like)
        if shape is not None:
            value.shape = ir.Shape(list(shape))
        return value

    def op_multi(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        attributes: Mapping[str, Any] | None = None,
        *,
        num_outputs: int,
        domain: str = "",
    ) -> list[ir.Value]:
        return self._emitter.op(
            op_type, inputs, attributes, scope=self._scope, num_outputs=num_outputs, domain=domain
        )

    def const(self, array: np.ndarray | Sequence[int]) -> ir.Value:
        """A constant; plain Python int sequences become int64 (axes, shapes, sizes)."""
        return self._emitter.const(
            np.asarray(array, dtype=None if isinstance(array, np.ndarray) else np.int64)
        )

    def scalar(self, number: float, like: ir.Value) -> ir.Value:
        """A 0-d constant of ``like``'s dtype, to combine with it under broadcasting."""
        return self._emitter.const(np.array(number, dtype=self.dtype(like).numpy()))

    def dtype(self, value: ir.Value) -> ir.DataType:
        if value.dtype is None:
            raise self.error(f"the type of {value.name!r} is unknown (run shape inference first)")
        return value.dtype

    def rank(self, value: ir.Value) -> int:
        if value.shape is None:
            raise self.error(f"the rank of {value.name!r} is unknown (run shape inference first)")
        return value.shape.rank()

    def shape_of(self, value: ir.Value, start: int = 0, end: int | None = None) -> ir.Value:
        """``Shape(value)[start:end]`` as an int64 tensor: a constant when those dims are static."""
        return self._emitter.shape_of(value, scope=self._scope, start=start, end=end)

    def zeros_like(self, value: ir.Value) -> ir.Value:
        """Zeros of ``value``'s shape and dtype (a ConstantOfShape)."""
        zero = ir.tensor(np.zeros([1], dtype=self.dtype(value).numpy()))
        return self.op("ConstantOfShape", [self.shape_of(value)], {"value": zero}, like=value)

    def forward_output(self, index: int, suffix: str, dtype: ir.DataType, shape: ir.Shape | None) -> ir.Value:
        """Output ``index`` of the forward node, added to the node when the exporter left it off.

        Exporters drop optional outputs nobody reads (Dropout's mask, MaxPool's Indices,
        LayerNormalization's Mean/InvStdDev, SoftmaxCrossEntropyLoss's log_prob); backward rules
        that need them switch them on. The forward computes them anyway, so this costs no compute.
        """
        node = self.node
        if index >= len(node.outputs):
            node.resize_outputs(index + 1)
        value = node.outputs[index]
        if not value.name:
            base = node.outputs[0].name or node.name or node.op_type
            value.name = self._emitter.unique(f"{base}_{suffix}")
            value.dtype = dtype
            if shape is not None:
                value.shape = ir.Shape(list(shape))
        return value

    def backward_producer(self, value: ir.Value) -> ir.Node | None:
        """The backward node that computed ``value`` when no other node reads it yet, else None.

        A rule may then compute ``value``'s consumer in a cheaper equivalent form (the transpose of
        a Gemm as a Gemm with swapped operands); the superseded node is dropped at the end.
        """
        producer = value.producer()
        if producer is None or producer not in self._emitter.created or value.uses() or value.is_graph_output():
            return None
        return producer

    def differentiated(self, value: ir.Value | None) -> bool:
        """Whether the backward differentiates ``value`` (it lies between the loss and a value a
        gradient is asked for, e.g. a trained initializer): a rule that reads it as a constant
        would drop its gradient."""
        return value is not None and value in self._on_path

    def forward_uses(self, value: ir.Value) -> list:
        """The uses of ``value`` by nodes of the forward graph (not by the backward being built)."""
        return [use for use in value.uses() if use.node not in self._emitter.created]

    def const_input(self, index: int) -> np.ndarray | None:
        """Input ``index`` as a numpy array when it is a constant (initializer or Constant), else None."""
        if index >= len(self.node.inputs) or self.node.inputs[index] is None:
            return None
        tensor = ir.convenience.get_const_tensor(self.node.inputs[index])
        return None if tensor is None else tensor.numpy()

    def has_input(self, index: int) -> bool:
        """Whether optional input ``index`` is given (present and not the empty name)."""
        return index < len(self.node.inputs) and self.node.inputs[index] is not None


def producer_of(value: ir.Value | None, op_type: str, domain: str = "") -> ir.Node | None:
    """The node of type ``op_type`` (default domain unless ``domain``) that computes ``value``, or
    None: how rules recognize the forward pattern around a node."""
    node = None if value is None else value.producer()
    if node is None or node.op_type != op_type or node.domain not in ({domain} if domain else {"", "ai.onnx"}):
        return None
    return node


def same_dim(a: Any, b: Any) -> bool:
    """Dims provably equal: equal ints, or the same named symbol (unnamed unknown dims never are)."""
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b
    return a.value is not None and a.value == b.value


def _static_unbroadcast_axes(grad: ir.Value, like: ir.Value) -> tuple[list[int], list[int]] | None:
    """(leading axes to drop, axes to sum keeping dims), or None where only run time can tell."""
    if grad.shape is None or like.shape is None:
        return None
    g, x = list(grad.shape), list(like.shape)
    lead = len(g) - len(x)
    if lead < 0:
        return None
    keep = []
    for axis, (dx, dg) in enumerate(zip(x, g[lead:]), start=lead):
        if same_dim(dx, dg) or dg == 1:
            continue
        if dx == 1:
            # Summing an axis that is 1 at run time too is a no-op, so a symbolic dg is fine here.
            keep.append(axis)
        elif not isinstance(dx, int):
            return None  # dx may be 1 at run time while dg is not
    return list(range(lead)), keep


def unbroadcast(ctx: RuleContext, grad: ir.Value, like: ir.Value) -> ir.Value:
    """Sum ``grad``, shaped like a broadcast result, back to the shape of the input ``like``.

    Static when the dims decide it (leading axes are summed away, axes where ``like`` is 1 are
    summed keeping dims); otherwise the axes to sum are computed at run time.
    """
    axes = _static_unbroadcast_axes(grad, like)
    if axes is None:
        return _dynamic_unbroadcast(ctx, grad, like)
    lead, keep = axes
    if lead and keep:
        # One reduction over every broadcast axis (one kernel, one pass over grad), then a Reshape
        # (free: it only relabels the dims) drops the leading ones.
        summed = ctx.op("ReduceSum", [grad, ctx.const(lead + keep)], {"keepdims": 1})
        grad = ctx.op("Reshape", [summed, ctx.shape_of(like)], like=like)
    elif keep:
        grad = ctx.op("ReduceSum", [grad, ctx.const(keep)], {"keepdims": 1})
    elif lead:
        # Leading axes only (a bias [C] of a [B, T, C] sum): onnxruntime runs this as one
        # reduction over the B*T rows of a [B*T, C] matrix.
        grad = ctx.op("ReduceSum", [grad, ctx.const(lead)], {"keepdims": 0})
    annotate(grad, like)
    return grad


def _dynamic_unbroadcast(ctx: RuleContext, grad: ir.Value, like: ir.Value) -> ir.Value:
    # Left-pad like's shape with 1s to grad's rank; sum (keeping dims) every axis where they differ,
    # which by the broadcasting rules are exactly the axes where like has a 1 and grad does not;
    # then reshape away the padded axes. Works with unknown ranks too.
    x_shape = ctx.op("Shape", [like])
    g_shape = ctx.op("Shape", [grad])
    pad_len = ctx.op("Sub", [ctx.op("Shape", [g_shape]), ctx.op("Shape", [x_shape])])
    ones = ctx.op("ConstantOfShape", [pad_len], {"value": ir.tensor(np.array([1], dtype=np.int64))})
    padded = ctx.op("Concat", [ones, x_shape], {"axis": 0})
    differs = ctx.op("Not", [ctx.op("Equal", [padded, g_shape])])
    axes = ctx.op("Reshape", [ctx.op("NonZero", [differs]), ctx.const([-1])])
    summed = ctx.op("ReduceSum", [grad, axes], {"keepdims": 1, "noop_with_empty_axes": 1})
    return ctx.op("Reshape", [summed, x_shape], like=like)
