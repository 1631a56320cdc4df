"""OrtCudaSegment: one compute segment as an onnxruntime CUDA EP session, on the backend's compute
stream, bound to device buffers (one IOBinding per step parity) and replayed as a CUDA graph where
onnxruntime allows it. GpuProgram (program.py) decides which buffers; docs/gpu.md.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING, Any

import onnx
import onnx.inliner

from runtime import ort_custom_ops
from runtime.errors import RunError
from runtime.executor import SegmentRunner, _first_line
from runtime.gpu.cuda import ORT_DTYPES
from runtime.gpu.in_session import DOMAIN as IN_SESSION_DOMAIN
from runtime.gpu.in_session import take_native_nodes
from runtime.gpu.lowering import lower_for_cuda
from runtime.segments import Segment, place
from runtime.specialize import NEVER_FOLDED, specialize

if TYPE_CHECKING:
    from runtime.gpu.backend import GpuBackend

# Buffers onnxruntime allocates itself start at a multiple of 256 bytes (cudaMalloc, its arena),
# and some kernels it picks need at least 16: cuDNN's Conv refuses a weight that is not
# (CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER). A collective's outputs are views where its bucket's
# layout puts them; the contract's packed layout of ReduceScatter/AllGather buckets (ZeRO) can put
# a tensor at any element. Such an input is copied into a buffer of its own before a run (and
# GpuProgram binds no output into a bucket slot that is misaligned).
ALIGN_BYTES = 16


def misaligned(value) -> bool:
    """Whether a device array starts off the alignment onnxruntime's kernels may need."""
    return value.data.ptr % ALIGN_BYTES != 0


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
        self.where = f"{where}: {place(segment)}"
        self.inputs = list(segment.inputs)
        self.outputs = list(segment.outputs)
        self.session = None
        self.session_inputs: list[str] = []
        self.output_specs: dict[str, tuple] = {}
        self.compiled = False
        self.custom_ops: list = []  # native nodes run inside the session (in_session.py)
        self.constants: dict[str, Any] = {}  # outputs computed once from constants (see _take_fixed_outputs)
        self.copies: dict[str, str] = {}  # outputs that copy an input: output -> input
        self.copy_into: list[list] = [[], []]  # per parity: (bound output buffer, input name)
        self.graphs = False  # whether runs from the second call on are CUDA graph replays
        self.graph_refused: str | None = None
        # Set by the program: capture only where no collective runs beside the capture (see GpuProgram).
        self.capture_allowed = True
        # Set by the backend: allocate from the arena the program's sessions share (never shrunk).
        self.shared_arena = False
        # Set by the backend: onnxruntime's memory pattern stays off (where the arena is shared),
        # else it is the backend's setting.
        self.mem_pattern = True
        self.bindings: list[Any] = [None, None]  # per parity, once the output buffers exist
        self.bound: list[dict[str, int]] = [{}, {}]  # per parity: input name -> bound pointer
        self.seen = [False, False]  # per parity: bound runs made with the current pointers
        self.captured = [False, False]  # per parity: whether its graph is captured (pointers frozen)
        # Aligned copies of misaligned inputs (see ALIGN_BYTES), one per input for every call and
        # parity: each is refilled on the compute stream right before the run that reads it, so
        # its pointer stays fixed for bindings and captured graphs.
        self.realigned: dict[str, Any] = {}

    def _compile(self, feeds) -> None:
        backend, ort = self.backend, self.backend.ort
        model = self.segment.model
        inside = backend.in_session_domains
        if backend.static_shapes:
            if model.functions:
                # Nodes of a domain left to onnxruntime (a native runner switched off) run as their
                # functions; inlined here, their channel reductions are split like the others. Those
                # of domains run inside the session keep theirs, for shape inference (and to run
                # as functions where a node cannot be taken in, in_session.py).
                kept = [(f.domain, f.name) for f in model.functions if f.domain in inside]
                model = (onnx.inliner.inline_selected_functions(model, kept, exclude=True) if kept
                         else onnx.inliner.inline_local_functions(model))
            model = lower_for_cuda(specialize(model, {name: tuple(feeds[name].shape) for name in self.inputs}))
            model = self._take_fixed_outputs(model, ort)
            if not model.graph.output:
                return  # every output is a constant or a copy of an input: no session
            if inside:
                segment = self.segment
                model, self.custom_ops = take_native_nodes(model, inside, backend, self.where,
                                                           (segment.index, segment.part, segment.stage))
        serialized = model.SerializeToString()
        cuda = {"device_id": str(backend.device_id), "user_compute_stream": str(backend.compute.ptr),
                "has_user_compute_stream": "1", "use_tf32": "1" if backend.tf32 else "0",
                # Grow the arena by what is asked, not to the next power of two: a training step
                # allocates a few large activations, and doubling can reserve up to twice what it uses.
                "arena_extend_strategy": "kSameAsRequested",
                # cuDNN's heuristic choice of Conv algorithms: on ResNet-18 (one H200) onnxruntime's
                # default timed search (EXHAUSTIVE, with the largest workspaces allowed) gave
                # 13.29-13.32 ms and 2.90 GiB, the heuristics 13.05-13.17 ms and 2.80 GiB (runs
                # h200-s18*). A user's GRAPH_TRANSPILER_CUDA_EP_OPTIONS may set it back.
                "cudnn_conv_algo_search": "HEURISTIC", **backend.provider_options}

        def session(graph: bool):
            options = ort.SessionOptions()
            options.log_severity_level = 3
            options.enable_mem_pattern = backend.mem_pattern and self.mem_pattern
            if self.shared_arena:
                options.add_session_config_entry("session.use_env_allocators", "1")
            if self.custom_ops:
                ort_custom_ops.register(options, IN_SESSION_DOMAIN, self.custom_ops)
            if backend.dump_optimized:
                options.optimized_model_filepath = os.path.join(backend.dump_optimized, re.sub(r"\W+", "_", self.where) + ".onnx")
            return ort.InferenceSession(serialized, options, providers=[
                ("CUDAExecutionProvider", {**cuda, "enable_cuda_graph": "1"} if graph else cuda), "CPUExecutionProvider"],
                disabled_optimizers=[] if backend.ort_constant_folding else ["ConstantFolding"])

        if backend.cuda_graphs and backend.static_shapes and self.capture_allowed:
            try:
                self.session, self.graphs = session(True), True
            except Exception as exc:  # onnxruntime refuses graphs when a node is not on the CUDA EP
                self.graph_refused = _first_line(exc)
                # Said once per session: an uncaptured session costs its step host time (and, on
                # several ranks, the synchronization at its end).
                print(f"transpile: warning: {self.where}: no CUDA graph ({self.graph_refused})", file=sys.stderr, flush=True)
        if self.session is None:
            try:
                self.session = session(False)
            except Exception as exc:
                raise RunError(f"{self.where}: onnxruntime cannot load it: {_first_line(exc)}") from None
        self.session_inputs = [i.name for i in self.session.get_inputs()]
        # (shape, dtype) of each output the session states statically (specialized: all of them).
        self.output_specs = {o.name: (tuple(o.shape), ORT_DTYPES[o.type]) for o in self.session.get_outputs()
                             if o.type in ORT_DTYPES and all(isinstance(d, int) for d in o.shape)}
        if self.session.get_providers()[0] != "CUDAExecutionProvider":
            raise RunError(f"{self.where}: onnxruntime did not enable the CUDA execution provider (CUDA or cuDNN "
                           "libraries not found? onnxruntime-gpu must match the installed CUDA major version)")

    def _take_fixed_outputs(self, model, ort):
        """Outputs onnxruntime would not compute on the stream take no part in the session: a
        value computable from constants alone (onnxruntime folds it into an initializer) and an
        Identity of an input (it removes the Identity). It copies such an output into its bound
        buffer with a blocking cudaMemcpy when a run starts, which is illegal while a CUDA graph is
        captured (CUDA error 906, "operation would make the legacy stream depend on a capturing
        blocking stream"). Segments cut finely (elementwise fusion) pass constants and copies
        between them; here a constant is computed once on the host and written into its buffers
        once, and a copy is a device copy on the compute stream each step."""
        graph = model.graph
        known = {t.name for t in graph.initializer}
        inputs = {i.name for i in graph.input}
        source: dict[str, str] = {}  # Identity output -> the graph input it copies
        for node in graph.node:
            ins = [n for n in node.input if n]
            if node.op_type == "Identity" and node.domain in ("", "ai.onnx") and ins:
                if ins[0] in inputs or ins[0] in source:
                    source[node.output[0]] = source.get(ins[0], ins[0])
            if node.domain in ("", "ai.onnx") and node.op_type not in NEVER_FOLDED and all(n in known for n in ins):
                known.update(o for o in node.output if o)
        constant = [o.name for o in graph.output if o.name in known]
        self.copies = {o.name: source[o.name] for o in graph.output if o.name in source and o.name not in known}
        self.constants = {}
        if constant:
            # A model of the constant nodes alone (no graph inputs), evaluated once on the host.
            nodes = [n for n in graph.node if n.output and all(o in known for o in n.output if o)]
            fold = onnx.helper.make_graph(nodes, "constants", [], [onnx.helper.make_empty_tensor_value_info(n) for n in constant],
                                          list(graph.initializer))
            fold_model = onnx.helper.make_model(fold, opset_imports=model.opset_import, ir_version=model.ir_version,
                                                functions=model.functions)
            options = ort.SessionOptions()
            options.log_severity_level = 3
            values = ort.InferenceSession(fold_model.SerializeToString(), options,
                                          providers=["CPUExecutionProvider"]).run(constant, {})
            self.constants = {name: self.backend.from_host(value) for name, value in zip(constant, values)}
        if not constant and not self.copies:
            return model
        fixed = set(constant) | set(self.copies)
        kept = [o for o in graph.output if o.name not in fixed]
        del graph.output[:]
        graph.output.extend(kept)
        return model

    def _fixed_values(self, feeds) -> dict:
        values = dict(self.constants)
        values.update({name: feeds[src].copy() for name, src in self.copies.items()})
        return values

    def _bind_input(self, io, name: str, value) -> None:
        io.bind_input(name, "cuda", self.backend.device_id, value.dtype.type, list(value.shape), value.data.ptr)

    def _aligned(self, name: str, value):
        """``value``, or where it is misaligned its copy in ``self.realigned[name]``."""
        if not misaligned(value):
            return value
        return self._realign(name, value)

    def _realign(self, name: str, value):
        copy = self.realigned.get(name)
        if copy is None or copy.shape != value.shape or copy.dtype != value.dtype:
            copy = self.realigned[name] = self.backend.cp.empty(value.shape, dtype=value.dtype)
        copy[...] = value
        return copy

    def run(self, feeds):
        """First-call path: outputs whose shape the specialized session states are allocated by
        CuPy and bound (the rest onnxruntime allocates, wrapped as CuPy arrays). Never captured:
        these buffers are not the ones later runs use. CuPy's pool, not onnxruntime's arena, then
        holds what passes between items in the first call: the program allocates the same kind of
        values from that pool from the second call on, and a shared arena never gives memory back
        (GpuBackend.make_program)."""
        if not self.compiled:
            self._compile(feeds)
            self.compiled = True
        fixed = self._fixed_values(feeds)
        if self.session is None:
            return [fixed[name] for name in self.outputs]
        io = self.session.io_binding()
        for name in self.session_inputs:
            self._bind_input(io, name, self._aligned(name, feeds[name]))
        computed = [name for name in self.outputs if name not in fixed]
        allocated = {}
        for name in computed:
            spec = self.output_specs.get(name)
            if spec is None:
                io.bind_output(name, "cuda", self.backend.device_id)
                continue
            value = allocated[name] = self.backend.cp.empty(*spec)
            io.bind_output(name, "cuda", self.backend.device_id, value.dtype.type, list(value.shape), value.data.ptr)
        self._run(io, self._uncaptured())
        # get_outputs lists every bound output in binding order, preallocated ones included.
        for name, value in zip(computed, io.get_outputs()):
            fixed[name] = allocated[name] if name in allocated else self.backend.wrap(value)
        return [fixed[name] for name in self.outputs]

    def written_once(self) -> set[str]:
        """Outputs ``prepare`` fills and no run writes again (constants): their buffers must be theirs alone."""
        return set(self.constants)

    def prepare(self, parity: int, outputs: dict[str, Any]) -> None:
        for name, value in self.constants.items():
            outputs[name][...] = value  # once: nothing writes these buffers again
        self.copy_into[parity] = [(outputs[name], src) for name, src in self.copies.items()]
        if self.session is None:
            return
        io = self.session.io_binding()
        for name in self.outputs:
            if name in self.constants or name in self.copies:
                continue
            value = outputs[name]
            io.bind_output(name, "cuda", self.backend.device_id, value.dtype.type, list(value.shape), value.data.ptr)
        self.bindings[parity] = io

    def run_bound(self, parity: int, env: dict[str, Any]) -> None:
        for buffer, src in self.copy_into[parity]:
            buffer[...] = env[src]  # on the current (compute) stream, in order with the sessions
        if self.session is None:
            return
        io, bound = self.bindings[parity], self.bound[parity]
        changed = False
        for name in self.session_inputs:  # every step: the pointer is read once per input
            value = env[name]
            ptr = value.data.ptr
            if ptr % ALIGN_BYTES:
                value = self._realign(name, value)
                ptr = value.data.ptr
            if bound.get(name) != ptr:
                self._bind_input(io, name, value)
                bound[name] = ptr
                changed = True
        if not self.graphs:
            # The first bound run of each parity gives the arena's free chunks back (the first
            # call's outputs, which onnxruntime allocated and the program no longer reads); later
            # runs keep what they use. Uncaptured sessions (GRAPH_TRANSPILER_CUDA_GRAPHS=0 or
            # GRAPH_TRANSPILER_MULTIRANK_GRAPHS=0) otherwise kept their first call's outputs for good.
            warm = self.seen[parity]
            self.seen[parity] = True
            self._run(io, self.backend.run_options if warm else self._uncaptured())
            return
        # A captured graph replays with the pointers it was captured with. The first runs of a
        # parity still read buffers that later steps no longer use (the first call's outputs), so
        # a parity is captured only once its inputs were bound to the same buffers twice in a row.
        if self.captured[parity] and changed:
            raise RunError(f"{self.where}: an input moved to another buffer after its CUDA graph was captured")
        if changed or not self.seen[parity]:
            self.seen[parity] = True
            self._run(io, self._uncaptured())
            return
        self.captured[parity] = True
        self._run(io, self.backend.run_options_graph[parity])

    def _uncaptured(self):
        """Run options of an uncaptured run: the arena shrinks after it, unless it is shared."""
        return self.backend.run_options if self.shared_arena else self.backend.run_options_uncaptured

    def _run(self, io, run_options) -> None:
        try:
            self.session.run_with_iobinding(io, run_options)
        except Exception as exc:
            raise RunError(f"{self.where}: onnxruntime failed on device {self.backend.device_id}: {_first_line(exc)}") from None
