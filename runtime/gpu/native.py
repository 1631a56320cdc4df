"""The native GPU kernels: one table, and the one decision of which run where.

A native kernel runs nodes of one op domain that the transpiler (or the backend's own rewrite of
the step graph) writes, instead of onnxruntime running them as their ONNX functions. Each can run

- inside the onnxruntime session of its segment, as a custom op (in_session.py): on the session's
  stream, between its kernels, captured in its CUDA graph; this needs the custom-op library
  (runtime/ort_custom_ops.py: a C compiler once, an onnxruntime whose C API layout we know);
- or between sessions, as a NativeGroup item of the cut graph (segments.py): every such group cuts
  the step into one more session.

``decide`` makes the decision once per backend, from what this process can do and the bisect
switch (runtime.variables.NATIVE_OFF), and says it in one line for the run's banner. Results are
the same either way up to float32 summation order (each kernel's tests hold it to the CPU backend
within 1e-5); what changes is speed and memory, which is why it is said, never silent.

Measured reasons for the table's ``between`` column (docs/gpu-log.md): between sessions,
each LayerNorm gradient cut GPT-2-small's step into one more session, 25 more sessions cost
3.1 GiB for no faster step (run h200-s15); fused elementwise chains cost more than they saved
(48.2 against 37.8 ms, 45.8 GiB). Inside sessions both pay (GPT-2-small 30.6 against 33.0 ms, run
h200-s8-g1).
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass

from contract.ops import (
    ATTENTION_DOMAIN,
    BATCHNORM_DOMAIN,
    CONV_GRAD_DOMAIN,
    FUSED_UPDATE_DOMAIN,
    LAYERNORM_DOMAIN,
)
from runtime import ort_custom_ops
from runtime.errors import RunError
from runtime.executor import SegmentRunner
from runtime.gpu import attention
from runtime.gpu.attention import AttentionRunner
from runtime.gpu.batchnorm import BatchNormRunner
from runtime.gpu.batchnorm_casts import DOMAIN as BATCHNORM_CASTS_DOMAIN
from runtime.gpu.batchnorm_casts import fold_batchnorm_casts
from runtime.gpu.bias_grad import DOMAIN as BIAS_GRAD_DOMAIN
from runtime.gpu.bias_grad import BiasGradRunner, fuse_bias_grads
from runtime.gpu.conv_data_grad import DOMAIN as CONV_DATA_GRAD_DOMAIN
from runtime.gpu.conv_data_grad import ConvDataGradRunner, fuse_conv_data_grads
from runtime.gpu.conv_grad import ConvGradRunner
from runtime.gpu.cross_entropy import DOMAIN as CROSS_ENTROPY_DOMAIN
from runtime.gpu.cross_entropy import CrossEntropyRunner, fuse_cross_entropy
from runtime.gpu.elementwise import ElementwiseRunner
from runtime.gpu.elementwise_steps import DOMAIN as ELEMENTWISE_DOMAIN
from runtime.gpu.gradient_casts import fold_gradient_casts
from runtime.gpu.layernorm import LayerNormRunner
from runtime.gpu.layernorm_casts import DOMAIN as LAYERNORM_FORWARD_DOMAIN
from runtime.gpu.layernorm_casts import fold_layernorms
from runtime.gpu.parameter_casts import DOMAIN as PARAMETER_CASTS_DOMAIN
from runtime.gpu.parameter_casts import ParameterCastRunner, batch_parameter_casts
from runtime.gpu.scatter_add import DOMAIN as SCATTER_ADD_DOMAIN
from runtime.gpu.scatter_add import ScatterAddRunner, fuse_scatter_add
from runtime.gpu.update_kernel import FusedUpdateRunner
from runtime.segments import NativeGroup
from runtime.variables import NATIVE_OFF


@dataclass(frozen=True)
class Kernel:
    name: str  # what NATIVE_OFF and the banner call it
    domain: str  # the nodes it runs
    runner: type  # runner(group, where, device): the SegmentRunner of a NativeGroup of its nodes
    in_session: bool  # may run inside its segment's session
    between: bool  # worth running between sessions where it cannot run inside (the module docstring)
    unavailable: Callable[[], str | None] = lambda: None  # why this process cannot run it (a missing package)
    # The backend's rewrite of the step graph that writes its nodes or changes them for it
    # (GpuBackend.prepare_step_graph runs those of the kernels that run, in table order, before the
    # elementwise fusion), None where the transpiler's nodes are what it runs.
    rewrite: Callable | None = None


KERNELS = (
    # The fused optimizer updates; a bfloat16 weight gradient's widening Cast folded in (gradient_casts.py).
    # Inside the session each bucket's updates run as soon as its collective is done, while later
    # buckets' are in flight (in_session.GROUPED), except in a step whose collectives publish what
    # they write (GpuBackend.prepare_step_graph).
    Kernel("update", FUSED_UPDATE_DOMAIN, FusedUpdateRunner, in_session=True, between=True,
           rewrite=fold_gradient_casts),
    Kernel("conv_grad", CONV_GRAD_DOMAIN, ConvGradRunner, in_session=True, between=True),
    Kernel("batchnorm", BATCHNORM_DOMAIN, BatchNormRunner, in_session=True, between=True),
    # A bf16/fp16 Conv's data gradient (its ConvTranspose) by cuDNN's backward-data (conv_data_grad.py).
    Kernel("conv_data_grad", CONV_DATA_GRAD_DOMAIN, ConvDataGradRunner, in_session=True, between=False,
           rewrite=fuse_conv_data_grads),
    # BatchNorm reading and writing bfloat16, its casts folded in (batchnorm_casts.py).
    Kernel("batchnorm_casts", BATCHNORM_CASTS_DOMAIN, BatchNormRunner, in_session=True, between=False,
           rewrite=fold_batchnorm_casts),
    Kernel("layernorm", LAYERNORM_DOMAIN, LayerNormRunner, in_session=True, between=False),
    # LayerNormalization's forward, a Cast to bfloat16 after it folded in (layernorm_casts.py).
    Kernel("layernorm_forward", LAYERNORM_FORWARD_DOMAIN, LayerNormRunner, in_session=True, between=False,
           rewrite=fold_layernorms),
    # Two rewrites of the step graph (elementwise_fusion.py) into nodes of one domain: chains of
    # elementwise nodes, and ReLU's backward where a native node reads it.
    Kernel("elementwise", ELEMENTWISE_DOMAIN, ElementwiseRunner, in_session=True, between=False),
    Kernel("relu_mask", ELEMENTWISE_DOMAIN, ElementwiseRunner, in_session=True, between=True),
    # cuDNN's fused attention (bf16/fp16 nodes only): between sessions each node would cut the step.
    Kernel("attention", ATTENTION_DOMAIN, AttentionRunner, in_session=True, between=False,
           unavailable=attention.unavailable),
    # The loss and its gradient fused (cross_entropy.py: a rewrite of the step graph, as above).
    # Before the elementwise fusion, so that the bf16 casts around the loss join its node.
    Kernel("cross_entropy", CROSS_ENTROPY_DOMAIN, CrossEntropyRunner, in_session=True, between=False,
           rewrite=fuse_cross_entropy),
    # An embedding's gradient, rows added by blocks (scatter_add.py).
    Kernel("scatter_add", SCATTER_ADD_DOMAIN, ScatterAddRunner, in_session=True, between=False,
           rewrite=fuse_scatter_add),
    # The parameters' casts to bfloat16 in one launch (parameter_casts.py), before the elementwise
    # fusion would take one into a chain.
    Kernel("parameter_casts", PARAMETER_CASTS_DOMAIN, ParameterCastRunner, in_session=True, between=False,
           rewrite=batch_parameter_casts),
    # A bias gradient summed from bfloat16 values, no float32 copy (bias_grad.py).
    Kernel("bias_grad", BIAS_GRAD_DOMAIN, BiasGradRunner, in_session=True, between=False, rewrite=fuse_bias_grads),
)
RUNNERS = {kernel.domain: kernel.runner for kernel in KERNELS}
IN_SESSION = "in_session"  # NATIVE_OFF's name for "run the kernels between sessions"
_NAMES = tuple(kernel.name for kernel in KERNELS) + (IN_SESSION, "all")


@dataclass(frozen=True)
class NativePlan:
    """Which native kernels run, and where."""

    on: tuple[str, ...]  # kernel names, table order
    inside: frozenset[str]  # domains run inside the sessions
    between: frozenset[str]  # domains run between sessions (the cut takes their nodes out)
    line: str  # the decision, for the banner
    custom_ops: bool = False  # our custom ops run inside the sessions (a multi-rank step's collectives too)

    @property
    def fuse_elementwise(self) -> bool:
        return "elementwise" in self.on

    @property
    def relu_masks(self) -> bool:
        return "relu_mask" in self.on

    @property
    def rewrites(self) -> tuple[Callable, ...]:
        """The step-graph rewrites of the kernels that run (inside the sessions or between), in table order."""
        return tuple(k.rewrite for k in KERNELS if k.rewrite is not None and k.domain in self.inside | self.between)


def parse_off(text: str) -> frozenset[str]:
    names = frozenset(filter(None, (n.strip() for n in text.split(","))))
    unknown = sorted(names - set(_NAMES))
    if unknown:
        raise RunError(f"{NATIVE_OFF}={text}: unknown {', '.join(unknown)} (names: {', '.join(_NAMES)})")
    return frozenset(k.name for k in KERNELS) | {IN_SESSION} if "all" in names else names


def decide(ort, off: frozenset[str] = frozenset()) -> NativePlan:
    """The plan for this process: every kernel not in ``off``; inside the sessions where the
    custom-op library is ready (``ort_custom_ops.readiness``), else between them those worth it."""
    if IN_SESSION in off:
        why_not = f"{NATIVE_OFF} names {IN_SESSION}"
    else:
        why_not = ort_custom_ops.readiness(ort)
    inside = why_not is None
    on, dropped, missing = [], [], []
    for kernel in KERNELS:
        if kernel.name in off:
            continue
        if (why := kernel.unavailable()) is not None:
            missing.append(f"{kernel.name} off: {why}")
            continue
        (on if inside or kernel.between else dropped).append(kernel)
    in_domains = frozenset(k.domain for k in on if inside and k.in_session)
    between = frozenset(k.domain for k in on) - in_domains
    names = lambda kernels: ", ".join(k.name for k in kernels) or "none"  # noqa: E731
    if inside:
        line = f"{names([k for k in on if k.domain in in_domains])} inside the onnxruntime sessions"
        if between:
            line += f", {names([k for k in on if k.domain in between])} between them"
    else:
        line = f"{names(on)} between the onnxruntime sessions"
        if dropped:
            line += f"; {names(dropped)} off (they pay only inside a session)"
        line += f": no custom ops, {why_not}"
    if missing:
        line += "; " + "; ".join(missing)
    if off:
        line += f" ({NATIVE_OFF}={','.join(sorted(off))})"
    return NativePlan(tuple(k.name for k in on), in_domains, between, line, custom_ops=inside)


def from_environment(ort, text: str) -> NativePlan:
    return decide(ort, parse_off(text))


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


def runner(group: NativeGroup, where: str, device):
    """The runner of a group of one native domain's nodes (between sessions, or one node inside one)."""
    return RUNNERS[group.nodes[0].domain](group, where, device)


def group_runner(group: NativeGroup, where: str, device):
    """The runner of a NativeGroup item of the cut graph: one per domain group, in turn."""
    runners = [runner(sub, where, device) for sub in group.by_domain()]
    return runners[0] if len(runners) == 1 else NativeSequence(runners, group.outputs)
