"""runtime/gpu/native.py: the one decision of which native kernels run, inside the onnxruntime sessions
or between them, said in one line; and training with each decision to the same result.

The training runs are CPU runs of the GPU backend's structure (SimulatedGpu): the real decision
(``native.decide``: onnxruntime's version, the custom-op library, its self-test), the backend's
rewrite of the step graph (elementwise fusion where the kernels run inside), the real compile
passes (runtime/gpu/compile.py) and custom ops (runtime/gpu/in_session.py) in CPU sessions, with
NumPy stand-ins for the CUDA kernels: the fused elementwise nodes (``evaluate_numpy``) and the
fused optimizer updates (``ReferenceUpdateRunner``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest

from contract.ops import FUSED_UPDATE_DOMAIN, LAYERNORM_DOMAIN
from runtime import ort_custom_ops, ort_custom_ops_build
from runtime.errors import RunError
from runtime.executor import CpuBackend, LaunchRunner, SegmentRunner
from runtime.gpu import native
from runtime.gpu.batchnorm_casts import fold_batchnorm_casts
from runtime.gpu.bias_grad import fuse_bias_grads
from runtime.gpu.compile import FixedOutputs, InlineFunctions, Specialize, TakeNativeNodes, compile_segment
from runtime.gpu.conv_data_grad import fuse_conv_data_grads
from runtime.gpu.cross_entropy import fuse_cross_entropy
from runtime.gpu.elementwise_fusion import fuse_elementwise, fuse_relu_masks
from runtime.gpu.elementwise_steps import DOMAIN as ELEMENTWISE_DOMAIN
from runtime.gpu.elementwise_steps import evaluate_numpy
from runtime.gpu.gradient_casts import fold_gradient_casts
from runtime.gpu.in_session import DOMAIN as IN_SESSION_DOMAIN
from runtime.gpu.layernorm_casts import fold_layernorms
from runtime.gpu.parameter_casts import batch_parameter_casts
from runtime.gpu.scatter_add import fuse_scatter_add
from runtime.segments import NativeGroup
from runtime.update_reference import ReferenceUpdateRunner
from runtime.variables import CACHE, NATIVE_OFF

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the custom-op library")


@pytest.fixture(autouse=True)
def fresh_decision(monkeypatch, tmp_path):
    """Every test decides anew, with its own cache and temporary folders, and as if the optional
    package of the attention kernel (nvidia-cudnn-frontend) were installed."""
    monkeypatch.setattr(native, "KERNELS", tuple(dataclasses.replace(k, unavailable=lambda: None) for k in native.KERNELS))
    monkeypatch.setenv(CACHE, str(tmp_path / "cache"))
    monkeypatch.setattr(ort_custom_ops_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    ort_custom_ops.reset()
    yield
    ort_custom_ops.reset()


def test_without_custom_ops_the_kernels_worth_it_run_between_sessions_and_the_line_says_why(monkeypatch):
    monkeypatch.setattr(ort_custom_ops, "readiness", lambda ort: "no C compiler (cc not found; set CC)")
    plan = native.decide(ort)
    assert not plan.inside
    assert plan.between == {FUSED_UPDATE_DOMAIN, *(k.domain for k in native.KERNELS if k.name in ("conv_grad", "batchnorm")),
                            ELEMENTWISE_DOMAIN}
    assert plan.on == ("update", "conv_grad", "batchnorm", "relu_mask") and not plan.fuse_elementwise
    # The rewrites' nodes run only inside a session, but the update's: it reads a bf16 gradient itself.
    assert plan.rewrites == (fold_gradient_casts,)
    assert plan.line == ("update, conv_grad, batchnorm, relu_mask between the onnxruntime sessions; conv_data_grad, "
                         "batchnorm_casts, layernorm, layernorm_forward, elementwise, attention, cross_entropy, scatter_add, parameter_casts, bias_grad off (they pay only inside a session): no custom ops, no C compiler "
                         "(cc not found; set CC)")


def test_a_kernel_whose_package_is_missing_is_off_and_the_line_says_which(monkeypatch):
    monkeypatch.setattr(ort_custom_ops, "readiness", lambda ort: None)
    monkeypatch.setattr(native, "KERNELS", tuple(
        dataclasses.replace(k, unavailable=lambda: "nvidia-cudnn-frontend is not installed") if k.name == "attention"
        else k for k in native.KERNELS))
    plan = native.decide(ort)
    assert "attention" not in plan.on and not {k.domain for k in native.KERNELS if k.name == "attention"} & plan.inside
    assert plan.line.endswith("bias_grad inside the onnxruntime sessions; attention off: nvidia-cudnn-frontend is not installed")


@needs_cc
def test_with_custom_ops_every_kernel_runs_inside():
    plan = native.decide(ort)
    assert plan.on == tuple(k.name for k in native.KERNELS)
    assert not plan.between and {FUSED_UPDATE_DOMAIN, LAYERNORM_DOMAIN, ELEMENTWISE_DOMAIN} <= plan.inside
    # The backend's rewrites, in table order.
    assert plan.rewrites == (fold_gradient_casts, fuse_conv_data_grads, fold_batchnorm_casts, fold_layernorms, fuse_cross_entropy, fuse_scatter_add, batch_parameter_casts,
                             fuse_bias_grads)
    assert plan.line == ("update, conv_grad, batchnorm, conv_data_grad, batchnorm_casts, layernorm, layernorm_forward, elementwise, relu_mask, attention, cross_entropy, scatter_add, parameter_casts, bias_grad inside the onnxruntime "
                         "sessions")


def test_the_bisect_switch_names_kernels_and_refuses_unknown_names(monkeypatch):
    monkeypatch.setattr(ort_custom_ops, "readiness", lambda ort: None)
    plan = native.decide(ort, native.parse_off("layernorm, update"))
    assert "layernorm" not in plan.on and "update" not in plan.on and FUSED_UPDATE_DOMAIN not in plan.between
    assert fold_gradient_casts not in plan.rewrites  # the update runs as its function: float32 gradients
    assert plan.line.endswith(f"({NATIVE_OFF}=layernorm,update)")
    between = native.decide(ort, native.parse_off("in_session"))
    assert not between.inside and between.line.startswith("update, conv_grad, batchnorm, relu_mask between")
    assert native.decide(ort, native.parse_off("all")).on == ()
    with pytest.raises(RunError, match=rf"{NATIVE_OFF}=layer_norm: unknown layer_norm \(names: update, conv_grad"):
        native.parse_off("layer_norm")


# -- the simulated GPU backend -------------------------------------------------------------------

class _HostDevice:
    """What the in-session ops and the kernels use of a GpuDevice, on the host: onnxruntime's CPU
    EP, which has no stream (KernelContext.gpu_stream is 0)."""

    provider = "CPUExecutionProvider"
    compute = SimpleNamespace(ptr=0)
    from_host = staticmethod(np.asarray)

    @staticmethod
    def device_array(ptr, shape, dtype, owner=None):
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            return np.empty(shape, dtype)
        buffer = (ctypes.c_byte * (count * np.dtype(dtype).itemsize)).from_address(ptr)
        return np.frombuffer(buffer, dtype).reshape(shape)


class _Elementwise(LaunchRunner):
    """Fused elementwise nodes by their NumPy form (the CUDA kernel's stand-in)."""

    def __init__(self, group, where, device):
        super().__init__(group.outputs)
        self.nodes = group.nodes

    def launch(self, values, allocate):
        for node in self.nodes:
            for name, result in zip(node.output, evaluate_numpy(node, [values[n] for n in node.input])):
                if name in values:
                    values[name][...] = result  # a buffer onnxruntime gave the custom op
                else:
                    values[name] = result


def _runner(group: NativeGroup, where: str, device=None):
    if group.nodes[0].domain == ELEMENTWISE_DOMAIN:
        return _Elementwise(group, where, device)
    return ReferenceUpdateRunner(group, where)


class _Session(SegmentRunner):
    """A segment compiled by the GPU's passes (no CUDA lowering) and run by a CPU session."""

    def __init__(self, segment, where, inside):
        self.segment, self.where, self.inside = segment, where, inside
        self.outputs = list(segment.outputs)
        self.compiled = None

    def run(self, feeds):
        if self.compiled is None:
            passes = [InlineFunctions(), Specialize(), FixedOutputs(ort), TakeNativeNodes(_runner, _HostDevice)]
            shapes = {name: tuple(np.shape(feeds[name])) for name in self.segment.inputs}
            self.compiled = compile_segment(self.segment, shapes, self.where, passes, self.inside)
            self.session, self.names = None, [o.name for o in self.compiled.model.graph.output]
            if self.names:  # else every output is a constant or a copy: no session (as on the GPU)
                options = ort.SessionOptions()
                options.log_severity_level = 3
                options.intra_op_num_threads = 1  # as the CPU backend it is compared with
                if self.compiled.custom_ops:
                    ort_custom_ops.register(options, IN_SESSION_DOMAIN, self.compiled.custom_ops)
                self.session = ort.InferenceSession(self.compiled.model.SerializeToString(), options,
                                                    providers=["CPUExecutionProvider"])
        computed = {} if self.session is None else dict(zip(self.names, self.session.run(
            self.names, {i.name: feeds[i.name] for i in self.session.get_inputs()})))
        computed.update(self.compiled.constants)
        computed.update({name: np.array(feeds[src]) for name, src in self.compiled.copies.items()})
        return [computed[name] for name in self.outputs]


class SimulatedGpu(CpuBackend):
    """The GPU backend's decisions and compile path on the CPU (the module docstring)."""

    def __init__(self):
        super().__init__(threads=1)
        self.plan = native.decide(ort)
        simulated = {ELEMENTWISE_DOMAIN, FUSED_UPDATE_DOMAIN}  # the kernels with a NumPy stand-in here
        self.inside = self.plan.inside & simulated
        self.native_domains = self.plan.between & simulated
        self.late_native_domains = self.native_domains & {FUSED_UPDATE_DOMAIN}

    def describe(self):
        return self.plan.line

    def prepare_step_graph(self, model):
        if self.plan.relu_masks:
            model = fuse_relu_masks(model, self.plan.inside | self.plan.between)
        return fuse_elementwise(model, additions=True) if self.plan.fuse_elementwise else model

    def split_tail(self):
        return True

    def compile(self, segment, where):
        if isinstance(segment, NativeGroup):
            return native.NativeSequence([_runner(sub, where) for sub in segment.by_domain()], segment.outputs)
        return _Session(segment, where, self.inside)


def _train(plan, data, backend, steps=3):
    from runtime.collectives import LocalGroup
    from runtime.config import RunConfig
    from runtime.data import Dataset
    from runtime.loop import train
    from runtime.trainer import Trainer

    trainer = Trainer(plan, LocalGroup(1).communicator(0), rank=None, backend=backend)
    lines = []
    train(trainer, Dataset(data, plan.data_inputs, "<data>"), RunConfig(batch=8, steps=steps, lr=1e-3, log_every=1),
          log=lines.append)
    return trainer.parameters(), trainer, lines


@pytest.fixture(scope="module")
def gpt_plan(model_dir, tmp_path_factory):
    from conftest import load_data

    from runtime.plan import load_plan
    from transpiler import Options, transpile
    from transpiler.optimizer_table import OptimizerConfig

    out = tmp_path_factory.mktemp("native") / "out"
    transpile(model_dir("gpt") / "model.onnx", out, Options(optimizer=OptimizerConfig("momentum", lr=1e-2)))
    plan = load_plan(out)
    expected, _, _ = _train(plan, load_data(model_dir("gpt") / "data.npz"), CpuBackend(threads=1))
    return plan, load_data(model_dir("gpt") / "data.npz"), expected


def _assert_trains_like_the_cpu_backend(gpt_plan, inside: bool):
    plan, data, expected = gpt_plan
    backend = SimulatedGpu()
    got, trainer, lines = _train(plan, data, backend)
    assert bool(backend.inside) == inside
    assert any(line.split()[:1] == ["kernels"] and backend.plan.line in line for line in lines), lines[:12]
    fused = [n for item in trainer.step_program.cut.items if hasattr(item, "model")
             for n in item.model.graph.node if n.domain == ELEMENTWISE_DOMAIN]
    assert bool(fused) == inside  # the fusion happened exactly where the kernels run inside
    # Momentum's update is linear in the gradient, so float32 summation order (the fused nodes,
    # the reference update) moves a parameter by rounding only: within 1e-6 of its scale.
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-6 * max(1.0, float(np.abs(value).max())), err_msg=name)


@pytest.mark.slow
def test_a_run_without_a_c_compiler_trains_to_the_same_result_and_says_so(gpt_plan, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    _assert_trains_like_the_cpu_backend(gpt_plan, inside=False)
    assert "no C compiler" in SimulatedGpu().plan.line


@needs_cc
@pytest.mark.slow
def test_a_run_with_a_corrupt_cached_library_rebuilds_it_and_trains_to_the_same_result(gpt_plan):
    folder = ort_custom_ops_build.folders()[0]
    folder.mkdir(mode=0o700, parents=True)
    library = folder / ort_custom_ops_build.file_name(ort_custom_ops_build.compiler())
    library.write_bytes(b"\x7fELF truncated by a full disk")
    library.chmod(0o600)
    _assert_trains_like_the_cpu_backend(gpt_plan, inside=True)
    assert ctypes.CDLL(str(library)) is not None  # rebuilt in place: a library again

