"""Elementwise fusion, the graph rewrite: a chain of elementwise float32 nodes over one shape becomes
one node, which the GPU backend runs as one CuPy kernel (elementwise.py, ``ElementwiseRunner``)
instead of one onnxruntime kernel per node. A pure-ONNX module: neither CuPy nor onnxruntime.

Why: onnxruntime's CUDA EP launches one kernel per node, and each reads and writes its whole tensor.
The backward of GELU is ten such nodes over the [batch, T, 4C] MLP activation, the forward five,
LayerNorm's backward a dozen; PyTorch runs each as one or two kernels. A fused kernel reads each
input once and writes only what is read outside the chain.

``fuse_elementwise`` (GpuBackend.prepare_step_graph, before the graph is cut) replaces each cluster
by one node of the runtime-internal domain ``DOMAIN``, which runs inside its segment's onnxruntime
session as a custom op (in_session.py; native.py decides where each native kernel runs). Each
fused node also carries a function of its steps, so onnxruntime can run it where it is not taken.

Clusters: nodes of ``OPS`` whose output is float32 of the same (possibly symbolic) shape, joined
along producer -> consumer edges; an input may be any float32 tensor that broadcasts (numpy rules,
as ONNX and CuPy both broadcast), or a scalar constant, which is written into the kernel as its exact
bits. A cluster stays convex: no path leaves it and comes back (the fused node must be placeable in
a topological order). Only clusters of at least ``MIN_NODES`` nodes over a tensor with a symbolic
(batch) dimension or at least ``MIN_ELEMENTS`` elements are kept; clusters of additions only (a bias
and a residual, which onnxruntime folds into its Gemm) only with ``additions`` (inside a session a
fused node costs no cut of the graph, so the backend always passes it).

Arithmetic: each node computes what onnxruntime's kernel computes, in float32, with the
round-to-nearest intrinsics (``__fadd_rn``...), which the compiler never contracts into an FMA, and
the same CUDA math functions (``expf``, ``erff``, ``tanhf``, ``powf``); so values equal the unfused
graph's on the GPU up to the math library's own last-bit behaviour. The table also holds a NumPy
form of each op, so the CPU tests check a cluster's wiring against onnxruntime without a GPU.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from contract.collectives import consumed
from runtime.errors import RunError
from runtime.variables import NATIVE_OFF

DOMAIN = "graph_transpiler.elementwise"
OP_TYPE = "Fused"
MIN_NODES = 2
MIN_ELEMENTS = 1 << 16
_ADDS = frozenset({"Add", "Sum"})
RELU_MASK = "ReluMask"  # the step of fuse_relu_masks's nodes

_erf = np.vectorize(math.erf, otypes=[np.float32])


@dataclass(frozen=True)
class _Op:
    arity: int | None  # None: variadic (Sum)
    cuda: Callable[[list[str]], str]
    numpy: Callable[[list[np.ndarray]], np.ndarray]


def _fold(fmt: str, args: list[str]) -> str:
    expr = args[0]
    for arg in args[1:]:
        expr = fmt.format(expr, arg)
    return expr


OPS: dict[str, _Op] = {
    "Add": _Op(2, lambda a: f"__fadd_rn({a[0]}, {a[1]})", lambda a: a[0] + a[1]),
    "Sub": _Op(2, lambda a: f"__fsub_rn({a[0]}, {a[1]})", lambda a: a[0] - a[1]),
    "Mul": _Op(2, lambda a: f"__fmul_rn({a[0]}, {a[1]})", lambda a: a[0] * a[1]),
    "Div": _Op(2, lambda a: f"__fdiv_rn({a[0]}, {a[1]})", lambda a: a[0] / a[1]),
    "Sum": _Op(None, lambda a: _fold("__fadd_rn({0}, {1})", a), lambda a: sum(a[1:], a[0])),
    "Neg": _Op(1, lambda a: f"(-{a[0]})", lambda a: -a[0]),
    "Abs": _Op(1, lambda a: f"fabsf({a[0]})", lambda a: np.abs(a[0])),
    "Exp": _Op(1, lambda a: f"expf({a[0]})", lambda a: np.exp(a[0])),
    "Erf": _Op(1, lambda a: f"erff({a[0]})", lambda a: _erf(a[0])),
    "Tanh": _Op(1, lambda a: f"tanhf({a[0]})", lambda a: np.tanh(a[0])),
    "Sqrt": _Op(1, lambda a: f"__fsqrt_rn({a[0]})", lambda a: np.sqrt(a[0])),
    "Reciprocal": _Op(1, lambda a: f"__fdiv_rn(1.0f, {a[0]})", lambda a: np.float32(1) / a[0]),
    "Relu": _Op(1, lambda a: f"fmaxf({a[0]}, 0.0f)", lambda a: np.maximum(a[0], np.float32(0))),
    "Pow": _Op(2, lambda a: f"powf({a[0]}, {a[1]})", lambda a: np.power(a[0], a[1])),
    # Where(Greater(y, 0), dy, 0) as one step (fuse_relu_masks): no ONNX op has this name, so no
    # graph node is ever clustered as one.
    RELU_MASK: _Op(2, lambda a: f"({a[0]} > 0.0f ? {a[1]} : 0.0f)",
                   lambda a: np.where(a[0] > 0, a[1], np.float32(0))),
}


def _literal(value: float) -> str:
    """A float32 scalar in CUDA source, bit-exact."""
    bits = int(np.array(value, np.float32).view(np.uint32))
    return f"__int_as_float(0x{bits:08x})"


# -- the pass ----------------------------------------------------------------------------------

class _Facts:
    """What both passes read of a graph: its nodes, each value's producer and readers (subgraph
    captures included, as the cut counts them), its float32 shapes (inferred) and its constants
    (Constant nodes and initializers that are not graph inputs: a fed input may override those)."""

    def __init__(self, model: onnx.ModelProto):
        graph = onnx.shape_inference.infer_shapes(model).graph
        self.types = {v.name: v.type for v in [*graph.input, *graph.value_info, *graph.output]}
        fed = {i.name for i in model.graph.input}
        self.constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name not in fed}
        for node in model.graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.attribute \
                    and node.attribute[0].name == "value":
                self.constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
        self.nodes = list(model.graph.node)
        self.producer = {name: i for i, node in enumerate(self.nodes) for name in node.output if name}
        self.readers: dict[str, set[int]] = {}
        for i, node in enumerate(self.nodes):
            for name in consumed(node):
                self.readers.setdefault(name, set()).add(i)
        self.graph_outputs = {o.name for o in model.graph.output}

    def shape_of(self, name: str) -> tuple | None:
        """A float32 value's shape (ints and symbols), None if not float32 or not fully known."""
        t = self.types.get(name)
        if t is None or not t.HasField("tensor_type") or t.tensor_type.elem_type != TensorProto.FLOAT:
            return None
        if not t.tensor_type.HasField("shape"):
            return None
        dims = []
        for d in t.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                dims.append(d.dim_value)
            elif d.HasField("dim_param"):
                dims.append(d.dim_param)
            else:
                return None
        return tuple(dims)

    def scalar(self, name: str) -> float | None:
        """A float32 constant of one element, as a float."""
        value = self.constants.get(name)
        if value is None or value.size != 1 or value.dtype != np.float32:
            return None
        return float(value.reshape(-1)[0])


