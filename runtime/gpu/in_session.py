"""Native nodes inside onnxruntime sessions: a segment's cuDNN BatchNorms, Conv weight gradients,
LayerNorm gradients, fused elementwise nodes and fused attention run as custom ops of its CUDA EP session
(runtime/ort_custom_ops.py), by the same runners that otherwise run them between sessions.

Why: as native stages, each such node cut the step into one more session (ResNet-18: 34 sessions,
~21 MiB each on the shared arena; the LayerNorm kernels on GPT-2-small: 25 more sessions, +3.1 GiB
and gaps that ate their gain, docs/gpu.md). Inside the session they run on its stream, between its
own kernels, and its CUDA graph captures them: a replay launches them with no Python at all.

A node is taken in only where every input and output is float32 (or, for a fused elementwise node,
bfloat16, passed as its raw bits, and a Where's bool condition; an attention node, bfloat16 or
float16 heads: ``TAKES``) with a static shape in the
specialized segment (the runners' first call checks the rest, as between sessions; an error it
raises fails the run naming the segment and the node). Each taken node becomes a node of
``DOMAIN`` with an op_type of its own in the session (the op is that one node: its runner, its
shapes); a node not taken keeps its domain and runs as its ONNX function, as where its native
switch is off (fused elementwise nodes carry a function of their steps too; a node of these domains
with no function that cannot be taken is an error naming it).

Per compute call: the input and output pointers from onnxruntime, wrapped as CuPy arrays of the
static shapes, then the runner's ``launch``: the first call with ``allocate`` (checks, descriptors,
cuDNN's algorithm search), later calls without. The first call also checks that onnxruntime runs
the node on the device's compute stream, on which the runners enqueue.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import helper

from contract.collectives import consumed
from contract.ops import ATTENTION_DOMAIN, CONV_GRAD_DOMAIN, FUSED_UPDATE_DOMAIN
from runtime.errors import RunError
from runtime.gpu.batchnorm_casts import DOMAIN as BATCHNORM_CASTS_DOMAIN
from runtime.gpu.bias_grad import DOMAIN as BIAS_GRAD_DOMAIN
from runtime.gpu.conv_data_grad import DOMAIN as CONV_DATA_GRAD_DOMAIN
from runtime.gpu.cross_entropy import DOMAIN as CROSS_ENTROPY_DOMAIN
from runtime.gpu.elementwise_steps import CUPY_DTYPES
from runtime.gpu.elementwise_steps import DOMAIN as ELEMENTWISE_DOMAIN
from runtime.gpu.layernorm_casts import DOMAIN as LAYERNORM_FORWARD_DOMAIN
from runtime.gpu.parameter_casts import DOMAIN as PARAMETER_CASTS_DOMAIN
from runtime.gpu.rewrite_nodes import attribute
from runtime.gpu.scatter_add import DOMAIN as SCATTER_ADD_DOMAIN
from runtime.gpu.session_collectives import DOMAIN as SESSION_COLLECTIVES_DOMAIN
from runtime.gpu.session_collectives import FINISH, START
from runtime.ort_custom_ops import KernelContext, PythonOp
from runtime.segments import build_native
from runtime.specialize import static_values

DOMAIN = "graph_transpiler.in_session"  # the session-private domain of taken nodes
# The element types each runner computes on (every other runner: float32 only, as the transpiler
# and the rewrites write its nodes only for float32); each is viewed in CuPy as VIEWS says.
VIEWS = {**CUPY_DTYPES, onnx.TensorProto.FLOAT16: np.dtype(np.float16), onnx.TensorProto.INT32: np.dtype(np.int32),
         onnx.TensorProto.INT64: np.dtype(np.int64)}
TAKES = {ELEMENTWISE_DOMAIN: tuple(CUPY_DTYPES),
         CROSS_ENTROPY_DOMAIN: (onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16, onnx.TensorProto.INT32,
                                onnx.TensorProto.INT64),
         ATTENTION_DOMAIN: (onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16),
         SCATTER_ADD_DOMAIN: (onnx.TensorProto.FLOAT, onnx.TensorProto.INT64),
         PARAMETER_CASTS_DOMAIN: (onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16),
         BIAS_GRAD_DOMAIN: (onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16, onnx.TensorProto.INT64),
         BATCHNORM_CASTS_DOMAIN: (onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16),
         LAYERNORM_FORWARD_DOMAIN: (onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16),
         # --precision bf16|fp16: a low-precision Conv's weight gradient (conv_grad.py: cuDNN in its dtype)
         CONV_GRAD_DOMAIN: (onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16),
         CONV_DATA_GRAD_DOMAIN: (onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16),
         # --grad-dtype bf16|fp16: gradient buckets in the low dtype (nccl_types.nccl_dtype)
         SESSION_COLLECTIVES_DOMAIN: (onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16),
         # a bfloat16 weight gradient the update widens as it reads it (gradient_casts.py)
         FUSED_UPDATE_DOMAIN: (onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16)}
# Domains whose consecutive nodes run as one op, one runner for the run: the fused updates, one
# multi-tensor launch for the updates of a bucket (the finish of the next bucket's collective ends
# the run; a session of no collectives has one run).
GROUPED = frozenset({FUSED_UPDATE_DOMAIN})
# Ops whose readers may end up reading the op's input itself: onnxruntime's CUDA EP gives some their
# input's buffer (a view), and its graph optimizations remove others (a Cast to the same type, a
# Dropout in inference, an Expand or Slice that changes nothing, a Transpose pair, a Transpose into a
# MatMul), their readers then reading the input.
ALIASING = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast", "Dropout", "Expand",
                      "Slice", "Transpose"})


class _NodeKernel:
    """The compute of one taken node (the module docstring)."""

    def __init__(self, runner, node: onnx.NodeProto, ins: list, outs: list, device, where: str,
                 in_place: dict[str, str] | None = None):
        self.runner = runner
        # Outputs the program may bind over their inputs (safe_in_place): OrtCudaSegment.in_place_pairs.
        self.in_place = dict(in_place or {})
        # Set by OrtCudaSegment around the first graph run of a parity, which onnxruntime makes
        # several runs of one call: uncaptured runs until its count allows a capture, then the
        # capture and its replay (InferenceSession::Run runs itself again while the graph is not
        # captured). A node writing state in place must update it once: it launches only while
        # the stream captures, and the replay runs it. (Other nodes compute the same again.)
        self.capture_call = False
        self.captured_launches = 0  # launches while capturing in a capture call (OrtCudaSegment checks: one)
        self.node_name = node.name or node.op_type
        self.ins, self.outs = ins, outs  # [(name, shape, numpy dtype)]
        self.device = device  # a GpuDevice (device.py)
        self.where = where
        self.first = True

    def __call__(self, ctx: KernelContext) -> None:
        if self.capture_call:  # set only on a kernel with in-place pairs (capture_call)
            if not self.device.compute.is_capturing():
                return
            self.captured_launches += 1
        if self.first:
            self._check(ctx)
        # Views valid for this call only: onnxruntime owns the buffers (no owner kept).
        array = self.device.device_array
        values = {name: array(ctx.input_ptr(i), shape, dtype) for i, (name, shape, dtype) in enumerate(self.ins)}
        for j, (name, shape, dtype) in enumerate(self.outs):
            values[name] = array(ctx.output_ptr(j, shape), shape, dtype)
        first, self.first = self.first, False
        self.runner.launch(values, allocate=first)

    def _check(self, ctx: KernelContext) -> None:
        stream = ctx.gpu_stream()
        if stream != self.device.compute.ptr:
            raise RunError(f"{self.where}: '{self.node_name}': onnxruntime runs it on stream {stream:#x}, not the "
                           f"compute stream {self.device.compute.ptr:#x}")
        for i, (name, shape, _) in enumerate(self.ins):
            got, _ = ctx.input_shape(i)
            if got != shape:
                raise RunError(f"{self.where}: '{self.node_name}': input '{name}' is {got}, specialized as {shape}")


@contextmanager
def capture_call(custom_ops: list[PythonOp], where: str):
    """Around a session's first graph run of a step parity, which onnxruntime makes several runs of
    one call (``_NodeKernel.capture_call``): the ops that write state in place launch only while the
    stream captures. After it, each must have launched once while capturing (then its replay ran
    it once), else its state would be wrong: a one-line error."""
    kernels = [op.compute for op in custom_ops if getattr(op.compute, "in_place", None)]
    for kernel in kernels:
        kernel.capture_call, kernel.captured_launches = True, 0
    try:
        yield
    finally:
        for kernel in kernels:
            kernel.capture_call = False
    wrong = [k for k in kernels if k.captured_launches != 1]
    if wrong:
        raise RunError(f"{where}: onnxruntime's capture ran '{wrong[0].node_name}' {wrong[0].captured_launches} "
                       "times while capturing, not once: the state it updates in place would be wrong (set "
                       "GRAPH_TRANSPILER_NATIVE_OFF=in_session to run the updates between sessions)")


def take_native_nodes(model: onnx.ModelProto, domains, runner: Callable, device, where: str,
                      here: tuple[int, int, int]) -> tuple[onnx.ModelProto, list[PythonOp]]:
    """``model`` (specialized) with its nodes of ``domains`` made custom ops of ``DOMAIN``, and
    those ops; functions no node calls any more are dropped. ``runner(group, where)`` makes the
    runner of a NativeGroup (one node; a run of consecutive nodes of a ``GROUPED`` domain); its
    kernels run on ``device``'s compute stream."""
    graph = model.graph
    known = static_values(graph)
    nodes = list(graph.node)
    runs = grouped_runs([k for k, node in enumerate(nodes) if node.domain in domains and _takeable(node, known, model, where)],
                 nodes)
    read_inside = {name for node in nodes for name in consumed(node)}
    ops: list[PythonOp] = []
    taken: set[tuple[str, str]] = set()  # (domain, op_type) of the nodes taken in
    fused: dict[int, onnx.NodeProto] = {}  # a run's first position -> its node
    for run in runs:
        originals = []
        for k in run:
            original = onnx.NodeProto()
            original.CopyFrom(nodes[k])
            originals.append(original)
            taken.add((original.domain, original.op_type))
        group = build_native(originals, here)
        node_runner = runner(group, where)
        first = originals[0]
        inputs, outputs, in_place = list(first.input), list(first.output), {}
        if first.domain in GROUPED:
            inputs, outputs = list(group.inputs), list(group.outputs)
            token = _last_start_token(nodes[:run[0]])
            inputs += [token] if token else []
            # In place only where every output leaves the session: a capture call skips the op's
            # uncaptured runs (_NodeKernel.capture_call), which must leave nothing a node reads.
            if hasattr(node_runner, "in_place_pairs") and not read_inside & set(outputs):
                in_place = safe_in_place(nodes, set(run), inputs, node_runner.in_place_pairs(),
                                         {i.name for i in graph.input})
        spec = lambda name: (name, known[name][0], VIEWS[known[name][1]])  # noqa: E731
        ins, outs = [spec(n) for n in inputs], [spec(n) for n in outputs]
        op_type = f"{first.op_type}_{len(ops)}"
        label = f"'{first.name or first.op_type}'" + (f" and {len(run) - 1} more" if len(run) > 1 else "")
        kernel = _NodeKernel(node_runner, first, ins, outs, device, where, in_place)
        ops.append(PythonOp(op_type, [known[n][1] for n in inputs], [known[n][1] for n in outputs], kernel,
                            provider=device.provider, label=f"{where}: {label}",
                            may_inplace=getattr(node_runner, "may_inplace", ())))
        fused[run[0]] = helper.make_node(op_type, inputs, outputs, name=first.name, domain=DOMAIN)
    if ops:
        gone = {k for run in runs for k in run}
        kept = [fused.get(k, node) for k, node in enumerate(nodes) if k not in gone or k in fused]
        del graph.node[:]
        graph.node.extend(kept)
        called = {(n.domain, n.op_type) for n in model.graph.node}
        functions = [f for f in model.functions if (f.domain, f.name) in called or (f.domain, f.name) not in taken]
        del model.functions[:]
        model.functions.extend(functions)
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model, ops


