"""The GPU fused update kernel's CUDA source, compiled for the host and run on CPU.

No GPU here, so the kernel source (runtime/gpu/update_kernel.py's SOURCE) is compiled with the host
C++ compiler behind conftest.CUDA_HOST_SHIM (``__global__`` a plain function, the ``_rn`` intrinsics
as IEEE float/double operations, ``__fmaf_rn`` as ``std::fmaf``, ``-ffp-contract=off`` so that
nothing else is fused) and launched block by block, thread by thread (thread 0 first, which is all that the
kernel's one ``__syncthreads`` needs; a ``float4`` is four floats, so the 16-byte path runs too). A stand-in for CuPy hands it host arrays, so the launcher's
pointer tables, chunk table and argument marshalling run exactly as on the GPU. The comparison with
the NumPy reference is tests/test_gpu_fused_update.py's. Skipped without a C++ compiler.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import types

import numpy as np
import pytest
from conftest import CUDA_HOST_SHIM
from test_gpu_fused_update import SHAPES, _group, compare_kernel_with_reference
from test_optimizer import CASES

import runtime.gpu.cuda as gpu_cuda
import runtime.gpu.update_kernel as fused

CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")

LAUNCHERS = r"""
template <class F, class... A> static void run(F f, int grid, int block, A... a) {
    blockDim.x = block;
    for (int b = 0; b < grid; ++b) {
        blockIdx.x = b;
        for (int t = 0; t < block; ++t) { threadIdx.x = t; f(a...); }
    }
}
typedef const long long* P;
typedef const float* F;
extern "C" void launch_fused_sgd(int g, int b, P t, P c, F lr, float wd, int use_wd, long long chunk) {
    run(fused_sgd, g, b, t, c, lr, wd, use_wd, chunk);
}
extern "C" void launch_fused_momentum(int g, int b, P t, P c, F lr, float wd, int use_wd, float mu, int nesterov,
                                      long long chunk) {
    run(fused_momentum, g, b, t, c, lr, wd, use_wd, mu, nesterov, chunk);
}
extern "C" void launch_fused_adam(int g, int b, P t, P c, F lr, F step, double beta1, double beta2, double wd,
                                  float w, float w1, float omb2, float b2, float eps, float wd_f, int mode,
                                  long long chunk) {
    run(fused_adam, g, b, t, c, lr, step, beta1, beta2, wd, w, w1, omb2, b2, eps, wd_f, mode, chunk);
}
"""


# The table writer of an update inside a session (update_kernel.TABLE_SOURCE) and its launcher.
TABLE_LAUNCHER = ("extern \"C\" void launch_write_table(int g, int b, long long* d, int n, "
                  + ", ".join(f"long long a{k}" for k in range(fused.TABLE_ARGS)) + ") {\n    run(write_table, g, b, d, n, "
                  + ", ".join(f"a{k}" for k in range(fused.TABLE_ARGS)) + ");\n}\n")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kernel")
    source = directory / "kernel.cpp"
    source.write_text(CUDA_HOST_SHIM + fused.SOURCE + fused.TABLE_SOURCE + LAUNCHERS + TABLE_LAUNCHER)
    target = directory / "kernel.so"
    subprocess.run([CXX, "-std=c++14", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(target), str(source)],
                   check=True, capture_output=True)
    return ctypes.CDLL(str(target))


class _Pointer:
    def __init__(self, ptr: int):
        self.ptr = ptr


class HostArray(np.ndarray):
    """A NumPy array with CuPy's ``.data.ptr``."""

    @property
    def data(self):  # noqa: D401 - CuPy's MemoryPointer, as far as the launcher uses it
        return _Pointer(self.ctypes.data)


def _as_c(value):
    if isinstance(value, np.ndarray):
        return ctypes.c_void_p(value.ctypes.data)
    if isinstance(value, np.float32):
        return ctypes.c_float(value)
    if isinstance(value, np.float64):
        return ctypes.c_double(value)
    if isinstance(value, np.int32):
        return ctypes.c_int(value)
    if isinstance(value, np.int64):
        return ctypes.c_longlong(value)
    raise TypeError(f"kernel argument of type {type(value).__name__}: CuPy would not pass it as the kernel expects")