def fuse_elementwise(model: onnx.ModelProto, additions: bool = False) -> onnx.ModelProto:
    """A copy of ``model`` with its elementwise clusters (module docstring) as ``DOMAIN`` nodes;
    with ``additions``, clusters of additions only too. Where fused nodes run inside the sessions,
    a Linear's bias and the residual after it (onnxruntime: its Gemm's bias broadcast, the GEMM, an
    Add: three kernels) become a MatMul and one fused kernel, and a gradient's chain of Sums one
    kernel; where each fused node cuts the session, that is not worth its cut."""
    facts = _Facts(model)
    nodes, producer, shape_of, scalar = facts.nodes, facts.producer, facts.shape_of, facts.scalar

    def eligible(node: onnx.NodeProto) -> tuple | None:
        op = OPS.get(node.op_type)
        if op is None or node.domain not in ("", "ai.onnx") or len(node.output) != 1 or node.attribute:
            return None
        if op.arity is not None and len(node.input) != op.arity:
            return None
        if node.op_type == "Pow" and scalar(node.input[1]) is None:
            return None
        out = shape_of(node.output[0])
        if out is None or any(name == "" or (scalar(name) is None and shape_of(name) is None) for name in node.input):
            return None
        return out

    cluster_of: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    shape_of_cluster: dict[int, tuple] = {}

    def depends_on(start: int, cluster: set[int], low: int) -> bool:
        """Whether node ``start`` (outside ``cluster``) reads, through any path, a node of
        ``cluster``. A node of another cluster stands for all of that cluster's members, since
        the fused node will read all of their inputs."""
        stack = list(members[cluster_of[start]]) if start in cluster_of else [start]
        seen = set(stack)
        while stack:
            i = stack.pop()
            for name in nodes[i].input:
                j = producer.get(name)
                if j is None or j < low or j in seen:
                    continue
                if j in cluster:
                    return True
                for k in members[cluster_of[j]] if j in cluster_of else (j,):
                    if k not in seen:
                        seen.add(k)
                        stack.append(k)
        return False

    for i, node in enumerate(nodes):
        out = eligible(node)
        if out is None:
            continue
        joined = None
        for name in node.input:
            j = producer.get(name)
            c = cluster_of.get(j) if j is not None else None
            if c is None or shape_of_cluster[c] != out:
                continue
            cluster = set(members[c])
            low = min(cluster)
            outside = {producer[n] for n in node.input if n in producer and producer[n] not in cluster}
            if not any(depends_on(p, cluster, low) for p in outside):
                joined = c
                break
        if joined is None:
            joined = i
            members[joined] = []
            shape_of_cluster[joined] = out
        members[joined].append(i)
        cluster_of[i] = joined

    readers, graph_outputs = facts.readers, facts.graph_outputs
    fused: dict[int, onnx.NodeProto] = {}  # first member -> the fused node
    dropped: set[int] = set()
    for c, idx in members.items():
        shape = shape_of_cluster[c]
        size = math.prod(d for d in shape if isinstance(d, int))
        if len(idx) < MIN_NODES or (size < MIN_ELEMENTS and all(isinstance(d, int) for d in shape)):
            continue
        if not additions and all(nodes[i].op_type in _ADDS for i in idx):
            continue  # a bias add and a residual add: onnxruntime folds the bias into its Gemm instead
        fused[idx[0]] = _fused_node([nodes[i] for i in idx], set(idx), readers, graph_outputs, scalar)
        dropped |= set(idx)
    if not fused:
        return model
    # Place the fused nodes: a topological order that keeps the original one wherever it can
    # (each fused node takes its first member's place in the priority).
    items = [(i, fused[i]) for i in sorted(fused)] + [(i, nodes[i]) for i in range(len(nodes)) if i not in dropped]
    ordered = _topological(items, {n.name for n in model.graph.input} | {t.name for t in model.graph.initializer})
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend(ordered)
    return _with_functions(result)