def grouped_runs(taken: list[int], nodes: list[onnx.NodeProto]) -> list[list[int]]:
    """The positions ``taken`` (in order) as the custom ops they become: one each, but a node of a
    ``GROUPED`` domain joins the run of its domain before it where every input it reads is made
    before that run's first node or by the run (the fused op takes the first node's place, so the
    nodes between that read the run's outputs still follow it): a bucket's updates, but not across
    the finish of the next bucket's collective, which makes their gradients. (`--precision fp16`
    puts a Where after each update; it reads the update's outputs and joins no run.)"""
    made_at = {name: k for k, node in enumerate(nodes) for name in node.output if name}
    runs: list[list[int]] = []
    for k in taken:
        domain = nodes[k].domain
        run = next((r for r in reversed(runs) if nodes[r[0]].domain == domain), None) if domain in GROUPED else None
        if run is not None:
            members = {name for r in run for name in nodes[r].output}
            if all(name in members or made_at.get(name, -1) < run[0] for name in consumed(nodes[k])):
                run.append(k)
                continue
        runs.append([k])
    return runs


def _takeable(node: onnx.NodeProto, known: dict, model: onnx.ModelProto, where: str) -> bool:
    """Whether ``node`` can run as a custom op (every input and output of a type its runner takes,
    with a static shape); else it runs as its function, and a node without one is an error."""
    names = [n for n in node.input if n], [n for n in node.output if n]
    takes = TAKES.get(node.domain, (onnx.TensorProto.FLOAT,))
    if len(names[0]) == len(node.input) and len(names[1]) == len(node.output) and all(
            n in known and known[n][1] in takes for n in names[0] + names[1]):
        return True
    if not any(f.domain == node.domain and f.name == node.op_type for f in model.functions):
        raise RunError(f"{where}: node '{node.name}' ({node.domain}::{node.op_type}) has no static float32 "
                       "shape for every input and output, and no function to run it otherwise")
    return False


