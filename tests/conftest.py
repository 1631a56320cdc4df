"""Shared fixtures: built-in models generated once per session, and comparison helpers."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process that runs this checkout: the repository first on
    PYTHONPATH, whatever was there kept after it (a GPU host's onnxruntime-gpu lives there)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """``model_dir(name)`` -> directory holding the generated model.onnx and data.npz."""
    import models

    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            models.generate(name, out, seed=0, rows=256)
            cache[name] = out
        return cache[name]

    return get


def load_data(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as npz:
        return {k: npz[k] for k in npz.files}


def max_rel_error(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> float:
    """Largest over parameters of max|a - e| / max|e|: relative to each parameter's scale, so
    elements that happen to be near zero do not blow the measure up."""
    assert actual.keys() == expected.keys()
    worst = 0.0
    for name, e in expected.items():
        a = actual[name]
        assert a.shape == e.shape and a.dtype == e.dtype, name
        scale = float(np.max(np.abs(e))) or 1.0
        worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - e.astype(np.float64)))) / scale)
    return worst


def assert_replicas_identical(parameters: list[dict[str, np.ndarray]]) -> None:
    """Every rank's trained values equal rank 0's bit for bit (``SimResult.parameters``, one dict per rank)."""
    for r, values in enumerate(parameters[1:], start=1):
        assert values.keys() == parameters[0].keys(), f"rank {r}"
        for name, value in parameters[0].items():
            np.testing.assert_array_equal(values[name], value, err_msg=f"rank {r} {name}")


def initial_parameters(model_path: Path) -> dict[str, np.ndarray]:
    """The float initializers of an ONNX model, by name."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(model_path)
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return {k: v for k, v in arrays.items() if v.dtype.kind == "f"}


@pytest.fixture(scope="session")
def gpt_train(tmp_path_factory):
    """The single-device training graph (train.onnx, AdamW) of the built-in small GPT, and the feeds
    of one step: 4 rows of its data, its initial state from train_init.onnx, lr 1e-3."""
    import onnx
    import onnxruntime as ort

    import models
    from transpiler import OptimizerConfig, Options, transpile

    tmp = tmp_path_factory.mktemp("gpt_train")
    models.generate("gpt", tmp / "model", seed=0, rows=8)
    transpile(tmp / "model" / "model.onnx", tmp / "out", Options(optimizer=OptimizerConfig("adamw")))
    model = onnx.load(str(tmp / "out" / "train.onnx"))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    init = ort.InferenceSession(str(tmp / "out" / "train_init.onnx"), options, providers=["CPUExecutionProvider"])
    state = dict(zip([o.name for o in init.get_outputs()], init.run(None, {})))
    data = load_data(tmp / "model" / "data.npz")
    feeds = {**{k: v[:4] for k, v in data.items()}, **state, "lr": np.array(1e-3, np.float32)}
    return model, {i.name: feeds[i.name] for i in model.graph.input}


def cpu_and_gpu_losses(out, data: Path, *, batch: int, steps: int) -> dict[str, np.ndarray]:
    """Per-step losses of ``steps`` steps of OUT on the CPU backend and on one GPU (TF32 off)."""
    from graph_transpiler import train

    losses = {}
    for backend in ("cpu", "nccl"):
        seen: list = []
        train(out, data, batch=batch, steps=steps, log_every=1, backend=backend, no_tf32=True, callback=seen.append,
              verbose=False)
        losses[backend] = np.array([r["loss"] for r in seen])
    return losses


def first_and_bound_run(runner, feeds: dict, device) -> tuple:
    """A one-output GPU runner's output from its first call, then from a bound run (parity 1) into a
    zeroed buffer of its own: a test checks both."""
    (first,) = runner.run(feeds)
    device.compute.synchronize()
    out = device.cp.zeros(first.shape, dtype=first.dtype)
    runner.prepare(1, {runner.outputs[0]: out})
    runner.run_bound(1, feeds)
    device.compute.synchronize()
    return first, out