def fuse_relu_masks(model: onnx.ModelProto, native_domains) -> onnx.ModelProto:
    """``Where(Greater(y, 0), dy, 0)`` (ReLU's backward, as the autodiff writes it: two onnxruntime
    kernels, a bool mask written and read back) as one fused node (one kernel, PyTorch's
    ``threshold_backward``), wherever a node of ``native_domains`` reads its result and nothing else
    reads the mask. Then the fused node joins that reader's native stage (the cut stages native
    nodes as early as their inputs allow), so the cut gains no onnxruntime session: on ResNet-18
    every ReLU's gradient feeds a cuDNN BatchNorm gradient. A copy of ``model``, or ``model`` itself
    if nothing matched."""
    facts = _Facts(model)
    nodes = facts.nodes

    def zero(name: str) -> bool:  # +0.0 exactly: the masked elements are written as it
        value = facts.scalar(name)
        return value == 0.0 and not math.copysign(1.0, value) < 0

    fused: dict[int, onnx.NodeProto] = {}  # the Where's index -> its fused node
    dropped: set[int] = set()
    for i, where in enumerate(nodes):
        if where.op_type != "Where" or where.domain not in ("", "ai.onnx") or len(where.input) != 3:
            continue
        mask, dy, other = where.input
        g = facts.producer.get(mask)
        if g is None or not zero(other):
            continue
        greater = nodes[g]
        if (greater.op_type != "Greater" or greater.domain not in ("", "ai.onnx") or not zero(greater.input[1])
                or facts.readers.get(mask) != {i} or mask in facts.graph_outputs):
            continue
        y, out = greater.input[0], where.output[0]
        # One shape for y, dy and the result: the kernel neither broadcasts nor reshapes.
        if facts.shape_of(y) is None or not facts.shape_of(y) == facts.shape_of(dy) == facts.shape_of(out):
            continue
        if not any(nodes[r].domain in native_domains for r in facts.readers.get(out, ())):
            continue
        fused[i] = _make_fused([y, dy], [out], f"{where.name or out}/relu_mask", ["Greater", "Where"],
                               [(RELU_MASK, [("x", 0), ("x", 1)])], [0])
        dropped.add(g)
    if not fused:
        return model
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend(fused.get(i, node) for i, node in enumerate(nodes) if i not in dropped)
    return _with_functions(result)


