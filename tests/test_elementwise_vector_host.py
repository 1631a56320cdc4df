"""runtime/gpu/elementwise.py's vectorized kernel, compiled for the host and run on CPU.

No GPU here, so ``vector_source``'s kernel is compiled with the host C++ compiler behind
conftest.CUDA_HOST_SHIM (``__global__`` a plain function, the ``_rn`` intrinsics as IEEE float
operations, ``-ffp-contract=off``) and launched block by block, thread by thread, on grids of several shapes:
one thread or many, a grid-stride loop that runs once or several times, a stride that is not a
multiple of the row input's length. The reference is the node's own ``code`` (CuPy's
ElementwiseKernel body: the same statements) run element by element; the two must agree bit for
bit, float32 and bf16. Skipped without a C++ compiler.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from conftest import CUDA_HOST_SHIM, one_graph_model
from onnx import TensorProto, helper

from runtime.gpu.elementwise import input_kinds, vector_source
from runtime.gpu.elementwise_fusion import fuse_elementwise
from runtime.gpu.elementwise_steps import CUPY_DTYPES, DOMAIN, PREAMBLE, fused_types

CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")


def _gelu_model(dtype: int):
    """GELU(x + bias) as an exporter writes it, in float32 or (``dtype`` bf16) between the casts
    of --precision bf16: x [batch, 3, 16] (a symbolic batch: elementwise_fusion leaves small static
    clusters to onnxruntime), bias [16]."""
    f = TensorProto.FLOAT
    nodes, x = [], "x"
    if dtype == TensorProto.BFLOAT16:
        nodes.append(helper.make_node("Cast", ["x"], ["xw"], to=f))
        x = "xw"
    nodes += [helper.make_node("Add", [x, "bias"], ["h"]),
              helper.make_node("Div", ["h", "sqrt2"], ["d"]),
              helper.make_node("Erf", ["d"], ["e"]),
              helper.make_node("Add", ["e", "one"], ["e1"]),
              helper.make_node("Mul", ["h", "e1"], ["m"]),
              helper.make_node("Mul", ["m", "half"], ["g"])]
    out = "g"
    if dtype == TensorProto.BFLOAT16:
        nodes.append(helper.make_node("Cast", ["g"], ["gb"], to=TensorProto.BFLOAT16))
        out = "gb"
    inits = [helper.make_tensor("sqrt2", f, [], [1.4142135]), helper.make_tensor("one", f, [], [1.0]),
             helper.make_tensor("half", f, [], [0.5])]
    model = one_graph_model(nodes, [helper.make_tensor_value_info("x", dtype, ["batch", 3, 16]),
                                    helper.make_tensor_value_info("bias", f, [16])],
                            [helper.make_tensor_value_info(out, dtype, ["batch", 3, 16])], inits)
    fused = [n for n in fuse_elementwise(model, bfloat16=dtype == TensorProto.BFLOAT16).graph.node if n.domain == DOMAIN]
    assert len(fused) == 1, [n.op_type for n in fused]
    return fused[0]


def _scalar_source(node, kinds) -> str:
    """The node's ``code`` (x{i} and y{j} scalars) for every element in turn."""
    ins, outs = (tuple(CUPY_DTYPES[t] for t in types) for types in fused_types(node))
    c = {np.dtype(np.float32): "float", np.dtype(np.uint16): "unsigned short"}
    code = next(a.s.decode() for a in node.attribute if a.name == "code")
    params = [f"const {c[t]}* in{i}" for i, t in enumerate(ins)] + [f"{c[t]}* out{j}" for j, t in enumerate(outs)]
    reads = [f"const {c[t]} x{i} = in{i}[{'e' if k == 'full' else f'e % {m}' if k == 'row' else '0'}];"
             for i, (t, k, m) in enumerate(zip(ins, kinds, [f"m{i}" for i in range(len(ins))]))]
    params += ["long long n", *(f"long long m{i}" for i, k in enumerate(kinds) if k == "row")]
    body = " ".join(reads + [f"{c[t]} y{j};" for j, t in enumerate(outs)] + [code]
                    + [f"out{j}[e] = y{j};" for j in range(len(outs))])
    return f'extern "C" void scalar({", ".join(params)}) {{ for (long long e = 0; e < n; ++e) {{ {body} }} }}\n'


LAUNCHER = r"""
extern "C" void launch(int grid, int block, void** a, int count) {
    blockDim.x = block; gridDim.x = grid;
    for (int b = 0; b < grid; ++b) {
        blockIdx.x = b;
        for (int t = 0; t < block; ++t) {
            threadIdx.x = t;
            CALL;
        }
    }
}
"""


def _library(tmp_path, node, kinds):
    ins, outs = fused_types(node)
    params = len(ins) + len(outs)
    rows = sum(k == "row" for k in kinds)
    c = {np.dtype(np.float32): "float", np.dtype(np.uint16): "unsigned short"}
    types = [c[CUPY_DTYPES[t]] for t in ins] + [c[CUPY_DTYPES[t]] for t in outs]
    args = [f"({'const ' if i < len(ins) else ''}{t}*)a[{i}]" for i, t in enumerate(types)]
    args += [f"*(long long*)a[{params + k}]" for k in range(1 + rows)]
    source = (CUDA_HOST_SHIM + PREAMBLE + vector_source(node, kinds, "k")
              + _scalar_source(node, kinds) + LAUNCHER.replace("CALL", f"k({', '.join(args)})"))
    (tmp_path / "k.cpp").write_text(source)
    target = tmp_path / "k.so"
    done = subprocess.run([CXX, "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(target),
                           str(tmp_path / "k.cpp")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return ctypes.CDLL(str(target))


SHAPE = (5, 3, 16)


@pytest.fixture(scope="module", params=[TensorProto.FLOAT, TensorProto.BFLOAT16], ids=["float32", "bf16"])
def compiled(request, tmp_path_factory):
    """(the fused GELU node, its kernels compiled for the host), once per element type."""
    node = _gelu_model(request.param)
    kinds = input_kinds([SHAPE, (16,)], SHAPE)
    assert kinds == ("full", "row")
    return request.param, node, _library(tmp_path_factory.mktemp("vector"), node, kinds)


@pytest.mark.parametrize("grid, block", [(1, 1), (2, 3), (3, 4), (5, 7), (64, 32)])
def test_the_vectorized_kernel_computes_every_element_as_the_node_s_code_on_any_grid(compiled, grid, block):
    dtype, node, library = compiled
    shape = SHAPE
    rng = np.random.default_rng(grid * 100 + block)
    x = rng.uniform(-4, 4, size=shape).astype(np.float32)
    if dtype == TensorProto.BFLOAT16:
        x = (x.view(np.uint32) >> 16).astype(np.uint16)
    bias = rng.uniform(-1, 1, size=16).astype(np.float32)
    out_type = CUPY_DTYPES[fused_types(node)[1][0]]
    got, want = np.zeros(shape, out_type), np.zeros(shape, out_type)
    n4, m = np.array(x.size // 4, np.int64), np.array(16, np.int64)
    assert all(a.ctypes.data % 16 == 0 for a in (x, bias, got))  # as the runner checks before it launches
    pointers = (ctypes.c_void_p * 5)(x.ctypes.data, bias.ctypes.data, got.ctypes.data, n4.ctypes.data, m.ctypes.data)
    library.launch(ctypes.c_int(grid), ctypes.c_int(block), pointers, ctypes.c_int(5))
    library.scalar(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(bias.ctypes.data), ctypes.c_void_p(want.ctypes.data),
                   ctypes.c_longlong(x.size), ctypes.c_longlong(16))
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (grid, block)
    assert want.any()
