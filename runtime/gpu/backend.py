"""GpuBackend: the nccl backend's Backend. It composes the parts of runtime/gpu/ and decides, once,
how they work together; each part does one job and imports none of the parts above it:

    device.py     the GPU, its compute stream, CuPy and onnxruntime-gpu        (GpuDevice)
    native.py     which native kernels run, inside the sessions or between      (NativePlan)
    compile.py    the passes from a cut segment to what a session runs
    session.py    a segment as a CUDA EP session, bound and captured            (SessionPolicy, OrtCudaSegment)
    program.py    a cut graph's step: buffers, sessions, overlapped collectives (GpuProgram)
    host_io.py    each step's data in, the losses out                          (HostIO)

docs/gpu.md describes what a GPU step does; docs/architecture.md draws the layers.
"""

from __future__ import annotations

import dataclasses
import os

from contract.ops import FUSED_UPDATE_DOMAIN
from runtime import variables
from runtime.collectives import publishes_updates
from runtime.errors import RunError
from runtime.executor import Backend
from runtime.gpu import native, session_collectives
from runtime.gpu.compile import default_passes
from runtime.gpu.device import GpuDevice
from runtime.gpu.elementwise_fusion import fuse_elementwise, fuse_relu_masks
from runtime.gpu.elementwise_steps import DOMAIN as ELEMENTWISE_DOMAIN
from runtime.gpu.host_io import HostIO
from runtime.gpu.program import GpuProgram
from runtime.gpu.scatter_add import fuse_scatter_add, refuse_unordered_row_sums
from runtime.gpu.session import OrtCudaSegment, SessionPolicy
from runtime.segments import NativeGroup

# cuBLAS's workspace per handle where the user did not set one: every session's CUDA EP makes its
# own cuBLAS handle, and on Hopper cuBLAS's default takes 64 MiB for each. One 32 MiB buffer
# (NVIDIA's size for Hopper) kept the step time of GPT-2-small, rank 0 of 4 in 18 sessions, and
# 0.56 GiB (35.45 against 35.46 ms); 16 MiB cost 0.55 ms (cuBLAS drops split-K GEMMs). Elsewhere
# cuBLAS's default is smaller than this, so it is left alone. Read when a handle is made.
HOPPER_CUBLAS_WORKSPACE = ":32768:1"


