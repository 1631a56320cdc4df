"""GpuBackend: the nccl backend's Backend: onnxruntime CUDA EP sessions (session.py) and the fused
optimizer updates (update_kernel.py) on one compute stream, programs that overlap the collectives
(program.py), and the host side of a step: fed data through pinned buffers, the loss ring.
docs/gpu.md.
"""

from __future__ import annotations

import os
from collections import ChainMap
from typing import Any

import numpy as np

from contract.ops import BATCHNORM_DOMAIN, CONV_GRAD_DOMAIN, FUSED_UPDATE_DOMAIN, LAYERNORM_DOMAIN
from runtime import ort_custom_ops
from runtime.errors import RunError
from runtime.executor import Backend, SegmentRunner
from runtime.gpu.batchnorm import BatchNormRunner
from runtime.gpu.conv_grad import ConvGradRunner, CudnnContext
from runtime.gpu.cuda import ORT_DTYPES, import_cupy, load_onnxruntime
from runtime.gpu.elementwise import DOMAIN as ELEMENTWISE_DOMAIN
from runtime.gpu.elementwise import ElementwiseRunner, fuse_elementwise, fuse_relu_masks
from runtime.gpu.layernorm import LayerNormRunner
from runtime.gpu.program import GpuProgram
from runtime.gpu.session import OrtCudaSegment
from runtime.gpu.update_kernel import FusedUpdateRunner
from runtime.segments import NativeGroup

LOSS_RING = 4096  # device slots for losses not yet read; Trainer flushes long before it wraps
MANY_SESSIONS = 8  # onnxruntime sessions in a program beyond which they share an arena (make_program)
SMALL_CUBLAS_WORKSPACE = ":4096:1"  # one 4 MiB workspace per cuBLAS handle (cuBLAS's own syntax)
_GEMM_OPS = frozenset({"MatMul", "Gemm", "Einsum"})


# The op domains this backend may run natively, each with its switch (a variable): "0" leaves the
# domain's nodes to onnxruntime (their functions), "1" runs them natively; unset, on.
# - fused optimizer updates: multi-tensor CuPy kernels (runtime/gpu/update_kernel.py);
# - Conv weight gradients and training BatchNorms: cuDNN (runtime/gpu/conv_grad.py, batchnorm.py);
# - LayerNorm gradients: two CuPy kernels each (runtime/gpu/layernorm.py).
NATIVE_SWITCHES = {FUSED_UPDATE_DOMAIN: "GRAPH_TRANSPILER_FUSED_UPDATE",
                   CONV_GRAD_DOMAIN: "GRAPH_TRANSPILER_NATIVE_CONV_GRAD",
                   BATCHNORM_DOMAIN: "GRAPH_TRANSPILER_NATIVE_BATCHNORM",
                   LAYERNORM_DOMAIN: "GRAPH_TRANSPILER_NATIVE_LAYERNORM"}
# Native domains whose nodes run inside the onnxruntime session of their segment, as custom ops
# (runtime/gpu/in_session.py), where the custom-op library can be built; the others (the fused
# update, which writes the state in place) run between sessions.
IN_SESSION = frozenset({CONV_GRAD_DOMAIN, BATCHNORM_DOMAIN, LAYERNORM_DOMAIN, ELEMENTWISE_DOMAIN})
# On by default only inside sessions: between sessions, each LayerNorm gradient cut GPT-2-small's
# step into one more session, and 25 more sessions cost 3.1 GiB (a cuBLAS workspace and handles
# each) for no faster step (34.5 ms both, 965 against 1289 kernels; run h200-s15, docs/gpu.md).
ONLY_IN_SESSIONS = frozenset({LAYERNORM_DOMAIN})
# Native domain -> its runner. A NativeGroup holding several domains runs one runner per domain
# group of NativeGroup.by_domain, in that order (each reads only what earlier ones computed).
_NATIVE_RUNNERS = {ELEMENTWISE_DOMAIN: ElementwiseRunner, BATCHNORM_DOMAIN: BatchNormRunner,
                   CONV_GRAD_DOMAIN: ConvGradRunner, FUSED_UPDATE_DOMAIN: FusedUpdateRunner,
                   LAYERNORM_DOMAIN: LayerNormRunner}