def spacing(values: np.ndarray, mantissa: int) -> np.ndarray:
    """The distance between neighbouring numbers of a float type with ``mantissa`` stored bits
    (bfloat16 7, float16 10) at ``values``, in their normal range: what one rounding may move."""
    _, exponent = np.frexp(np.abs(values).astype(np.float64))
    return np.ldexp(1.0, exponent - 1 - mantissa)


def one_graph_model(nodes, inputs, outputs, inits=(), opset: int = 18):
    """A model of one graph (the default domain at ``opset``, IR version 8 as onnxruntime reads it)."""
    from onnx import helper

    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


# CUDA source compiled for the host (tests/test_fused_update_host.py, test_elementwise_vector_host.py):
# ``__global__`` and ``__device__`` plain functions, the thread indices globals a launcher sets, the
# vector types with CUDA's alignments, the ``_rn`` intrinsics as IEEE operations (compile with
# -ffp-contract=off, so nothing else is fused) and the math library in the global namespace.
CUDA_HOST_SHIM = r"""
#include <cmath>
#include <cstring>
#include <math.h>
struct Dim3 { unsigned x, y, z; };
static Dim3 threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads() ((void)0)
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) ushort4 { unsigned short x, y, z, w; };
struct alignas(4) uchar4 { unsigned char x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return std::sqrt(a); }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __dsqrt_rn(double a) { return std::sqrt(a); }
using std::pow;
using std::fabs;
"""


def with_a_body_reading(model, name: str):
    """``model`` with an If whose two branches read ``name`` (a float32 value) from the outer scope
    (an Identity of it, the If's output a graph output): for the rewrites, which must not drop a
    value a body reads."""
    from onnx import TensorProto, helper

    def branch(label: str):
        return helper.make_graph([helper.make_node("Identity", [name], [f"{label}_y"])], label, [],
                                 [helper.make_tensor_value_info(f"{label}_y", TensorProto.FLOAT, None)])

    model.graph.input.append(helper.make_tensor_value_info("body_flag", TensorProto.BOOL, []))
    model.graph.node.append(helper.make_node("If", ["body_flag"], ["body_picked"], then_branch=branch("then"),
                                             else_branch=branch("else")))
    model.graph.output.append(helper.make_tensor_value_info("body_picked", TensorProto.FLOAT, None))
    return model


def refresh_manifest(directory: Path) -> None:
    """Make a checkpoint's manifest match its (edited) rank files, as a careful forger would."""
    import hashlib
    import json

    raw = json.loads((directory / "meta.json").read_text())
    for name in raw["files"]:
        blob = (directory / name).read_bytes()
        raw["files"][name] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (directory / "meta.json").write_text(json.dumps(raw))


# The quick subset, ``pytest -m "not slow"`` (README): it leaves out what takes seconds per test on
# 2 cores: the tests that start MPI jobs or ``transpile run`` processes (the CLI's error and safety
# contracts), and those that export and train PyTorch / Hugging Face models at parity.
SLOW_MODULES = {"test_zoo", "test_torch_oracle", "test_models_real", "test_trainable_exports", "test_digits",
                "test_opsets", "test_grad_accumulation", "test_cli_errors", "test_cli_safety", "test_faults"}
SLOW_TESTS = {"test_compare_end_to_end_on_cpu", "test_the_harness_on_cpu_ranks"}


def pytest_collection_modifyitems(items):
    for item in items:
        if (item.module.__name__ in SLOW_MODULES or item.originalname in SLOW_TESTS
                or item.get_closest_marker("mpi")):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def cupy_kernels():
    """CuPy on the first CUDA device (the test skips without CuPy or a device) and ``runner(node)``:
    the ElementwiseRunner of one fused node, on a stream of its own as the backend's compute stream."""
    from types import SimpleNamespace

    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception:
        pytest.skip("no CUDA device")
    from runtime.gpu.elementwise import ElementwiseRunner
    from runtime.segments import NativeGroup

    backend = SimpleNamespace(cp=cp, compute=cp.cuda.Stream())

    def runner(node):
        return ElementwiseRunner(NativeGroup(0, 0, 1, (node,), tuple(node.input), tuple(node.output)), "test", backend)

    return SimpleNamespace(cp=cp, runner=runner)
