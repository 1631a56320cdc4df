"""Collectives inside the step's onnxruntime session: the default for a multi-rank step wherever our
custom ops run in the sessions (GpuBackend). Why, the design and what it measured: docs/gpu.md,
"What the cut costs, and what replaces it". On 4 H200s (run h200x4-s27, GPT-2-small) the direct
collectives below took the step from 32.98 to 32.44 ms (allreduce) and 34.86 to 33.95 (sharded),
and peak memory from 14.08 to 11.37 GiB and 14.01 to 11.21, against the cut, which now serves only
where our custom ops do not run in the sessions (no library, or GRAPH_TRANSPILER_NATIVE_OFF naming
in_session or all).

The cut (runtime/segments.py) ends a session at every collective: 18 sessions per GPT-2-small
step on 4 ranks, whose crossing values live in the program's block beside each session's arena.
Here the cut keeps the collective nodes in the segments
(``cut_graph(..., collectives_inside=True)``) and the compile pass ``SessionCollectives`` makes
each of them two nodes of ``DOMAIN``, which TakeNativeNodes then runs as custom ops:

- ``Start`` (the previous start's token, then the collective's inputs) -> its token: copies the
  inputs into the bucket (a flat device buffer laid out by the op class, CollectiveOp.flat_layout),
  records ``ready`` on the compute stream, makes the communication stream wait for it and enqueues
  the collective there (CollectiveOp.launch_flat), then records ``done`` there;
- ``Finish`` (the token) -> the collective's outputs: makes the compute stream wait for ``done``
  and copies the results out of the bucket.

Those two copies cost GPT-2-small 0.6 to 1.0 ms a step on 4 H100s (about 1 GB of traffic each way).
A ReduceScatter's bucket (``STAGED_FLAT``) is scratch: its inputs are copied in, its slice copied
out. So it is an output of the start that onnxruntime allocates from the session's arena and
frees after the finish, in memory the backward's freed activations leave, instead of a buffer held
for the whole run (`zero`'s gradient buckets: 0.61 GiB on GPT-2-small at 4 ranks). Its padding
tail is zeroed at each start (its sum lands in the last rank's slice). An AllGather's bucket stays
the program's: it holds the parameters (the program binds them to their views in it).

AllReduce, Reduce and Broadcast (``DIRECT``) run without them: the start also outputs one staged
buffer per output of the collective on this rank (none for a Reduce off its root), which
onnxruntime allocates and NCCL writes, out of place from the inputs (none for a Broadcast off its
root), all of the bucket's tensors in one NCCL group (the op's ``launch_direct``; the mean as
ncclAvg); its finish reads the
staged buffers and the inputs, so that onnxruntime hands neither to another value before NCCL is
done, and tells onnxruntime that each output may take its staged buffer (``may_inplace``: a hint,
honoured where the sizes match and nothing reads the staged value after; where declined, the
finish copies). No node ever writes a buffer it reads as an input: onnxruntime may let values share
buffers (Reshape, common subexpressions) in ways the rewrite cannot see. ReduceScatter and
AllGather go through a bucket (the zero strategy's shards cut across tensors): the ReduceScatter's
staged for one run (above), the AllGather's the program's. On CPU every staged buffer
is taken in place (tests/test_session_collectives.py); on 4 H200s the direct collectives equal the
CPU backend (tests/test_gpu_equivalence.py: GPT, the BN CNN, every strategy, 2e-7 to 6e-7).

A graph that captured NCCL calls must go before its communicator: NCCL does not destroy a
communicator that a live graph captured, so NcclCommunicator.close drops the programs' sessions
first (GpuProgram.release), then destroys it.

The token chain puts every rank's NCCL calls in one order (the collectives' ``order``), which NCCL
needs, the more so once a CUDA graph captures them: every rank must capture the same calls. A
captured session records the event pairs as the graph's edges between the two streams and NCCL's
kernels as its nodes, so a step is one replay per session. The nodes are ordered for onnxruntime's
PRIORITY_BASED execution order, which follows the node order where the dependencies allow (a CPU
probe: the default order computes every gradient before the first start, which would leave nothing
to overlap): each start right after the last producer of its inputs, each finish right before the
first reader of its outputs.

Invariants: a bucket's buffer is written by its start (compute stream) and read by its collective
(communication stream, after ``ready``) and its finish (compute stream, after ``done``); the next
step's start comes after this step's finish in the compute stream's order, so one buffer serves
every step (an AllGather's), or onnxruntime frees it after the finish, which is after ``done`` (a
ReduceScatter's, an input of its finish, in the session's arena).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from runtime.collectives import COLLECTIVE_DOMAIN, CollectiveOp, TensorSpec, make_collective
from runtime.errors import RunError
from runtime.specialize import static_values

DOMAIN = "graph_transpiler.session_collectives"
START, FINISH = "Start", "Finish"
TOKEN_SHAPE = (1,)
# Collectives run "direct": NCCL reads the session's own input buffers and writes into the start's
# staged outputs, one tensor each in one NCCL group, and the finish hands the staged buffers on (the
# module docstring). The others go through a flat bucket, with a copy in and a copy out.
DIRECT = frozenset({"AllReduce", "Reduce", "Broadcast"})
STAGED = ".staged"  # suffix of a direct collective's staged output names
# Collectives whose flat bucket is scratch, an output of the start (the module docstring).
STAGED_FLAT = frozenset({"ReduceScatter"})
FLAT = ".flat"  # suffix of a staged bucket's name


def rewrite(model: onnx.ModelProto, where: str, *, world: int | None) -> tuple[onnx.ModelProto, dict[int, onnx.NodeProto]]:
    """``model`` (a specialized segment) with each collective node replaced by its start and finish
    (the module docstring), the nodes reordered for the PRIORITY_BASED order, each token with its
    value_info; and the collective nodes replaced, by ``order``. The start and finish carry
    ``bucket`` (the collective's order); the start ``chained`` (whether its first input is the
    previous start's token); both ``flat`` where the bucket is the start's output (``STAGED_FLAT``,
    ``world`` times its one output's elements)."""
    graph = model.graph
    nodes = list(graph.node)
    collectives = sorted((n for n in nodes if n.domain == COLLECTIVE_DOMAIN), key=_order)
    if not collectives:
        return model, {}
    orders = [_order(n) for n in collectives]
    if len(set(orders)) != len(orders):
        raise RunError(f"{where}: collective 'order' attributes repeat: {orders}")
    starts, finishes, tokens, originals = {}, {}, [], {}
    known = static_values(graph)
    staged_info = []
    previous = None
    for node in collectives:
        k = _order(node)
        token = f"{DOMAIN}.token{k}"
        direct = node.op_type in DIRECT
        flat = [f"{node.output[0]}{FLAT}"] if node.op_type in STAGED_FLAT else []
        # Direct: the start's outputs are what NCCL writes: a staged buffer for each output a node
        # of the segment reads (the finish hands it on, so no reader runs before NCCL is done), the
        # output itself for one only the segment's caller reads (the finish, before the session
        # ends, makes the compute stream wait for NCCL: an output of a session is not copied into).
        # The finish reads the staged buffers and the inputs, so that onnxruntime hands neither to
        # another value before NCCL is done.
        read_here = {n for other in nodes if other is not node for n in other.input}
        staged_for = [o for o in node.output if o in read_here] if direct else []
        staged = [f"{o}{STAGED}" for o in staged_for]
        written = [f"{o}{STAGED}" if o in staged_for else o for o in node.output] if direct else []
        starts[k] = helper.make_node(START, ([previous] if previous else []) + list(node.input),
                                     [token, *written, *flat], domain=DOMAIN, name=f"{node.name or node.op_type}.start{k}",
                                     bucket=k, chained=int(previous is not None), direct=int(direct), flat=int(bool(flat)))
        finishes[k] = helper.make_node(FINISH, [token, *staged, *flat, *(node.input if direct else [])],
                                       staged_for if direct else list(node.output), domain=DOMAIN,
                                       name=f"{node.name or node.op_type}.finish{k}", bucket=k, direct=int(direct),
                                       flat=int(bool(flat)))
        if flat:
            if world is None:
                raise RunError(f"{where}: collective '{node.name}' ({node.op_type}): no communicator to size its bucket by")
            if node.output[0] not in known:
                raise RunError(f"{where}: collective '{node.name}': output '{node.output[0]}' has no static shape")
            shape, dtype = known[node.output[0]]
            staged_info.append(helper.make_tensor_value_info(flat[0], dtype, [world * int(np.prod(shape, dtype=np.int64))]))
        for name, out in zip(staged, staged_for):
            if out not in known:
                raise RunError(f"{where}: collective '{node.name}': output '{out}' has no static shape")
            shape, dtype = known[out]
            staged_info.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        originals[k] = onnx.NodeProto()
        originals[k].CopyFrom(node)
        tokens.append(token)
        previous = token
    ordered = _order_nodes([n for n in nodes if n.domain != COLLECTIVE_DOMAIN], [starts[k] for k in orders],
                           [finishes[k] for k in orders], {i.name for i in graph.input} | {t.name for t in graph.initializer},
                           [o.name for o in graph.output], where)
    del graph.node[:]
    graph.node.extend(ordered)
    graph.value_info.extend(helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, list(TOKEN_SHAPE)) for t in tokens)
    graph.value_info.extend(staged_info)  # static sizes: onnxruntime shares equal-sized buffers only
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model, originals


def _order(node: onnx.NodeProto) -> int:
    for a in node.attribute:
        if a.name == "order":
            return int(a.i)
    raise RunError(f"collective node '{node.name}' ({node.op_type}) has no 'order' attribute")


def _order_nodes(plain: list[onnx.NodeProto], starts: list[onnx.NodeProto], finishes: list[onnx.NodeProto],
                 available: set[str], outputs: list[str], where: str) -> list[onnx.NodeProto]:
    """A topological order of every node: the plain nodes in their order; each start (in token
    order) as soon as its inputs exist; each finish just before the first plain node that reads one
    of its outputs, the rest at the end."""
    produced_by_finish = {name: f for f in finishes for name in f.output}
    have = set(available)
    out: list[onnx.NodeProto] = []
    pending = list(starts)  # in token order: each needs the one before it
    emitted_finish: set[int] = set()

    def emit(node):
        out.append(node)
        have.update(node.output)

    def flush_starts():
        while pending and all(n in have for n in pending[0].input if n):
            emit(pending.pop(0))

    def finish_for(name: str) -> None:
        f = produced_by_finish.get(name)
        if f is None or id(f) in emitted_finish:
            return
        if f.input[0] not in have:  # its start has not run: every plain node before must go first
            raise RunError(f"{where}: a value of collective '{f.name}' is read before the collective's inputs exist")
        emitted_finish.add(id(f))
        emit(f)
        flush_starts()

    flush_starts()
    for node in plain:
        for name in node.input:
            if name:
                finish_for(name)
        emit(node)
        flush_starts()
    if pending:
        raise RunError(f"{where}: collective '{pending[0].name}' has inputs no node computes")
    for f in finishes:
        if id(f) not in emitted_finish:
            emit(f)
    return out


@dataclass
class Bucket:
    """What one collective's start and finish share (made at the start's first launch)."""

    op: CollectiveOp
    flat: Any = None
    staged: bool = False  # ``flat`` is the start's output (STAGED_FLAT), onnxruntime's, one run long
    layout: Any = None  # the flat buffer's FlatLayout
    inputs: dict[str, Any] = field(default_factory=dict)  # input name -> its view of ``flat``
    outputs: dict[str, Any] = field(default_factory=dict)
    mean_view: Any = None
    ready: Any = None
    done: Any = None


class Registry:
    """The buckets of one process's step sessions, by collective order, and how runners reach the
    communicator (set by GpuBackend.make_program before any session is compiled)."""

    def __init__(self):
        self.comm = None
        self.buckets: dict[int, Bucket] = {}
        # From the compile pass (``record``): each collective node replaced, and its output specs.
        self.nodes: dict[int, onnx.NodeProto] = {}
        self.specs: dict[int, list[TensorSpec]] = {}

    def record(self, model: onnx.ModelProto, originals: dict[int, onnx.NodeProto]) -> None:
        """The collectives ``rewrite`` replaced in ``model`` (a specialized segment) and the static
        specs of their outputs, for the starts, which run first and lay the buckets out."""
        known = static_values(model.graph)
        for k, node in originals.items():
            self.nodes[k] = node
            self.specs[k] = [TensorSpec(known[o][0], helper.tensor_dtype_to_np_dtype(known[o][1])) for o in node.output]

    def bucket(self, k: int, where: str) -> Bucket:
        if k not in self.buckets:
            self.buckets[k] = Bucket(make_collective(self.nodes[k], self.specs[k], self.comm.rank, where))
        return self.buckets[k]

    def output_view(self, name: str) -> Any:
        """The view of collective output ``name`` in its bucket's flat buffer (one buffer, used by
        every step), or None: a direct collective has no bucket, a staged one lives for one run, and
        a bucket exists from its start's first launch on."""
        return next((b.outputs[name] for b in self.buckets.values() if name in b.outputs and not b.staged), None)


def _attr(node: onnx.NodeProto, name: str, default: int | None = None) -> int:
    for a in node.attribute:
        if a.name == name:
            return a.i
    if default is not None:
        return default
    raise RunError(f"node '{node.name}' ({node.op_type}) lacks attribute '{name}'")


class StartRunner:
    """Runs one start node inside a session (the module docstring); ``launch`` as native runners do."""

    def __init__(self, node: onnx.NodeProto, where: str, device, registry: Registry):
        self.node, self.where, self.device, self.registry = node, where, device, registry
        self.names = list(node.input[1:] if _attr(node, "chained") else node.input)
        self.written = list(node.output[1:])  # direct: where NCCL writes (staged buffers, or the outputs)
        self.direct = bool(_attr(node, "direct"))
        self.staged = bool(_attr(node, "flat", 0))  # then ``written`` is the bucket, [N*S]
        self.bucket: Bucket | None = None

    def launch(self, values: dict[str, Any], *, allocate: bool) -> None:
        comm, compute = self.registry.comm, self.device.compute
        if self.bucket is None:
            self.bucket = self._bucket(values)
        bucket = self.bucket
        if not self.direct:
            with compute:  # the copies in order with the session's kernels, whichever thread calls
                if self.staged:
                    self._stage(bucket, values[self.written[0]])
                for name in self.names:
                    bucket.inputs[name][...] = values[name]
        bucket.ready.record(compute)
        comm.stream.wait_event(bucket.ready)
        if self.direct:
            bucket.op.launch_direct(comm, [values[n] for n in self.names], [values[n] for n in self.written],
                                    bucket.op.label)
        else:
            bucket.op.launch_flat(comm, bucket.flat, bucket.mean_view, bucket.op.label)
        bucket.done.record(comm.stream)

    def _bucket(self, values: dict[str, Any]) -> Bucket:
        """This collective's bucket, made at the first launch: its two events, and (not direct) its
        flat buffer and the views of the inputs and outputs in it."""
        comm, cp = self.registry.comm, self.device.cp
        bucket = self.registry.bucket(_attr(self.node, "bucket"), self.where)
        bucket.ready = cp.cuda.Event(disable_timing=True)
        bucket.done = cp.cuda.Event(disable_timing=True)
        if not self.direct:
            bucket.layout = bucket.op.flat_layout([tuple(values[n].shape) for n in self.names], comm.size, comm.rank)
            bucket.staged = self.staged
            if not self.staged:
                _views(bucket, cp.zeros(bucket.layout.total, dtype=np.dtype(values[self.names[0]].dtype) if self.names
                                        else np.dtype(bucket.op.output_specs[0].dtype)))
        return bucket

    @staticmethod
    def _stage(bucket: Bucket, flat) -> None:
        """The views of a staged bucket in this run's buffer (onnxruntime's, so it may move between
        uncaptured runs), and its padding tail zeroed: that buffer held other values before."""
        if bucket.flat is None or bucket.flat.data.ptr != flat.data.ptr:
            _views(bucket, flat)
        if bucket.layout.inputs_end < bucket.layout.total:
            flat[bucket.layout.inputs_end:] = 0


def _views(bucket: Bucket, flat) -> None:
    bucket.flat = flat
    bucket.inputs = bucket.op.flat_inputs(bucket.layout, flat)
    bucket.outputs = bucket.op.flat_outputs(bucket.layout, flat)
    bucket.mean_view = bucket.op.flat_mean_view(bucket.layout, flat)


class FinishRunner:
    def __init__(self, node: onnx.NodeProto, where: str, device, registry: Registry):
        self.node, self.where, self.device, self.registry = node, where, device, registry
        self.k = _attr(node, "bucket")
        self.direct = bool(_attr(node, "direct"))
        outputs = len(node.output)
        # Direct: output j may take the buffer of staged input 1 + j, which nothing reads after this
        # node (a hint to onnxruntime's planner: where it declines, launch copies).
        self.may_inplace = tuple((1 + j, j) for j in range(outputs)) if self.direct else ()

    def launch(self, values: dict[str, Any], *, allocate: bool) -> None:
        bucket = self.registry.buckets.get(self.k)
        if bucket is None or bucket.done is None:
            raise RunError(f"{self.where}: '{self.node.name}' ran before its collective started")
        compute = self.device.compute
        compute.wait_event(bucket.done)
        with compute:
            for j, name in enumerate(self.node.output):
                # Direct: the staged buffer NCCL wrote; else the output's view in the bucket. Nothing to
                # copy where the output already is that buffer (a hint taken, an output bound to its view).
                source = values[self.node.input[1 + j]] if self.direct else bucket.outputs[name]
                if values[name].data.ptr != source.data.ptr:
                    values[name][...] = source


def runner(group, where: str, device, registry: Registry):
    """The runner of one start or finish node (TakeNativeNodes hands each node as a group of one)."""
    (node,) = group.nodes
    return (StartRunner if node.op_type == START else FinishRunner)(node, where, device, registry)