class GpuBackend(Backend):
    """onnxruntime CUDA EP on ``device_id``; ``tf32`` lets fp32 MatMul/Conv use TF32 (off for the
    equality tests); ``ep_options``: the user's CUDA EP options (``--ep-option``)."""

    name = "nccl"
    records_timings = True  # --timings: CUDA events around each item of the bound steps (GpuProgram)
    runs_grad_accumulation = True  # --grad-accumulation K: the trainer's accumulate and step programs, two GpuPrograms
    sends_low_precision = True  # --grad-dtype bf16|fp16: bf16/fp16 NCCL buckets (nccl_types.py; tests/test_gpu_grad_dtype.py)

    def __init__(self, device_id: int = 0, *, tf32: bool = False, ep_options: dict[str, str] | None = None,
                 per_item_timings: bool = False):
        self.device = device = GpuDevice(device_id, tf32=tf32)
        if device.cp.cuda.Device(device_id).compute_capability.startswith("9"):
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", HOPPER_CUBLAS_WORKSPACE)
        self.plan = self.decided = native.from_environment(device.ort, variables.text(variables.NATIVE_OFF))
        self.native_domains = self.plan.between
        self.late_native_domains = self.plan.between & {FUSED_UPDATE_DOMAIN}
        self.debug_sync = variables.flag(variables.DEBUG_SYNC)
        dump = variables.text(variables.DUMP)
        if dump:
            try:
                os.makedirs(dump, exist_ok=True)
            except OSError as exc:
                raise RunError(f"{variables.DUMP}={dump}: cannot create the folder: {exc.strerror}") from None
        # A multi-rank step's collectives run inside its sessions (session_collectives.py) wherever our
        # custom ops run there, whichever kernels are off; else (no custom ops, or
        # GRAPH_TRANSPILER_NATIVE_OFF=in_session or all) the step is cut
        # at each collective and the program runs them between sessions (program.py). So is a run
        # that times each item (--timings, ``per_item_timings``): a collective inside a captured
        # session has no events of its own around it, and the timeline's items are the cut's.
        self.collectives = session_collectives.Registry() if self.plan.custom_ops and not per_item_timings else None
        self.collectives_inside = self.collectives is not None
        inside = self.plan.inside | ({session_collectives.DOMAIN} if self.collectives_inside else set())
        self.policy = SessionPolicy(device, passes=default_passes(device.ort, self._node_runner, device, self.collectives),
                                    inside=frozenset(inside), ep_options=ep_options, dump=dump)
        self.io = HostIO(device)

    # -- Backend ---------------------------------------------------------------------------------
    def describe(self) -> str:
        return self.plan.line

    def prepare_step_graph(self, model):
        """The backend's own rewrites of the step graph into native nodes (the native table's, in
        its order: gradient_casts.py, conv_data_grad.py, batchnorm_casts.py, layernorm_casts.py,
        cross_entropy.py, scatter_add.py, parameter_casts.py, bias_grad.py; then
        elementwise_fusion.py's)."""
        if fuse_scatter_add not in self.plan.rewrites:
            refuse_unordered_row_sums(model)
        # `sharded` and `zero`: the step's Broadcasts (AllGathers) send what the updates write, which
        # must end the session of the gradients' collectives so that the publish runs in sessions of
        # its own, the same on every rank (segments._collectives_apart): the updates run between the
        # sessions there, one launch. Decided per step graph from the plan ``decide`` made.
        plan = self.decided
        if FUSED_UPDATE_DOMAIN in plan.inside and publishes_updates(model):
            self.native_domains = plan.between | {FUSED_UPDATE_DOMAIN}
            self.plan = dataclasses.replace(plan, line=f"{plan.line}; update between them (its step's collectives "
                                            "publish what it writes)")
        else:
            self.native_domains, self.plan = plan.between, plan
        self.late_native_domains = self.native_domains & {FUSED_UPDATE_DOMAIN}
        for rewrite in self.plan.rewrites:
            model = rewrite(model)
        if self.plan.relu_masks:
            model = fuse_relu_masks(model, (self.plan.inside | self.plan.between) - {ELEMENTWISE_DOMAIN})
        if self.plan.fuse_elementwise:
            # bfloat16 casts join the chains: fused nodes run only inside the sessions, where a
            # bfloat16 value is onnxruntime's buffer (between sessions there is none: WidenBfloat16).
            model = fuse_elementwise(model, additions=True, bfloat16=True)
        return model

    def compile(self, segment, where):
        if isinstance(segment, NativeGroup):
            return native.group_runner(segment, where, self.device)
        return OrtCudaSegment(segment, where, self.policy)

    def _node_runner(self, group: NativeGroup, where: str):
        if group.nodes[0].domain == session_collectives.DOMAIN:
            return session_collectives.runner(group, where, self.device, self.collectives)
        return native.runner(group, where, self.device)

    def make_program(self, cut, comm, *, calls_per_step: int = 1, carried=None):
        if self.collectives is not None:
            self.collectives.comm = comm  # before any session compiles (at the program's first call)
        program = GpuProgram(cut, self, comm, self.device, debug_sync=self.debug_sync, collectives=self.collectives,
                             carried=carried)
        if calls_per_step > 2:
            # A GpuProgram binds fixed buffers per call parity, and a captured graph replays them.
            # Called 3 or more times a step (the accumulate graph with K >= 4), one parity's calls
            # read the accumulators and statistics from different buffers within a step, which a
            # capture cannot replay: its sessions run uncaptured. (Called twice, K = 3, a session
            # whose input moves every step, such as BatchNorm statistics from the step program's
            # parity pair, is never captured either: the input moved; no NCCL call is in them.)
            for _, runner in program.steps:
                if isinstance(runner, OrtCudaSegment):
                    runner.capture_allowed = False
        # Every session allocates from one arena (SessionPolicy.share_arena): sessions run one at
        # a time on the compute stream, so the chunks one leaves free another may use, even where
        # a captured graph replays with them, and the arena is shrunk after the first runs until
        # the first capture. Against an arena per session (runs of one H100, rank 0 of a 4-rank
        # program alone, benchmarks/gpu_memory_steps.py --pretend-world): GPT-2-small in 7
        # sessions 6.96 -> 4.12 GiB outside CuPy's pool, ResNet-18 in 2 sessions 1.55 -> 1.21,
        # GPT-2-small in one session 6.46 either way, step times equal. (Before it was shrunk, a
        # shared arena cost a program of one large session 15.6 against 11.2 GiB, so only programs
        # of more than 8 sessions shared it.)
        self.policy.share_arena()
        for _, runner in program.steps:
            if isinstance(runner, OrtCudaSegment):
                runner.shared_arena = True
        return program

    def split_tail(self) -> bool:
        return True

    # -- the host side: GpuDevice and HostIO ------------------------------------------------------
    def from_host(self, array):
        return self.device.from_host(array)

    def to_host(self, value):
        return self.io.to_host(value)

    def feed(self, name, array):
        return self.io.feed(name, array)

    def hold_scalar(self, value):
        return self.io.hold_scalar(value)

    def scalars_to_host(self, held):
        return self.io.scalars_to_host(held)