class NativeSequence(SegmentRunner):
    """Runners of one NativeGroup's nodes, split by domain, run in turn (the runner interface); a
    later runner may read an earlier one's outputs."""

    def __init__(self, runners: list, outputs):
        self.runners = runners
        self.outputs = list(outputs)
        self.prepared: list[dict | None] = [None, None]

    def run(self, feeds):
        values = dict(feeds)
        for runner in self.runners:
            values.update(zip(runner.outputs, runner.run(values)))
        return [values[name] for name in self.outputs]

    def prepare(self, parity, outputs):
        self.prepared[parity] = dict(outputs)
        for runner in self.runners:
            runner.prepare(parity, {name: outputs[name] for name in runner.outputs})

    def run_bound(self, parity, env):
        values = ChainMap(self.prepared[parity], env)
        for runner in self.runners:
            runner.run_bound(parity, values)

    def in_place_pairs(self) -> dict[str, str]:
        return {out: src for runner in self.runners if hasattr(runner, "in_place_pairs")
                for out, src in runner.in_place_pairs().items()}


# Options the runtime owns: the device and stream every session must share (the program orders
# its work by that stream) and CUDA graphs (which sessions capture is the program's decision).
RESERVED_PROVIDER_OPTIONS = ("device_id", "user_compute_stream", "has_user_compute_stream", "enable_cuda_graph")


def parse_provider_options(text: str) -> dict[str, str]:
    """``"a=1,b=x"`` -> ``{"a": "1", "b": "x"}``; a malformed entry or one the runtime owns is a
    one-line error naming it."""
    options = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        key, sep, value = entry.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RunError(f"GRAPH_TRANSPILER_CUDA_EP_OPTIONS: {entry!r} is not key=value")
        if key in RESERVED_PROVIDER_OPTIONS:
            raise RunError(f"GRAPH_TRANSPILER_CUDA_EP_OPTIONS: {key!r} is set by the runtime and cannot be "
                           f"changed (reserved: {', '.join(RESERVED_PROVIDER_OPTIONS)})")
        options[key] = value.strip()
    return options


_SHARED_ARENAS: set[int] = set()  # devices whose arena is registered with onnxruntime's environment