def _last_start_token(nodes: list[onnx.NodeProto]) -> str | None:
    """The token of the last collective start among ``nodes`` (session_collectives.py), if any."""
    starts = [n for n in nodes if n.domain == SESSION_COLLECTIVES_DOMAIN and n.op_type == START]
    return starts[-1].output[0] if starts else None


def safe_in_place(nodes: list[onnx.NodeProto], members: set[int], inputs: list[str], pairs: dict[str, str],
                  graph_inputs: set[str]) -> dict[str, str]:
    """The pairs ``out -> src`` of a run of nodes (positions ``members`` of ``nodes``, the
    session's graph; ``inputs``: the fused node's) whose ``src``, a graph input, every other node
    that reads it must have read before the run writes over it: each such reader is an ancestor of
    the fused node, so any order onnxruntime picks runs it first (its priority order does not
    protect a reader: a node its fusions make is numbered last, and a priority-based order runs
    the lowest number that is ready).

    The fused updates' run takes the last preceding collective start's token (take_native_nodes),
    so every node that computes a gradient (each start follows the one before it) is an ancestor:
    a weight that the backward reads for its input's gradient (dX = dY W^T), which no update of its
    own bucket needs, is then read before the update. Where some reader is not an ancestor, the
    pair is left out and the program gives the output a buffer of its own."""
    producer = {name: k for k, node in enumerate(nodes) for name in node.output if name}
    ancestors: set[int] = set()
    todo = [producer[n] for n in inputs if n in producer]
    while todo:
        k = todo.pop()
        if k in ancestors or k in members:
            continue
        ancestors.add(k)
        todo.extend(producer[n] for n in consumed(nodes[k]) if n in producer)
    readers: dict[str, set[int]] = {}
    for k, node in enumerate(nodes):
        if k not in members:
            for name in consumed(node):
                readers.setdefault(name, set()).add(k)
    # A collective start hands its inputs to NCCL, which reads them until its finish.
    finish_of = {attribute(n, "bucket"): k for k, n in enumerate(nodes) if n.domain == SESSION_COLLECTIVES_DOMAIN and n.op_type == FINISH}
    done = {k: finish_of.get(attribute(n, "bucket"), -1) if n.domain == SESSION_COLLECTIVES_DOMAIN and n.op_type == START else k
            for k, n in enumerate(nodes)}  # -1: a start without its finish here is never done

    def read_before(src: str) -> bool:
        # The value and what may read it through an op onnxruntime aliases or removes (ALIASING).
        names, todo = {src}, [src]
        while todo:
            for k in readers.get(todo.pop(), ()):
                if nodes[k].op_type in ALIASING and nodes[k].domain in ("", "ai.onnx"):
                    fresh = [o for o in nodes[k].output if o and o not in names]
                    names.update(fresh)
                    todo.extend(fresh)
        return all(done[k] in ancestors and k in ancestors for name in names for k in readers.get(name, ()))

    return {out: src for out, src in pairs.items() if src in graph_inputs and read_before(src)}
