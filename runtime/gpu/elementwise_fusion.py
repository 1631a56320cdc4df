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
bits. With ``bfloat16`` (--precision bf16), casts between bfloat16 and float32 and the nodes of
``OPS`` that compute in bfloat16 join too, so a chain reads its bfloat16 inputs and writes its
bfloat16 results itself (elementwise_steps.py); a cluster's nodes share one output shape, not one
dtype. So does a Where computing in bfloat16 (its condition a bool tensor that broadcasts). A
cluster stays convex: no path leaves it and comes back (the fused node must be placeable in a
topological order). Only clusters of at least ``MIN_NODES`` nodes over a tensor with a symbolic
(batch) dimension or at least ``MIN_ELEMENTS`` elements are kept; clusters of additions only (a bias
and a residual, which onnxruntime folds into its Gemm) only with ``additions`` (inside a session a
fused node costs no cut of the graph, so the backend always passes it).

Arithmetic (elementwise_steps.py): each node computes what onnxruntime's kernel computes, in
float32, so values equal the unfused graph's on the GPU up to the math library's own last-bit
behaviour; a NumPy form of each step lets the CPU tests check a cluster's wiring against
onnxruntime without a GPU.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from contract.collectives import consumed
from runtime.errors import RunError
from runtime.gpu.elementwise_recompute import recompute_in_readers
from runtime.gpu.elementwise_steps import (
    BF16,
    BOOL,
    DOMAIN,
    FLOAT,
    OP_TYPE,
    OPS,
    RELU_MASK,
    ROUND,
    WIDEN,
    function,
    make_fused,
)
from runtime.variables import NATIVE_OFF

MIN_NODES = 2
MIN_ELEMENTS = 1 << 16
_ADDS = frozenset({"Add", "Sum"})
_ITEM_BYTES = {FLOAT: 4, BF16: 2, BOOL: 1}
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

    def dtype_of(self, name: str) -> int | None:
        t = self.types.get(name)
        return t.tensor_type.elem_type if t is not None and t.HasField("tensor_type") else None

    def shape_of(self, name: str, dtype: int = FLOAT) -> tuple | None:
        """The shape (ints and symbols) of a value of ``dtype``, None if of another or not fully known."""
        t = self.types.get(name)
        if t is None or not t.HasField("tensor_type") or t.tensor_type.elem_type != dtype:
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

    def size_of(self, name: str) -> int | None:
        """The bytes of a float32, bfloat16 or bool value, its symbolic dimensions counted as 1."""
        dtype = self.dtype_of(name)
        shape = self.shape_of(name, dtype) if dtype in _ITEM_BYTES else None
        return None if shape is None else _ITEM_BYTES[dtype] * math.prod(d for d in shape if isinstance(d, int))

    def scalar(self, name: str) -> float | None:
        """A float32 constant of one element, as a float."""
        value = self.constants.get(name)
        if value is None or value.size != 1 or value.dtype != np.float32:
            return None
        return float(value.reshape(-1)[0])