def host_cupy(library):
    """The part of CuPy that FusedUpdateRunner and the comparison use, on host memory."""

    def asarray(array):
        return np.ascontiguousarray(array).view(HostArray)

    class RawModule:
        def __init__(self, code: str, options=()):
            assert code in (fused.SOURCE, fused.TABLE_SOURCE)

        def get_function(self, name: str):
            launcher = getattr(library, f"launch_{name}")

            def call(grid, block, args):
                launcher(ctypes.c_int(grid[0]), ctypes.c_int(block[0]), *(_as_c(a) for a in args))

            return call

    stream = types.SimpleNamespace(synchronize=lambda: None, is_capturing=lambda: False)
    cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0), get_current_stream=lambda: stream)
    return types.SimpleNamespace(asarray=asarray, asnumpy=np.asarray, RawModule=RawModule, cuda=cuda,
                                 empty_like=lambda a: np.empty_like(a).view(HostArray),
                                 empty=lambda shape, dtype: np.empty(shape, dtype).view(HostArray))


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_source_on_the_host_matches_the_reference(case, library, monkeypatch):
    monkeypatch.setattr(gpu_cuda, "_MODULES", {})  # never mix the host module with a real GPU's
    compare_kernel_with_reference(host_cupy(library), case)


@pytest.mark.parametrize("grads", ["bfloat16", "bfloat16 as float32"])
@pytest.mark.parametrize("case", ["adamw", "momentum_wd", "sgd_wd"])
def test_kernel_source_on_the_host_reads_bfloat16_gradients(case, grads, library, monkeypatch):
    monkeypatch.setattr(gpu_cuda, "_MODULES", {})
    compare_kernel_with_reference(host_cupy(library), case, grads)


@pytest.mark.parametrize("case", ["adamw", "momentum_wd", "sgd_wd"])
def test_kernel_source_on_the_host_inside_a_session(case, library, monkeypatch):
    """The launch inside a session: the table written by its kernel from each call's pointers,
    half the state in place."""
    monkeypatch.setattr(gpu_cuda, "_MODULES", {})
    compare_kernel_with_reference(host_cupy(library), case, "bfloat16", inside=True)


def test_the_table_writer_runs_when_its_entries_change_or_once_a_capture_holds_it(library, monkeypatch):
    """Inside a session the update's table is written on the stream before each launch, but an
    uncaptured call whose pointers are those of the last write skips it, until a capture holds
    the writer (its replays write the table too)."""
    from runtime.gpu.update_kernel import FusedUpdateRunner

    monkeypatch.setattr(gpu_cuda, "_MODULES", {})
    cp = host_cupy(library)
    writes = []
    module = cp.RawModule

    class Counting(module):
        def get_function(self, name):
            function = super().get_function(name)
            return (lambda *a: (writes.append(1), function(*a))) if name == "write_table" else function

    capturing = [False]
    cp.RawModule = Counting
    cp.cuda.get_current_stream = lambda: types.SimpleNamespace(is_capturing=lambda: capturing[0])
    group, ops = _group(CASES["sgd_wd"].validate())
    runner = FusedUpdateRunner(group, "test", types.SimpleNamespace(cp=cp))
    shape_of = {name: shape for op, shape in zip(ops, SHAPES) for name in op.tensors_in}
    feeds = {name: cp.asarray(np.ones(shape_of.get(name, ()), np.float32)) for name in group.inputs}
    outputs = lambda: {o: cp.empty_like(feeds[op.param]) for op in ops for o in op.outputs}  # noqa: E731
    values = {**feeds, **outputs()}
    runner.launch(values, allocate=True)
    runner.launch(values, allocate=False)
    assert len(writes) == 1  # the same pointers: the table stands
    values = {**feeds, **outputs()}
    runner.launch(values, allocate=False)
    assert len(writes) == 2  # new buffers: written again
    capturing[0] = True
    runner.launch(values, allocate=False)
    capturing[0] = False
    runner.launch(values, allocate=False)
    assert len(writes) == 4  # a capture holds the writer: every call writes from then on