def _with_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the DOMAIN opset and, for each new fused node (op_type OP_TYPE), an ONNX
    function of its steps in standard ops, named after them (the node's op_type): one function per
    distinct kernel. With it, ONNX shape inference sees through the node (the
    specialized segment that holds it keeps static shapes downstream), and onnxruntime can run it."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
    known = {(f.domain, f.name) for f in model.functions}
    for node in model.graph.node:
        if node.domain != DOMAIN or node.op_type != OP_TYPE:
            continue
        function = _function(node, opset)
        node.op_type = function.name
        if (function.domain, function.name) not in known:
            known.add((function.domain, function.name))
            model.functions.append(function)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def _function(node: onnx.NodeProto, opset: int) -> onnx.FunctionProto:
    """A fused node's steps as an ONNX function of inputs ``x0..`` and outputs ``y0..``: each step one
    node of its op (the relu mask: Greater and Where), each constant a Constant node of its float32
    value. It computes what the kernel computes, up to float32 rounding of the math functions."""
    steps, results = fused_steps(node)
    body: list[onnx.NodeProto] = []
    for k, (op_type, refs) in enumerate(steps):
        args = []
        for j, (kind, value) in enumerate(refs):
            if kind == "c":
                args.append(f"c{k}_{j}")
                body.append(helper.make_node("Constant", [], [args[-1]], value_float=float(value)))
            else:
                args.append(f"{kind}{value}")
        if op_type == RELU_MASK:
            body += [helper.make_node("Constant", [], [f"zero{k}"], value_float=0.0),
                     helper.make_node("Greater", [args[0], f"zero{k}"], [f"mask{k}"]),
                     helper.make_node("Where", [f"mask{k}", args[1], f"zero{k}"], [f"t{k}"])]
        else:
            body.append(helper.make_node(op_type, args, [f"t{k}"]))
    outputs = [f"y{j}" for j in range(len(results))]
    body += [helper.make_node("Identity", [f"t{k}"], [y]) for y, k in zip(outputs, results)]
    digest = hashlib.sha256(f"{len(node.input)}|{json.dumps(steps)}|{results}".encode()).hexdigest()[:12]
    return helper.make_function(DOMAIN, f"{OP_TYPE}_{digest}", [f"x{i}" for i in range(len(node.input))], outputs,
                                body, [helper.make_opsetid("", opset)])


def _fused_node(members: list[onnx.NodeProto], indices: set[int], readers: dict[str, set[int]],
                graph_outputs: set[str], scalar: Callable[[str], float | None]) -> onnx.NodeProto:
    """One DOMAIN node for ``members`` (in graph order): its inputs are the tensors they read from
    outside, its outputs the values read outside (or graph outputs); attribute ``code`` is the
    kernel's body over parameters ``x0..`` / ``y0..``, ``ops`` the member op types (for the NumPy
    form and for reading the graph)."""
    produced = {node.output[0]: k for k, node in enumerate(members)}
    inputs: list[str] = []
    steps = []
    for node in members:
        refs = []
        for name in node.input:
            if name in produced:
                refs.append(("t", produced[name]))
                continue
            value = scalar(name)
            if value is not None:
                refs.append(("c", value))
                continue
            if name not in inputs:
                inputs.append(name)
            refs.append(("x", inputs.index(name)))
        steps.append((node.op_type, refs))
    outputs = [node.output[0] for node in members
               if node.output[0] in graph_outputs or readers.get(node.output[0], set()) - indices]
    first = members[0].name or members[0].output[0]
    return _make_fused(inputs, outputs, f"{first}/fused_elementwise", [n.op_type for n in members], steps,
                       [produced[name] for name in outputs])


def _make_fused(inputs: list[str], outputs: list[str], name: str, ops: list[str], steps: list,
                results: list[int]) -> onnx.NodeProto:
    """A DOMAIN node computing ``steps`` (``(op, refs)`` each, a ref ``("x", i)`` node input i,
    ``("t", k)`` step k's value, ``("c", value)`` a float32 constant) with step ``results[j]`` as
    output j. Attributes: ``steps`` and ``results`` (what the function, the NumPy form and the graph
    readers read back, ``fused_steps``), ``code`` the CUDA body they give over parameters ``x0..`` /
    ``y0..``, and ``ops`` the op types it stands for."""
    lines = []
    for k, (op_type, refs) in enumerate(steps):
        args = [f"t{i}" if kind == "t" else _literal(i) if kind == "c" else f"x{i}" for kind, i in refs]
        lines.append(f"float t{k} = {OPS[op_type].cuda(args)};")
    lines += [f"y{j} = t{k};" for j, k in enumerate(results)]
    return helper.make_node(OP_TYPE, inputs, outputs, name=name, domain=DOMAIN, code=" ".join(lines), ops=ops,
                            steps=json.dumps(steps), results=results)


def fused_steps(node: onnx.NodeProto) -> tuple[list, list[int]]:
    """A fused node's steps and, per output, the index of the step it is (``_make_fused``)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return json.loads(attrs["steps"].decode()), list(attrs["results"])


def _topological(items: list[tuple[int, onnx.NodeProto]], available: set[str]) -> list[onnx.NodeProto]:
    """Kahn's order of ``items`` (priority: their index), given the values ``available`` up front."""
    producer = {name: k for k, (_, node) in enumerate(items) for name in node.output if name}
    waiting = [len({producer[n] for n in node.input if n in producer}) for _, node in items]
    consumers: dict[int, list[int]] = {}
    for k, (_, node) in enumerate(items):
        for p in {producer[n] for n in node.input if n in producer}:
            consumers.setdefault(p, []).append(k)
    ready = [(items[k][0], k) for k in range(len(items)) if waiting[k] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, k = heapq.heappop(ready)
        out.append(items[k][1])
        for c in consumers.get(k, []):
            waiting[c] -= 1
            if waiting[c] == 0:
                heapq.heappush(ready, (items[c][0], c))
    if len(out) != len(items):  # a cycle: the convexity check failed (a bug, never the user's graph)
        raise RunError(f"elementwise fusion made a cycle; set {NATIVE_OFF}=elementwise and report it")
    return out


def final_factors(node: onnx.NodeProto, output: str) -> list[str]:
    """The node's inputs that its ``output`` is the product of, where that output's last step is a
    Mul of node inputs or of earlier steps (only the inputs are returned); else none."""
    if output not in node.output:
        return []
    steps, results = fused_steps(node)
    op_type, refs = steps[results[list(node.output).index(output)]]
    if op_type != "Mul":
        return []
    return [node.input[i] for kind, i in refs if kind == "x"]


def evaluate_numpy(node: onnx.NodeProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """A fused node's outputs computed with the NumPy form of its ops (float32), for tests."""
    steps, results = fused_steps(node)
    values: list[np.ndarray] = []
    for op_type, refs in steps:
        args = [values[i] if kind == "t" else np.float32(i) if kind == "c" else np.asarray(inputs[i], np.float32)
                for kind, i in refs]
        values.append(np.asarray(OPS[op_type].numpy(args), np.float32))
    return [values[k] for k in results]