def fuse_elementwise(model: onnx.ModelProto, additions: bool = False, bfloat16: bool = False) -> onnx.ModelProto:
    """A copy of ``model`` with its elementwise clusters (module docstring) as ``DOMAIN`` nodes;
    with ``additions``, clusters of additions only too; with ``bfloat16``, the bfloat16 casts and
    nodes too (the module docstring). Where fused nodes run inside the sessions, a Linear's bias and
    the residual after it (onnxruntime: its Gemm's bias broadcast, the GEMM, an Add: three kernels)
    become a MatMul and one fused kernel, and a gradient's chain of Sums one kernel; where each
    fused node cuts the session, that is not worth its cut."""
    facts = _Facts(model)
    nodes, producer, shape_of, scalar = facts.nodes, facts.producer, facts.shape_of, facts.scalar

    def eligible(node: onnx.NodeProto) -> tuple | None:
        if node.op_type == "Cast":
            return _cast_shape(node, facts) if bfloat16 else None
        op = OPS.get(node.op_type)  # no ONNX op has the name of one of the table's own steps
        if op is None or node.domain not in ("", "ai.onnx") or len(node.output) != 1 or node.attribute:
            return None
        if op.arity is not None and len(node.input) != op.arity:
            return None
        if node.op_type == "Pow" and scalar(node.input[1]) is None:
            return None
        dtype = facts.dtype_of(node.output[0])
        if dtype not in ((FLOAT, BF16) if bfloat16 else (FLOAT,)):
            return None
        # A bf16 Sum of three or more (where the gradients of Q, K and V meet) joins as one step,
        # rounded once, as the CPU backend computes it (runtime/low_precision.py) and as the
        # exact sum rounds; onnxruntime's own kernel rounds each partial sum to bf16 (GPT-2-small:
        # 12 such kernels of 18 us a step, left to it until 2026-11-29).
        if node.op_type == "Where" and dtype != BF16:
            # A float32 attention's scale (a Mul by a constant) stays onnxruntime's, which folds it
            # into the MatMul before it (FusedMatMul's alpha); a float32 Where joining it took it
            # from there: GPT-2-small fp32 +1.26 ms on one H200 (run h200-s29).
            return None
        out = shape_of(node.output[0], dtype)
        for i, name in enumerate(node.input):
            condition = node.op_type == "Where" and i == 0
            if name == "" or (condition and shape_of(name, BOOL) is None):
                return None
            if not condition and scalar(name) is None and shape_of(name, dtype) is None:
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
        fused[idx[0]] = _fused_node([nodes[i] for i in idx], set(idx), readers, graph_outputs, scalar, facts.dtype_of)
        dropped |= set(idx)
    if not fused:
        return model
    # Place the fused nodes: a topological order that keeps the original one wherever it can
    # (each fused node takes its first member's place in the priority).
    items = [(i, fused[i]) for i in sorted(fused)] + [(i, nodes[i]) for i in range(len(nodes)) if i not in dropped]
    if bfloat16:  # as the backend fuses (bf16 casts joining): where an input is bf16, the rule may hold
        kept = recompute_in_readers([node for _, node in items], graph_outputs, facts.size_of)
        items = [(i, node) for (i, _), node in zip(items, kept) if node is not None]
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

    def zero(name: str) -> bool:  # +0.0 exactly (float32 or bfloat16): the masked elements are written as it
        value = facts.constants.get(name)
        if value is None or value.size != 1 or str(value.dtype) not in ("float32", "bfloat16"):
            return False
        value = float(value.reshape(-1)[0])
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
        kinds = {facts.dtype_of(name) for name in (y, dy, out)}
        kind = kinds.pop() if len(kinds) == 1 else None
        # One shape for y, dy and the result: the kernel neither broadcasts nor reshapes.
        shape = facts.shape_of(y, kind) if kind in (FLOAT, BF16) else None
        if shape is None or not shape == facts.shape_of(dy, kind) == facts.shape_of(out, kind):
            continue
        if not any(nodes[r].domain in native_domains for r in facts.readers.get(out, ())):
            continue
        # A bf16 step's mask is read widened, its result (dy or 0) rounded back, exactly.
        steps = [(RELU_MASK, [("x", 0), ("x", 1)])] + ([(ROUND, [("t", 0)])] if kind == BF16 else [])
        fused[i] = make_fused([y, dy], [out], f"{where.name or out}/relu_mask", ["Greater", "Where"], steps,
                              [len(steps) - 1], [kind, kind], [kind])
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
        steps = function(node, opset)
        node.op_type = steps.name
        if (steps.domain, steps.name) not in known:
            known.add((steps.domain, steps.name))
            model.functions.append(steps)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def _cast_shape(node: onnx.NodeProto, facts: _Facts) -> tuple | None:
    """The shape of a Cast from bfloat16 to float32 or back (the module docstring), else None."""
    to = [a.i for a in node.attribute if a.name == "to"]
    if node.domain not in ("", "ai.onnx") or len(node.attribute) != 1 or len(to) != 1 or len(node.input) != 1:
        return None
    source = {FLOAT: BF16, BF16: FLOAT}.get(to[0])
    shape = facts.shape_of(node.input[0], source) if source is not None else None
    return shape if shape is not None and facts.shape_of(node.output[0], to[0]) == shape else None


def _fused_node(members: list[onnx.NodeProto], indices: set[int], readers: dict[str, set[int]],
                graph_outputs: set[str], scalar: Callable[[str], float | None],
                dtype_of: Callable[[str], int | None]) -> onnx.NodeProto:
    """One DOMAIN node for ``members`` (in graph order): its inputs are the tensors they read from
    outside, its outputs the values read outside (or graph outputs); attribute ``code`` is the
    kernel's body over parameters ``x0..`` / ``y0..``, ``ops`` the member op types (for the NumPy
    form and for reading the graph). A Cast member is the step WIDEN (to float32) or ROUND (to
    bfloat16); a member computing in bfloat16 is its op, then ROUND."""
    produced: dict[str, int] = {}  # a member's output -> the step that is it
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
        step = node.op_type
        if step == "Cast":
            step = WIDEN if node.attribute[0].i == FLOAT else ROUND
        steps.append((step, refs))
        if step not in (WIDEN, ROUND) and dtype_of(node.output[0]) == BF16:
            steps.append((ROUND, [("t", len(steps) - 1)]))
        produced[node.output[0]] = len(steps) - 1
    outputs = [node.output[0] for node in members
               if node.output[0] in graph_outputs or readers.get(node.output[0], set()) - indices]
    first = members[0].name or members[0].output[0]
    return make_fused(inputs, outputs, f"{first}/fused_elementwise", [n.op_type for n in members], steps,
                      [produced[name] for name in outputs], [dtype_of(n) for n in inputs], [dtype_of(n) for n in outputs])


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
