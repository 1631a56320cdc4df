"""GpuBackend: onnxruntime CUDA EP sessions bound to device buffers, and GpuProgram, which runs a
cut rank graph with its collectives overlapped.

Streams and order. Every session runs on one compute stream (``user_compute_stream``); every NCCL
call runs on the communicator's stream. Collective k waits for an event recorded on the compute
stream after the segments before it; a segment that reads a collective's outputs waits for the
event recorded after that collective. So bucket k's collective runs while the backward of later
buckets computes, and (with ``split_tail``) the optimizer of bucket k runs as soon as it is done.
At the end of a step the compute stream waits for every collective, so the next step never
writes a buffer that NCCL still reads.

Buffers. The first call of a program (the init graph's only one, and the first step) runs with
onnxruntime allocating the outputs and records every value's shape. From the second call on,
everything is preallocated and bound once, in two IOBindings per segment (one per step parity):
- each collective owns one flat buffer (two, by parity, if its outputs are state); a gradient that
  only its collective reads is bound straight into its slot (bind_output at a pointer into the
  bucket), so one NCCL call moves the bucket without a copy; collectives run in place;
- values that leave the program (state, loss) get two buffers, by parity: step t reads step t-1's
  values from one set while writing the other;
- values passed between segments of one step get one buffer each.
A step then is: rebind the few inputs whose pointer changed, run each session, enqueue each NCCL
call. No tensor goes to the host; the loss is copied on the device into a ring read when logging.
onnxruntime synchronizes its stream at the end of each run unless GRAPH_TRANSPILER_ORT_ASYNC=1
(see GpuBackend): the collectives still overlap the following segments.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from runtime.collectives import CollectiveOp, Communicator
from runtime.errors import RunError
from runtime.executor import Backend, SegmentRunner, _first_line
from runtime.fused_update import DOMAIN as FUSED_UPDATE_DOMAIN
from runtime.gpu.cuda import ORT_DTYPES, import_cupy, load_onnxruntime
from runtime.gpu.fused_update import FusedUpdateRunner
from runtime.gpu.lowering import lower_for_cuda
from runtime.segments import CutGraph, NativeGroup, Segment
from runtime.specialize import specialize

LOSS_RING = 4096  # device slots for losses not yet read; Trainer flushes long before it wraps


class OrtCudaSegment(SegmentRunner):
    """One segment as a CUDA EP session on the backend's compute stream.

    The session is made on the first call, when the shapes of the segment's inputs are known: the
    segment is specialized to them (runtime/specialize.py), so no shape computation is left to run
    on the host, and then, unless the backend's ``cuda_graphs`` is off, onnxruntime captures each
    step parity's run as a CUDA graph (``gpu_graph_id`` = parity) and replays it: a step launches one
    graph per segment instead of one kernel per node. A graph needs every node on the CUDA EP and
    the same buffers on every replay, which the parity bindings give (GpuProgram); a segment that
    onnxruntime will not capture runs as before, and ``graph_refused`` says why.
    """

    def __init__(self, segment: Segment, where: str, backend: GpuBackend):
        self.backend = backend
        self.segment = segment
        self.where = f"{where}: segment {segment.index}" + (f" part {segment.part}" if segment.part else "")
        self.inputs = list(segment.inputs)
        self.outputs = list(segment.outputs)
        self.session = None
        self.graphs = False  # whether runs from the second call on are CUDA graph replays
        self.graph_refused: str | None = None
        self.bindings: list[Any] = [None, None]  # per parity, once the output buffers exist
        self.bound: list[dict[str, int]] = [{}, {}]  # per parity: input name -> bound pointer
        self.seen = [False, False]  # per parity: bound runs made with the current pointers
        self.captured = [False, False]  # per parity: whether its graph is captured (pointers frozen)

    def _compile(self, feeds) -> None:
        backend, ort = self.backend, self.backend.ort
        model = self.segment.model
        if backend.static_shapes:
            model = lower_for_cuda(specialize(model, {name: tuple(feeds[name].shape) for name in self.inputs}))
        serialized = model.SerializeToString()
        cuda = {"device_id": str(backend.device_id), "user_compute_stream": str(backend.compute.ptr),
                "has_user_compute_stream": "1", "use_tf32": "1" if backend.tf32 else "0",
                # Grow the arena by what is asked, not to the next power of two: a training step
                # allocates a few large activations, and doubling can reserve up to twice what it uses.
                "arena_extend_strategy": "kSameAsRequested"}

        def session(graph: bool):
            options = ort.SessionOptions()
            options.log_severity_level = 3
            return ort.InferenceSession(serialized, options, providers=[
                ("CUDAExecutionProvider", {**cuda, "enable_cuda_graph": "1"} if graph else cuda), "CPUExecutionProvider"])

        if backend.cuda_graphs and backend.static_shapes:
            try:
                self.session, self.graphs = session(True), True
            except Exception as exc:  # onnxruntime refuses graphs when a node is not on the CUDA EP
                self.graph_refused = _first_line(exc)
        if self.session is None:
            try:
                self.session = session(False)
            except Exception as exc:
                raise RunError(f"{self.where}: onnxruntime cannot load it: {_first_line(exc)}") from None
        if self.session.get_providers()[0] != "CUDAExecutionProvider":
            raise RunError(f"{self.where}: onnxruntime did not enable the CUDA execution provider (CUDA or cuDNN "
                           "libraries not found? onnxruntime-gpu must match the installed CUDA major version)")

    def _bind_input(self, io, name: str, value) -> None:
        io.bind_input(name, "cuda", self.backend.device_id, value.dtype.type, list(value.shape), value.data.ptr)

    def run(self, feeds):
        """First-call path: onnxruntime allocates the outputs; they are wrapped as CuPy arrays. Never
        captured: these buffers are not the ones later runs use."""
        if self.session is None:
            self._compile(feeds)
        io = self.session.io_binding()
        for name in self.inputs:
            self._bind_input(io, name, feeds[name])
        for name in self.outputs:
            io.bind_output(name, "cuda", self.backend.device_id)
        self._run(io, self.backend.run_options_uncaptured if self.graphs else self.backend.run_options)
        return [self.backend.wrap(v) for v in io.get_outputs()]

    def prepare(self, parity: int, outputs: dict[str, Any]) -> None:
        io = self.session.io_binding()
        for name in self.outputs:
            value = outputs[name]
            io.bind_output(name, "cuda", self.backend.device_id, value.dtype.type, list(value.shape), value.data.ptr)
        self.bindings[parity] = io

    def run_bound(self, parity: int, env: dict[str, Any]) -> None:
        io, bound = self.bindings[parity], self.bound[parity]
        changed = False
        for name in self.inputs:
            value = env[name]
            if bound.get(name) != value.data.ptr:
                self._bind_input(io, name, value)
                bound[name] = value.data.ptr
                changed = True
        if not self.graphs:
            self._run(io, self.backend.run_options)
            return
        # A captured graph replays with the pointers it was captured with. The first runs of a
        # parity still read buffers that later steps no longer use (the first call's outputs), so
        # a parity is captured only once its inputs were bound to the same buffers twice in a row.
        if self.captured[parity] and changed:
            raise RunError(f"{self.where}: an input moved to another buffer after its CUDA graph was captured")
        if changed or not self.seen[parity]:
            self.seen[parity] = True
            self._run(io, self.backend.run_options_uncaptured)
            return
        self.captured[parity] = True
        self._run(io, self.backend.run_options_graph[parity])

    def _run(self, io, run_options) -> None:
        try:
            self.session.run_with_iobinding(io, run_options)
        except Exception as exc:
            raise RunError(f"{self.where}: onnxruntime failed on device {self.backend.device_id}: {_first_line(exc)}") from None


class _Slots:
    """The flat buffer(s) of one collective and the views of its inputs and outputs in them; the
    op says where each view lies (CollectiveOp.flat_layout and flat_inputs/flat_outputs)."""

    def __init__(self, op: CollectiveOp, in_shapes: list[tuple], dtype, world: int, rank: int, parities: int, cp):
        self.op = op
        layout = op.flat_layout(in_shapes, world, rank)
        self.buffers = [cp.zeros(layout.total, dtype=dtype) for _ in range(parities)]  # zeros: the padding stays 0
        self.inputs: list[dict[str, Any]] = [op.flat_inputs(layout, buf) for buf in self.buffers]
        self.outputs: list[dict[str, Any]] = [op.flat_outputs(layout, buf) for buf in self.buffers]
        self.mean_view: list[Any] = [op.flat_mean_view(layout, buf) for buf in self.buffers]


class GpuProgram:
    """Runs a cut graph on the GPU (see the module docstring); the interface of executor.Program."""

    def __init__(self, cut: CutGraph, backend: GpuBackend, comm: Communicator):
        cp = backend.cp
        self.cut, self.backend, self.comm, self.cp = cut, backend, comm, cp
        # Segments and native groups (fused optimizer updates) have runners; collectives have none.
        self.steps = [(item, None if isinstance(item, CollectiveOp) else backend.compile(item, cut.where))
                      for item in cut.items]
        self.constants = {name: cp.asarray(value) for name, value in cut.constants.items()}
        producer: dict[str, int] = {}
        readers: dict[str, list[int]] = {}
        for pos, item in enumerate(cut.items):
            for name in item.inputs:
                readers.setdefault(name, []).append(pos)
            for name in item.outputs:
                producer[name] = pos
        self.producer, self.readers = producer, readers
        # Segment pos -> positions of the collectives whose outputs it reads directly.
        self.waits = {pos: sorted({producer[n] for n in item.inputs if n in producer and self.steps[producer[n]][1] is None})
                      for pos, (item, runner) in enumerate(self.steps) if runner is not None}
        self.collective_pos = [pos for pos, (_, runner) in enumerate(self.steps) if runner is None]
        self.ready = {pos: cp.cuda.Event(disable_timing=True) for pos in self.collective_pos}
        self.done = {pos: cp.cuda.Event(disable_timing=True) for pos in self.collective_pos}
        self.calls = 0
        self.shapes: dict[str, tuple[tuple, Any]] = {}
        self.slots: dict[int, _Slots] = {}
        self.copy_in: dict[int, list[str]] = {}
        self.outs: dict[int, list[dict[str, Any]]] = {}

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        missing = [name for name in self.cut.inputs if name not in feeds]
        if missing:
            raise RunError(f"{self.cut.where}: not fed: {', '.join(missing)}")
        self.calls += 1
        if self.calls == 1:
            return self._run_first(feeds)
        if self.calls == 2:
            self._allocate()
        return self._run_bound(feeds, self.calls % 2)

    # -- first call: onnxruntime allocates, collectives synchronous -----------------------------
    def _run_first(self, feeds):
        env = {**self.constants, **feeds}
        self.backend.compute.synchronize()  # constants and fed data are on the device before any run
        for item, runner in self.steps:
            values = [env[name] for name in item.inputs]
            if runner is not None:
                results = runner.run(dict(zip(item.inputs, values)))
            else:
                results = item.run(self.comm, values) if not self.backend.skip_collectives else item.skipped(values, self.cp)
            env.update(zip(item.outputs, results))
        self.shapes = {name: (tuple(v.shape), v.dtype) for name, v in env.items()}
        # Values onnxruntime allocated return to its arena when dropped; finish before that.
        self.backend.compute.synchronize()
        return {name: env[name] for name in self.cut.outputs}

    # -- from the second call on: preallocated, bound once, overlapped -------------------------
    def _allocate(self) -> None:
        cp, comm = self.cp, self.comm
        program_outputs = set(self.cut.outputs)
        bound_into: dict[str, tuple[int, str]] = {}  # segment output -> (collective pos, input name)
        for pos in self.collective_pos:
            op = self.steps[pos][0]
            in_shapes = [self.shapes[n][0] for n in op.inputs]
            dtypes = {np.dtype(self.shapes[n][1]) for n in op.inputs} | {np.dtype(s.dtype) for s in op.output_specs}
            if len(dtypes) != 1:
                raise RunError(f"{op.where}: the nccl backend needs one dtype per bucket, got {sorted(map(str, dtypes))}")
            parities = 2 if any(n in program_outputs for n in op.outputs) else 1
            self.slots[pos] = _Slots(op, in_shapes, dtypes.pop(), comm.size, comm.rank, parities, cp)
            self.copy_in[pos] = []
            for name in op.inputs:
                src = self.producer.get(name)
                only_reader = self.readers[name] == [pos] and op.inputs.count(name) == 1
                if src is not None and self.steps[src][1] is not None and only_reader and name not in program_outputs:
                    bound_into[name] = (pos, name)
                else:
                    self.copy_in[pos].append(name)
        internal: dict[str, Any] = {}
        for pos, (item, runner) in enumerate(self.steps):
            if runner is None:
                continue
            per_parity = []
            for parity in (0, 1):
                outs = {}
                for name in item.outputs:
                    shape, dtype = self.shapes[name]
                    if name in bound_into:
                        slots = self.slots[bound_into[name][0]]
                        outs[name] = slots.inputs[parity % len(slots.buffers)][name]
                    elif name in program_outputs:
                        outs[name] = cp.empty(shape, dtype)
                    else:
                        if name not in internal:
                            internal[name] = cp.empty(shape, dtype)
                        outs[name] = internal[name]
                runner.prepare(parity, outs)
                per_parity.append(outs)
            self.outs[pos] = per_parity

    def _run_bound(self, feeds, parity: int):
        backend, comm = self.backend, self.comm
        compute = backend.compute
        env = {**self.constants, **feeds}
        if not backend.async_runs:
            compute.synchronize()  # the fed data's copies are done before any session reads them
        waited: set[int] = set()
        for pos, (item, runner) in enumerate(self.steps):
            if runner is not None:
                for c in self.waits[pos]:
                    if c not in waited:
                        backend.wait(self.done[c])
                        waited.add(c)
                runner.run_bound(parity, env)
                if backend.debug_sync:
                    self.cp.cuda.Device().synchronize()
                env.update(self.outs[pos][parity])
                continue
            slots = self.slots[pos]
            p = parity % len(slots.buffers)
            self.ready[pos].record(compute)
            comm.stream.wait_event(self.ready[pos])
            if self.copy_in[pos]:
                with comm.stream:
                    for name in self.copy_in[pos]:
                        slots.inputs[p][name][...] = env[name]
            if not backend.skip_collectives:
                item.launch_flat(comm, slots.buffers[p], slots.mean_view[p],
                                 f"{item.op_type} '{item.name}' (order {item.order}) of {self.cut.where}")
            self.done[pos].record(comm.stream)
            if backend.debug_sync:
                self.cp.cuda.Device().synchronize()
            comm.track(pos, self.done[pos], f"{item.op_type} '{item.name}' (order {item.order}) of {self.cut.where}")
            env.update(slots.outputs[p])
        for c in self.collective_pos:
            if c not in waited:
                backend.wait(self.done[c])
        return {name: env[name] for name in self.cut.outputs}


class GpuBackend(Backend):
    """onnxruntime CUDA EP on ``device_id``; ``tf32`` lets fp32 MatMul/Conv use TF32 (off for the
    equality tests); ``skip_collectives`` enqueues no NCCL call (a measurement aid that shows the
    exposed communication time; results are wrong)."""

    name = "nccl"

    def __init__(self, device_id: int = 0, *, tf32: bool = False, skip_collectives: bool = False,
                 static_shapes: bool | None = None, cuda_graphs: bool | None = None):
        self.cp = cp = import_cupy()
        self.ort = load_onnxruntime()
        self.device_id = device_id
        self.tf32 = tf32
        self.skip_collectives = skip_collectives
        cp.cuda.Device(device_id).use()
        # A blocking stream: onnxruntime's CUDA EP copies on the legacy default stream by default
        # (do_copy_in_default_stream) and relies on that stream's implicit order with its compute stream.
        self.compute = cp.cuda.Stream(non_blocking=False)
        self.compute.use()  # CuPy's own work (copies, the loss ring) joins the compute stream
        self.run_options = self.ort.RunOptions()
        # Fully asynchronous runs (onnxruntime returns before its kernels finish) are opt-in: on the
        # 4x H200 check they gave wrong results on 2 and 4 GPUs (correct on 1), so some onnxruntime
        # work is not ordered by the user compute stream there. Synchronized runs still overlap
        # each bucket's NCCL call (comm stream) with the next segments; the host only stops
        # running ahead of the GPU. docs/gpu.md.
        self.async_runs = os.environ.get("GRAPH_TRANSPILER_ORT_ASYNC") == "1"
        # Debugging aid: synchronize the whole device after every segment and collective, which
        # rules out any stream-ordering race (slow; never on by default).
        self.debug_sync = os.environ.get("GRAPH_TRANSPILER_DEBUG_SYNC") == "1"
        if self.async_runs:
            self.run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        # Segments specialized to their first call's shapes, and replayed as CUDA graphs (see
        # OrtCudaSegment); GRAPH_TRANSPILER_STATIC_SHAPES=0 / GRAPH_TRANSPILER_CUDA_GRAPHS=0 turn them off.
        env_flag = lambda name: os.environ.get(name, "1") != "0"  # noqa: E731
        self.static_shapes = env_flag("GRAPH_TRANSPILER_STATIC_SHAPES") if static_shapes is None else static_shapes
        self.cuda_graphs = env_flag("GRAPH_TRANSPILER_CUDA_GRAPHS") if cuda_graphs is None else cuda_graphs
        self.shrink_arena = env_flag("GRAPH_TRANSPILER_SHRINK_ARENA")
        self.run_options_uncaptured = self._run_options(graph_id=-1)
        self.run_options_graph = [self._run_options(graph_id=parity) for parity in (0, 1)]
        # The fused optimizer updates run as multi-tensor CuPy kernels (runtime/gpu/fused_update.py);
        # GRAPH_TRANSPILER_FUSED_UPDATE=0 leaves them to onnxruntime (their function bodies), to compare.
        if os.environ.get("GRAPH_TRANSPILER_FUSED_UPDATE", "1") != "0":
            self.native_domains = frozenset({FUSED_UPDATE_DOMAIN})
        self._staging: dict[str, tuple[Any, np.ndarray, Any]] = {}
        self._ring = cp.zeros(LOSS_RING, dtype=np.float64)
        self._ring_next = 0

    def _run_options(self, *, graph_id: int):
        """Run options for a CUDA-graph session: which captured graph a run uses (-1: none).
        A replay only enqueues work on the compute stream, so it never needs onnxruntime's
        synchronization after the run."""
        options = self.ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", str(graph_id))
        if self.async_runs or graph_id >= 0:
            options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        if graph_id < 0 and self.shrink_arena:
            # The first runs hold buffers no later step uses (the first call's outputs, then the
            # warm-up runs' intermediates); giving the arena's free chunks back after each keeps
            # them out of the steady state. Never on a captured run: its graph owns its chunks.
            options.add_run_config_entry("memory.enable_memory_arena_shrinkage", f"gpu:{self.device_id}")
        return options

    def wait(self, event) -> None:
        """Order onnxruntime's next work after ``event`` (a collective's completion). Async runs:
        the compute stream waits for it. Otherwise the host does, which orders onnxruntime's work
        whichever stream it really uses."""
        if self.async_runs:
            self.compute.wait_event(event)
        else:
            event.synchronize()

    def compile(self, segment, where):
        if isinstance(segment, NativeGroup):
            return FusedUpdateRunner(segment, where, self)
        return OrtCudaSegment(segment, where, self)

    def make_program(self, cut, comm):
        return GpuProgram(cut, self, comm)

    def split_tail(self) -> bool:
        return True

    def wrap(self, ortvalue):
        """A CuPy view of an onnxruntime output on this device; keeps the OrtValue alive."""
        cp = self.cp
        shape = tuple(ortvalue.shape())
        dtype = np.dtype(ORT_DTYPES[ortvalue.data_type()])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return cp.empty(shape, dtype)
        memory = cp.cuda.UnownedMemory(ortvalue.data_ptr(), nbytes, ortvalue, self.device_id)
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, 0))

    def from_host(self, array):
        return self.cp.asarray(array)

    def to_host(self, value):
        if isinstance(value, np.ndarray):
            return value
        return self.cp.asnumpy(value, stream=self.compute)

    def feed(self, name: str, array: np.ndarray):
        """``array`` in this input's persistent device buffer: an async copy from pinned memory on
        the compute stream, so the bound pointer never changes and the host never waits for it,
        except to reuse the pinned buffer while the GPU is a whole step behind."""
        cp = self.cp
        array = np.ascontiguousarray(array)
        staged = self._staging.get(name)
        if staged is None or staged[1].shape != array.shape or staged[1].dtype != array.dtype:
            memory = cp.cuda.alloc_pinned_memory(max(array.nbytes, 1))
            host = np.frombuffer(memory, array.dtype, array.size).reshape(array.shape)
            staged = (cp.empty(array.shape, array.dtype), host, None)
        device, host, copied = staged
        if copied is not None:
            copied.synchronize()
        host[...] = array
        device.set(host, stream=self.compute)
        self._staging[name] = (device, host, self.compute.record())
        return device

    def hold_scalar(self, value):
        slot = self._ring_next % LOSS_RING
        self._ring_next += 1
        self._ring[slot:slot + 1] = value.reshape(1)
        return slot

    def scalars_to_host(self, held: list) -> list[float]:
        if not held:
            return []
        host = self.cp.asnumpy(self._ring, stream=self.compute)  # one transfer, at log time only
        return [float(host[slot]) for slot in held]