def _share_arena(ort, device_id: int, provider_options: dict[str, str]) -> None:
    """Register one CUDA arena for ``device_id`` with onnxruntime's (process-wide) environment, once;
    sessions opt in with ``session.use_env_allocators``. It lives as long as the process (onnxruntime
    has no call to unregister it) and is never shrunk (GpuBackend.make_program)."""
    if device_id in _SHARED_ARENAS:
        return
    info = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, device_id, ort.OrtMemType.DEFAULT)
    options = {"device_id": str(device_id)}
    if "gpu_mem_limit" in provider_options:  # a user's cap (GRAPH_TRANSPILER_CUDA_EP_OPTIONS) holds for it too
        options["gpu_mem_limit"] = provider_options["gpu_mem_limit"]
    # arena_extend_strategy 1 (kSameAsRequested): grow by what is asked, as the sessions' own arenas do.
    ort.create_and_register_allocator_v2("CUDAExecutionProvider", info, options, ort.OrtArenaCfg({"arena_extend_strategy": 1}))
    _SHARED_ARENAS.add(device_id)


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
        # Fully asynchronous runs (onnxruntime returns before its kernels finish) are opt-in: on the
        # 4x H200 check they gave wrong results on 2 and 4 GPUs (correct on 1), so some onnxruntime
        # work is not ordered by the user compute stream there. Synchronized runs still overlap
        # each bucket's NCCL call (comm stream) with the next segments; the host only stops
        # running ahead of the GPU. docs/gpu.md.
        self.async_runs = os.environ.get("GRAPH_TRANSPILER_ORT_ASYNC") == "1"
        # Debugging aid: synchronize the whole device after every segment and collective, which
        # rules out any stream-ordering race (slow; never on by default).
        self.debug_sync = os.environ.get("GRAPH_TRANSPILER_DEBUG_SYNC") == "1"
        # Segments specialized to their first call's shapes, and replayed as CUDA graphs (see
        # OrtCudaSegment); GRAPH_TRANSPILER_STATIC_SHAPES=0 / GRAPH_TRANSPILER_CUDA_GRAPHS=0 turn them off.
        env_flag = lambda name: os.environ.get(name, "1") != "0"  # noqa: E731
        self.static_shapes = env_flag("GRAPH_TRANSPILER_STATIC_SHAPES") if static_shapes is None else static_shapes
        self.cuda_graphs = env_flag("GRAPH_TRANSPILER_CUDA_GRAPHS") if cuda_graphs is None else cuda_graphs
        # Programs with collectives on several ranks are captured too (GpuProgram);
        # GRAPH_TRANSPILER_MULTIRANK_GRAPHS=0 runs them uncaptured (the former default).
        self.multirank_graphs = env_flag("GRAPH_TRANSPILER_MULTIRANK_GRAPHS")
        # One onnxruntime arena shared by the sessions of a program cut into many (make_program);
        # GRAPH_TRANSPILER_SHARED_ARENA=0 keeps one arena per session everywhere.
        self.shared_arena = env_flag("GRAPH_TRANSPILER_SHARED_ARENA")
        self.shrink_arena = env_flag("GRAPH_TRANSPILER_SHRINK_ARENA")
        self.mem_pattern = env_flag("GRAPH_TRANSPILER_MEM_PATTERN")
        # onnxruntime's constant folding, off: specialization (runtime/specialize.py) and the lowering
        # already fold what is cheap to keep, and onnxruntime's would also turn a large zero fill
        # (the token embedding's gradient starts from [50304, 768] zeros) into a 147 MiB initializer
        # held for good, where the device fills it in a few microseconds each step: GPT-2-small
        # on one H200 9.03 -> 8.88 GiB, same step (run h200-s8-g6). GRAPH_TRANSPILER_ORT_CONSTANT_FOLDING=1
        # turns it back on.
        self.ort_constant_folding = os.environ.get("GRAPH_TRANSPILER_ORT_CONSTANT_FOLDING", "0") == "1"
        # Extra CUDA EP options, "key=value,key=value" (onnxruntime's names: prefer_nhwc,
        # cudnn_conv_algo_search, ...), over the ones the sessions set: for trying onnxruntime's
        # knobs on a model without a code change (docs/gpu.md).
        self.provider_options = parse_provider_options(os.environ.get("GRAPH_TRANSPILER_CUDA_EP_OPTIONS", ""))
        # A folder where each session writes the graph onnxruntime optimized for it (its fusions,
        # the nodes it kept), to diagnose kernel counts; empty: none written.
        self.dump_optimized = os.environ.get("GRAPH_TRANSPILER_ORT_DUMP", "")
        if self.dump_optimized:
            try:
                os.makedirs(self.dump_optimized, exist_ok=True)
            except OSError as exc:
                raise RunError(f"GRAPH_TRANSPILER_ORT_DUMP={self.dump_optimized}: cannot create the folder: "
                               f"{exc.strerror}") from None
        # The fused update writes parameters and optimizer state in place (GpuProgram._in_place);
        # GRAPH_TRANSPILER_UPDATE_IN_PLACE=0 keeps a buffer pair per state value instead.
        self.update_in_place = env_flag("GRAPH_TRANSPILER_UPDATE_IN_PLACE")
        # Uncaptured runs: the first runs of a session give its arena's free chunks back; later ones
        # (and every run of a session on the shared arena) do not.
        self.run_options_uncaptured = self._run_options(graph_id=-1)
        self.run_options = self._run_options(graph_id=-1, shrink=False)
        self.run_options_graph = [self._run_options(graph_id=parity) for parity in (0, 1)]
        # Native nodes inside the sessions (IN_SESSION): needs static shapes and a C compiler for the
        # custom-op library, once per machine (runtime/ort_custom_ops.py); GRAPH_TRANSPILER_IN_SESSION=0
        # runs them between sessions instead.
        self.in_session = (env_flag("GRAPH_TRANSPILER_IN_SESSION") and self.static_shapes
                           and ort_custom_ops.available())
        native = {domain for domain, switch in NATIVE_SWITCHES.items()
                  if os.environ.get(switch, "0" if domain in ONLY_IN_SESSIONS and not self.in_session else "1") != "0"}
        # Chains of elementwise nodes as one CuPy kernel each (runtime/gpu/elementwise.py), on by
        # default where they run inside the sessions: GPT-2-small on one H200 30.6 against 33.0 ms,
        # 856 against 964 kernels, 9.59 against 9.54 GiB (run h200-s8-g1). Between sessions they
        # cost more than they saved (48.2 against 37.8 ms, 45.8 GiB; docs/gpu.md "Elementwise
        # fusion"), so there it is opt-in. GRAPH_TRANSPILER_FUSE_ELEMENTWISE=0 or 1 decides either way.
        self.fuse_elementwise = os.environ.get("GRAPH_TRANSPILER_FUSE_ELEMENTWISE", "1" if self.in_session else "0") == "1"
        # ReLU's backward as one kernel where a native node reads it (runtime/gpu/elementwise.py
        # fuse_relu_masks; it adds no session); GRAPH_TRANSPILER_FUSE_RELU_MASKS=0 leaves it to onnxruntime.
        self.relu_masks = env_flag("GRAPH_TRANSPILER_FUSE_RELU_MASKS")
        if self.fuse_elementwise or self.relu_masks:
            native.add(ELEMENTWISE_DOMAIN)
        # Domains run by this backend: between sessions (the cut takes them out, segments.py) or in them.
        self.in_session_domains = frozenset(native & IN_SESSION) if self.in_session else frozenset()
        self.native_domains = frozenset(native) - self.in_session_domains
        self._cudnn: CudnnContext | None = None
        self._staging: dict[str, tuple[Any, np.ndarray, Any]] = {}
        self._ring = cp.zeros(LOSS_RING, dtype=np.float64)
        self._ring_next = 0

    def _run_options(self, *, graph_id: int, shrink: bool = True):
        """Run options for a CUDA-graph session: which captured graph a run uses (-1: none).
        A replay only enqueues work on the compute stream, so it never needs onnxruntime's
        synchronization after the run."""
        options = self.ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", str(graph_id))
        if self.async_runs or graph_id >= 0:
            options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        if graph_id < 0 and shrink and self.shrink_arena:
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
        if not isinstance(segment, NativeGroup):
            return OrtCudaSegment(segment, where, self)
        runners = [self.native_runner(sub, where) for sub in segment.by_domain()]
        return runners[0] if len(runners) == 1 else NativeSequence(runners, segment.outputs)

    def native_runner(self, group: NativeGroup, where: str):
        """The runner of a group of one native domain's nodes (between sessions, or one node inside one)."""
        return _NATIVE_RUNNERS[group.nodes[0].domain](group, where, self)

    def cudnn(self) -> CudnnContext:
        """The cuDNN handle and workspace every cuDNN runner (Conv gradients, BatchNorms) shares, made on first use."""
        if self._cudnn is None:
            self._cudnn = CudnnContext(self.cp, self.compute)
        return self._cudnn

    def prepare_step_graph(self, model):
        if self.relu_masks:
            model = fuse_relu_masks(model, (self.native_domains | self.in_session_domains) - {ELEMENTWISE_DOMAIN})
        return fuse_elementwise(model, additions=self.in_session) if self.fuse_elementwise else model

    def make_program(self, cut, comm):
        program = GpuProgram(cut, self, comm)
        sessions = [runner for _, runner in program.steps if isinstance(runner, OrtCudaSegment)]
        if len(sessions) > MANY_SESSIONS:
            # A program cut into many sessions (native BatchNorms: ~35 for ResNet-18) would keep an
            # arena per session, each holding its own intermediates and cuDNN workspaces: they
            # share one instead (measured on an H200: ResNet-18 8.25 -> 6.53 GiB). Sessions run one
            # at a time on the compute stream, so the chunks one leaves free another may use, even
            # where a captured graph replays with them. But then the arena may never be shrunk
            # (a shrink would free chunks another session's graph still writes), which a program of
            # one large session needs after its first runs (GPT-2-small: 11.2 against 15.6 GiB).
            if self.shared_arena:
                _share_arena(self.ort, self.device_id, self.provider_options)
                for runner in sessions:
                    runner.shared_arena = True
                    # Without onnxruntime's memory pattern (one block per session sized by its
                    # plan), a session's intermediates are chunks of the shared arena that the
                    # next session reuses: ResNet-18 on one H200 3.09 -> 2.90 GiB, its step
                    # 13.31 -> 13.12 ms (run h200-s17). Programs of at most MANY_SESSIONS sessions
                    # keep their own arenas and the pattern (GPT-2-small: 9.54 GiB either way).
                    runner.mem_pattern = False
            gemms = sum(any(n.op_type in _GEMM_OPS for n in runner.segment.model.graph.node) for runner in sessions)
            if "CUBLAS_WORKSPACE_CONFIG" not in os.environ and 4 * gemms <= len(sessions):
                # Every session has its own cuBLAS handle, and cuBLAS gives each a 64 MiB workspace
                # on Hopper (an H200: 73 MiB per session, 9 without it): 2.2 GiB for 35 sessions.
                # Where few of them multiply matrices (a CNN: its heavy work is cuDNN's), 4 MiB each.
                # Set from here to the end of the program's first call, in which its sessions are
                # made and first run (cuBLAS reads it when a handle is made); a user's setting wins.
                os.environ["CUBLAS_WORKSPACE_CONFIG"] = SMALL_CUBLAS_WORKSPACE
                program.after_first_call = lambda: os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        return program

    def split_tail(self) -> bool:
        return True

    def wrap(self, ortvalue):
        """A CuPy view of an onnxruntime output on this device; keeps the OrtValue alive."""
        return self.device_array(ortvalue.data_ptr(), tuple(ortvalue.shape()), ORT_DTYPES[ortvalue.data_type()], ortvalue)

    def device_array(self, ptr: int, shape: tuple, dtype, owner=None):
        """A CuPy view of ``shape`` elements of ``dtype`` at device pointer ``ptr`` on this device,
        which ``owner`` (if any) keeps allocated as long as the view lives."""
        cp = self.cp
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return cp.empty(shape, dtype)
        memory = cp.cuda.UnownedMemory(ptr, nbytes, owner, self.device_id)
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
