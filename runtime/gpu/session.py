"""OrtCudaSegment: one compute segment as an onnxruntime CUDA EP session, on the device's compute
stream, bound to device buffers (one IOBinding per step parity) and replayed as a CUDA graph where
onnxruntime allows it. What every session of a backend shares is its SessionPolicy. GpuProgram
(program.py) decides which buffers; docs/gpu.md.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import onnx

from runtime import ort_custom_ops
from runtime.collectives import COLLECTIVE_DOMAIN
from runtime.errors import RunError
from runtime.executor import SegmentRunner, _first_line
from runtime.gpu.compile import SegmentPass, compile_segment
from runtime.gpu.cuda import ORT_DTYPES
from runtime.gpu.device import GpuDevice
from runtime.gpu.in_session import DOMAIN as IN_SESSION_DOMAIN
from runtime.gpu.in_session import capture_call
from runtime.gpu.lowering import widen_bfloat16
from runtime.gpu.session_collectives import FINISH, START
from runtime.segments import Segment, place

# onnxruntime's refusal of a node no provider registered a kernel for (its op type in group 1).
_UNPLACED = re.compile(r"Provider type for (\w+) node")

# Buffers onnxruntime allocates itself start at a multiple of 256 bytes (cudaMalloc, its arena),
# and some kernels it picks need at least 16: cuDNN's Conv refuses a weight that is not
# (CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER). A collective's outputs are views where its bucket's
# layout puts them; the contract's packed layout of ReduceScatter/AllGather buckets (ZeRO) can put
# a tensor at any element. Such an input is copied into a buffer of its own before a run (and
# GpuProgram binds no output into a bucket slot that is misaligned).
ALIGN_BYTES = 16
# The op names TakeNativeNodes gives taken start and finish nodes (their op_type and a number).
COLLECTIVE_OP_PREFIXES = (f"{START}_", f"{FINISH}_")


# The run of a step parity at which a session's CUDA graph is captured at the earliest (run_bound).
FIRST_CAPTURED_RUN = 3
# The shared arena splits a chunk that would leave more than this idle (SessionPolicy.share_arena).
ARENA_MAX_DEAD_BYTES = 1 << 20


def agree_on_graphs(steps: list, comm, where: str) -> None:
    """The sessions among ``steps`` (a program's items and runners) that hold collectives are captured
    as CUDA graphs on every rank or on none: NCCL asks every rank to capture the same calls, and
    whether a session may be captured is decided by each rank (onnxruntime may refuse a graph; the
    watchdog's capture mode). Those sessions are the same on every rank (segments.py). One host
    all-reduce; every rank calls it at the same call of the program, before any capture."""
    holding = [runner for item, runner in steps if isinstance(runner, OrtCudaSegment)
               and any(n.domain == COLLECTIVE_DOMAIN for n in item.model.graph.node)]
    refused = [r for r in holding if r.session is not None and not r.graphs]
    if comm.allreduce_scalars([float(len(refused))], "sum")[0] == 0:
        return
    captured = [r for r in holding if r.graphs]
    for runner in captured:
        runner.graphs = False
    if captured:
        print(f"transpile: warning: {where}: no CUDA graphs for the {len(captured)} session(s) holding collectives: "
              "another rank's could not be captured, and every rank must capture the same NCCL calls",
              file=sys.stderr, flush=True)


def misaligned(value) -> bool:
    """Whether a device array starts off the alignment onnxruntime's kernels may need."""
    return value.data.ptr % ALIGN_BYTES != 0


class SessionPolicy:
    """How every session of one backend is made and run: the CUDA EP's options, the compile passes,
    the native domains run inside, the run options, the optional dump of optimized graphs."""

    def __init__(self, device: GpuDevice, *, passes: list[SegmentPass], inside: frozenset[str],
                 ep_options: dict[str, str] | None = None, dump: str = ""):
        self.device, self.ort = device, device.ort
        self.passes, self.inside, self.dump = passes, inside, dump
        # ep_options: the user's --ep-option entries, checked by runtime/config.py (which keeps
        # the options the runtime owns: the device, the stream, CUDA graphs).
        ep_options = dict(ep_options or {})
        self.cuda = {"device_id": str(device.device_id), "user_compute_stream": str(device.compute.ptr),
                     "has_user_compute_stream": "1", "use_tf32": "1" if device.tf32 else "0",
                     # Grow the arena by what is asked, not to the next power of two: a training step
                     # allocates a few large activations, and doubling can reserve up to twice what it uses.
                     "arena_extend_strategy": "kSameAsRequested",
                     # cuDNN's heuristic choice of Conv algorithms: on ResNet-18 (one H200) onnxruntime's
                     # default timed search (EXHAUSTIVE, with the largest workspaces allowed) gave
                     # 13.29-13.32 ms and 2.90 GiB, the heuristics 13.05-13.17 ms and 2.80 GiB (runs
                     # h200-s18*). --ep-option cudnn_conv_algo_search=EXHAUSTIVE sets it back.
                     "cudnn_conv_algo_search": "HEURISTIC", **ep_options}
        self.arena_shared = False
        # Whether a session on the shared arena has captured a CUDA graph: from then on that arena
        # is never shrunk (its free chunks are where the graphs replay their intermediates).
        self.shared_captured = False
        # Uncaptured runs: the first runs of a session give its arena's free chunks back (the first
        # call's outputs, then the warm-up runs' intermediates, which no later step uses); later
        # ones, and every run of a session on the shared arena, do not. A replay only enqueues work
        # on the compute stream, so it never needs onnxruntime's synchronization after the run.
        self.run_first = self._run_options(-1, shrink=True)
        self.run_later = self._run_options(-1)
        self.run_graph = [self._run_options(parity) for parity in (0, 1)]

    def _run_options(self, graph_id: int, *, shrink: bool = False):
        options = self.ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", str(graph_id))
        if graph_id >= 0:
            options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        if shrink:  # never on a captured run: its graph owns its chunks
            options.add_run_config_entry("memory.enable_memory_arena_shrinkage", f"gpu:{self.device.device_id}")
        return options

    def share_arena(self) -> None:
        """Register one CUDA arena for this device with onnxruntime's (process-wide) environment,
        once; sessions opt in with ``session.use_env_allocators``. It lives as long as the process
        (onnxruntime has no call to unregister it) and is shrunk only until the first capture on it
        (``_uncaptured``)."""
        if self.arena_shared:
            return
        ort, device_id = self.ort, self.device.device_id
        info = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, device_id, ort.OrtMemType.DEFAULT)
        options = {"device_id": str(device_id)}
        if "gpu_mem_limit" in self.cuda:  # a user's cap (--ep-option) holds for it too
            options["gpu_mem_limit"] = self.cuda["gpu_mem_limit"]
        # arena_extend_strategy 1 (kSameAsRequested): grow by what is asked, as the sessions' own arenas do.
        # max_dead_bytes_per_chunk: onnxruntime's arena hands a request a whole free chunk up to twice
        # its size unless more than this (128 MiB by default) would lie idle in it, so a step's
        # second run took chunks the first had cut for larger values and grew the arena for those.
        # Cut at 1 MiB: GPT-2-small bf16 5.56 -> 5.50 GiB, ResNet-18 bf16 1.26 -> 1.20 with the same
        # algorithms (one H200, runs h200-s58, h200-s59; 0 makes onnxruntime 1.31 abort: "Could not
        # find Region").
        ort.create_and_register_allocator_v2("CUDAExecutionProvider", info, options, ort.OrtArenaCfg(
            {"arena_extend_strategy": 1, "max_dead_bytes_per_chunk": ARENA_MAX_DEAD_BYTES}))
        self.arena_shared = True

    def session(self, serialized: bytes, where: str, *, graph: bool, shared_arena: bool, custom_ops: list):
        ort = self.ort
        options = ort.SessionOptions()
        options.log_severity_level = 3
        # onnxruntime's memory pattern (one block per session sized by its plan) stays off on the
        # shared arena, where a session's intermediates are chunks the next session reuses:
        # ResNet-18 on one H200 3.09 -> 2.90 GiB, its step 13.31 -> 13.12 ms (run h200-s17).
        options.enable_mem_pattern = not shared_arena
        if shared_arena:
            options.add_session_config_entry("session.use_env_allocators", "1")
        if custom_ops:
            ort_custom_ops.register(options, IN_SESSION_DOMAIN, custom_ops)
        if any(op.name.startswith(COLLECTIVE_OP_PREFIXES) for op in custom_ops):
            # session_collectives.py: onnxruntime's priority order follows the node
            # order, where each start is placed right after its bucket's last gradient.
            options.execution_order = self.ort.ExecutionOrder.PRIORITY_BASED
        if self.dump:
            options.optimized_model_filepath = os.path.join(self.dump, re.sub(r"\W+", "_", where) + ".onnx")
        # onnxruntime's constant folding stays off: specialization and the lowering fold what is
        # cheap to keep, and onnxruntime's would also turn a large zero fill (the token embedding's
        # gradient starts from [50304, 768] zeros) into a 147 MiB initializer held for good, where the
        # device fills it in a few microseconds each step (GPT-2-small, one H200: 9.03 -> 8.88 GiB,
        # same step; run h200-s8-g6).
        return ort.InferenceSession(serialized, options, providers=[
            ("CUDAExecutionProvider", {**self.cuda, "enable_cuda_graph": "1"} if graph else self.cuda), "CPUExecutionProvider"],
            disabled_optimizers=["ConstantFolding"])


class _Released:
    """What a released segment (OrtCudaSegment.release) holds in place of its session and its
    bindings: any use is an error."""

    def __init__(self, where: str):
        self.where = where

    def __getattr__(self, name: str):
        raise RunError(f"{self.where}: run after its communicator was closed (the session is released)")


class OrtCudaSegment(SegmentRunner):
    """One segment as a CUDA EP session on the device's compute stream.

    The session is made on the first call, when the shapes of the segment's inputs are known: the
    segment is compiled for them (compile.py: specialized, so no shape computation is left to run
    on the host), and onnxruntime captures each step parity's run as a CUDA graph (``gpu_graph_id``
    = parity) and replays it: a step launches one graph per segment instead of one kernel per node.
    A graph needs every node on the CUDA EP and the same buffers on every replay, which the parity
    bindings give (GpuProgram); a segment that onnxruntime will not capture, or that the program
    does not let capture (``capture_allowed``), runs uncaptured, and ``graph_refused`` says why.
    """

    def __init__(self, segment: Segment, where: str, policy: SessionPolicy):
        self.policy = policy
        self.device = policy.device
        self.segment = segment
        self.where = f"{where}: {place(segment)}"
        self.inputs = list(segment.inputs)
        self.outputs = list(segment.outputs)
        self.session = None
        self.session_inputs: list[str] = []
        self.output_specs: dict[str, tuple] = {}
        self.compiled = False
        self.custom_ops: list = []  # native nodes run inside the session (in_session.py)
        self.constants: dict[str, Any] = {}  # outputs computed once from constants (compile.FixedOutputs)
        self.copies: dict[str, str] = {}  # outputs that copy an input: output -> input
        self.copy_into: list[list] = [[], []]  # per parity: (bound output buffer, input name)
        self.graphs = False  # whether runs from the second call on are CUDA graph replays
        self.graph_refused: str | None = None
        # Set by the program: capture only where no collective runs beside the capture (see GpuProgram).
        self.capture_allowed = True
        # Set by the backend: allocate from the arena every session shares (SessionPolicy.share_arena).
        self.shared_arena = False
        # Set by the program: inputs and outputs that cross as bfloat16 (buffers.bfloat16_edges).
        self.bfloat16_edges: frozenset[str] = frozenset()
        self.bfloat16: set[str] = set()  # the session's bfloat16 inputs and outputs: bound by their ONNX type
        self.bindings: list[Any] = [None, None]  # per parity, once the output buffers exist
        self.bound: list[dict[str, int]] = [{}, {}]  # per parity: input name -> bound pointer
        self.seen = [False, False]  # per parity: bound runs made with the current pointers
        self.runs = [0, 0]  # per parity: bound runs made
        self.captured = [False, False]  # per parity: whether its graph is captured (pointers frozen)
        # Aligned copies of misaligned inputs (see ALIGN_BYTES), one per input for every call and
        # parity: each is refilled on the compute stream right before the run that reads it, so
        # its pointer stays fixed for bindings and captured graphs.
        self.realigned: dict[str, Any] = {}

    def _compile(self, feeds) -> None:
        policy = self.policy
        compiled = compile_segment(self.segment, {name: tuple(feeds[name].shape) for name in self.inputs}, self.where,
                                   policy.passes, policy.inside, self.bfloat16_edges)
        self.constants = {name: self.device.from_host(value) for name, value in compiled.constants.items()}
        self.copies = compiled.copies
        self.custom_ops = compiled.custom_ops
        if not compiled.model.graph.output:
            return  # every output is a constant or a copy of an input: no session
        model = compiled.model
        while not self._load(model.SerializeToString()):
            # A bfloat16 node no provider has a kernel for (lowering.NO_BF16_KERNEL lists those
            # known): computed in float32 between casts, said once, and the session made again.
            op = _UNPLACED.search(self.load_error).group(1)
            before = len(model.graph.node)
            if len(widen_bfloat16(model, frozenset({op})).graph.node) == before:
                raise RunError(f"{self.where}: onnxruntime cannot load it: {self.load_error}")
            print(f"transpile: note: {self.where}: onnxruntime has no bfloat16 CUDA kernel for {op}: it computes in "
                  "float32", file=sys.stderr, flush=True)
        self.session_inputs = [i.name for i in self.session.get_inputs()]
        self.bfloat16 = {v.name for v in [*self.session.get_inputs(), *self.session.get_outputs()]
                         if v.type == "tensor(bfloat16)"}
        # (shape, dtype) of each output the session states statically (specialized: all of them).
        self.output_specs = {o.name: (tuple(o.shape), ORT_DTYPES[o.type]) for o in self.session.get_outputs()
                             if o.type in ORT_DTYPES and all(isinstance(d, int) for d in o.shape)}
        if self.session.get_providers()[0] != "CUDAExecutionProvider":
            raise RunError(f"{self.where}: onnxruntime did not enable the CUDA execution provider (CUDA or cuDNN "
                           "libraries not found? onnxruntime-gpu must match the installed CUDA major version)")

    def _load(self, serialized: bytes) -> bool:
        """Make the session (captured where allowed); False where onnxruntime placed a node on no
        provider (``self.load_error`` says which), a RunError for any other refusal."""
        policy = self.policy

        def session(graph: bool):
            return policy.session(serialized, self.where, graph=graph, shared_arena=self.shared_arena,
                                  custom_ops=self.custom_ops)

        if self.capture_allowed:
            try:
                self.session, self.graphs = session(True), True
                return True
            except Exception as exc:  # onnxruntime refuses graphs when a node is not on the CUDA EP
                if _UNPLACED.search(_first_line(exc)):  # not about graphs: no session loads it
                    self.load_error = _first_line(exc)
                    return False
                self.graph_refused = _first_line(exc)
                # Said once per session: an uncaptured session costs its step host time (and, on
                # several ranks, the synchronization at its end).
                print(f"transpile: warning: {self.where}: no CUDA graph ({self.graph_refused})", file=sys.stderr, flush=True)
        try:
            self.session = session(False)
            return True
        except Exception as exc:
            self.load_error = _first_line(exc)
            if _UNPLACED.search(self.load_error):
                return False
            raise RunError(f"{self.where}: onnxruntime cannot load it: {self.load_error}") from None

    def _fixed_values(self, feeds) -> dict:
        values = dict(self.constants)
        values.update({name: feeds[src].copy() for name, src in self.copies.items()})
        return values

    def _element_type(self, name: str, value):
        """What a binding of ``value`` states as its type: its NumPy type, or for a bfloat16 value
        (raw bits in a uint16 array) the ONNX element type, which onnxruntime takes as well."""
        return onnx.TensorProto.BFLOAT16 if name in self.bfloat16 else value.dtype.type

    def _bind_input(self, io, name: str, value) -> None:
        io.bind_input(name, "cuda", self.device.device_id, self._element_type(name, value), list(value.shape),
                      value.data.ptr)

    def _bind_output(self, io, name: str, value) -> None:
        io.bind_output(name, "cuda", self.device.device_id, self._element_type(name, value), list(value.shape),
                       value.data.ptr)

    def _aligned(self, name: str, value):
        """``value``, or where it is misaligned its copy in ``self.realigned[name]``."""
        if not misaligned(value):
            return value
        return self._realign(name, value)

    def _realign(self, name: str, value):
        copy = self.realigned.get(name)
        if copy is None or copy.shape != value.shape or copy.dtype != value.dtype:
            copy = self.realigned[name] = self.device.cp.empty(value.shape, dtype=value.dtype)
        copy[...] = value
        return copy

    def ensure_compiled(self, feeds) -> None:
        """The session, made for the shapes of ``feeds`` on the first call."""
        if not self.compiled:
            self._compile(feeds)
            self.compiled = True

    def run(self, feeds):
        """First-call path: outputs whose shape the specialized session states are allocated by
        CuPy and bound (the rest onnxruntime allocates, wrapped as CuPy arrays). Never captured:
        these buffers are not the ones later runs use. CuPy's pool, not onnxruntime's arena, then
        holds what passes between items in the first call: the program allocates the same kind of
        values from that pool from the second call on, and a shared arena never gives memory back
        (GpuBackend.make_program)."""
        self.ensure_compiled(feeds)
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
                io.bind_output(name, "cuda", self.device.device_id)
                continue
            value = allocated[name] = self.device.cp.empty(*spec)
            self._bind_output(io, name, value)
        self._run(io, self._uncaptured())
        # get_outputs lists every bound output in binding order, preallocated ones included.
        for name, value in zip(computed, io.get_outputs()):
            fixed[name] = allocated[name] if name in allocated else self.device.wrap(value)
        return [fixed[name] for name in self.outputs]

    def release(self) -> None:
        # Not None: a segment whose session is None has only constant outputs, and would run on
        # silently. An IOBinding holds its session, so the bindings go too.
        released = _Released(self.where)
        self.session, self.bindings = released, [released, released]

    def in_place_pairs(self) -> dict[str, str]:
        """Outputs a native node inside the session writes over their inputs where the program binds
        both to one buffer (output -> input): the fused updates' state (in_session.safe_in_place
        says which; the program's ``_in_place``, where nothing after the session reads the input)."""
        return {out: src for op in self.custom_ops for out, src in getattr(op.compute, "in_place", {}).items()}

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
            self._bind_output(io, name, value)
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
            # runs keep what they use. Uncaptured sessions otherwise kept their first call's
            # outputs for good.
            warm = self.seen[parity]
            self.seen[parity] = True
            self._run(io, self.policy.run_later if warm else self._uncaptured())
            return
        # A captured graph replays with the pointers it was captured with. The first runs of a
        # parity still read buffers that later steps no longer use (the first call's outputs), so
        # a parity is captured only once its inputs were bound to the same buffers twice in a row,
        # and not before its FIRST_CAPTURED_RUN-th run: by then the pointers of every input have
        # settled (an input in a parity pair moves once more, at the parity's second run; one
        # updated in place does not), so each session captures at the same call on every rank, as
        # NCCL asks of the calls a graph holds (with segments.py's _collectives_apart: docs/gpu.md,
        # "CUDA graphs").
        self.runs[parity] += 1
        if self.captured[parity] and changed:
            raise RunError(f"{self.where}: an input moved to another buffer after its CUDA graph was captured")
        if changed or self.runs[parity] < FIRST_CAPTURED_RUN:
            # Only a parity's first bound run may shrink the arena: the runs after it, none shrunk,
            # grow it back to what the step needs before any capture. A capture must find its
            # intermediates in free chunks: an arena that grows during a capture fails it
            # ("Failed to allocate memory", then CUDA error 901; the bf16 CNN of
            # tests/test_batchnorm_casts.py, whose last uncaptured runs each shrank the shared arena).
            first = not self.seen[parity]
            self.seen[parity] = True
            self._run(io, self._uncaptured() if first else self.policy.run_later)
            return
        if self.captured[parity]:  # every step from here on: a replay, nothing else on the host
            self._run(io, self.policy.run_graph[parity])
            return
        self.captured[parity] = True  # this first graph run: onnxruntime runs it several times (capture_call)
        if self.shared_arena:
            self.policy.shared_captured = True
        with capture_call(self.custom_ops, f"{self.where}: step parity {parity}"):
            self._run(io, self.policy.run_graph[parity])

    def _uncaptured(self):
        """Run options of an uncaptured run: the arena shrinks after it, unless a graph on that
        arena is captured already (any parity of this session's own arena; any session's on the
        shared one): a shrink frees the chunks that are free after a run, which is where a captured
        graph keeps its intermediates (onnxruntime does not protect them). Shrinking the shared
        arena after the first runs, until the first capture, keeps what those runs alone needed
        from staying with it for good (GPT-2-small, rank 0 of 4, 18 sessions: 5.66 -> 4.89 GiB
        outside CuPy's pool; benchmarks/gpu_memory_steps.py --pretend-world, one H100)."""
        captured = self.policy.shared_captured if self.shared_arena else any(self.captured)
        return self.policy.run_later if captured else self.policy.run_first

    def _run(self, io, run_options) -> None:
        try:
            self.session.run_with_iobinding(io, run_options)
        except Exception as exc:
            raise RunError(f"{self.where}: onnxruntime failed on device {self.device.device_id}: {_first_line(exc)}") from None
