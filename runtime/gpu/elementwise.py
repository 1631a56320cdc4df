"""Elementwise fusion, the runner: the fused nodes of elementwise_fusion.py (its module docstring
says which nodes fuse and why) run as CuPy kernels on the backend's compute stream, and the relu
mask of ``fuse_relu_masks`` as a RawKernel with 16-byte loads.

A fused node runs as a RawKernel of four elements per thread and one vector load per input
(``_Vectorized``: 16 bytes of float32, 8 of bfloat16) where every input is the output's shape, a
scalar, or a row the output repeats (a bias: the output's trailing dimensions), all contiguous,
aligned, and the counts multiples of four; anywhere else, as CuPy's ElementwiseKernel of its
``code`` attribute, which takes any broadcast. Both run the same statements per element
(elementwise_steps.cuda_statements), so the choice changes speed, not results.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from runtime.errors import RunError
from runtime.executor import LaunchRunner
from runtime.gpu.cuda import compiled_module
from runtime.gpu.elementwise_steps import (
    BOOL,
    CUPY_DTYPES,
    DOMAIN,
    PREAMBLE,
    RELU_MASK,
    cuda_statements,
    fused_steps,
    fused_types,
)
from runtime.segments import place


def _is_relu_mask(node: onnx.NodeProto) -> bool:
    return [op_type for op_type, _ in fused_steps(node)[0]] == [RELU_MASK]


_RELU_MASK_SOURCE = r"""
extern "C" __global__ void relu_mask4(const float4* __restrict__ y, const float4* __restrict__ dy,
                                      float4* __restrict__ out, long long n4) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        const float4 a = y[i], g = dy[i];
        out[i] = make_float4(a.x > 0.f ? g.x : 0.f, a.y > 0.f ? g.y : 0.f, a.z > 0.f ? g.z : 0.f, a.w > 0.f ? g.w : 0.f);
    }
}
extern "C" __global__ void relu_mask1(const float* __restrict__ y, const float* __restrict__ dy,
                                      float* __restrict__ out, long long start, long long n) {
    for (long long i = start + blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = y[i] > 0.f ? dy[i] : 0.f;
}
"""


class _ReluMaskKernel:
    """The relu-mask step (``y > 0 ? dy : 0``) as a RawKernel with 16-byte loads: CuPy's
    ElementwiseKernel took 43 us per ResNet-18 call where PyTorch's threshold_backward takes 24
    (one H200, run h200-s20). Called as an ElementwiseKernel is: (y, dy) returns the result (the
    runner's first call: inputs checked to be contiguous float32 of one shape), (y, dy, out) writes
    it (bound runs: the program's buffers, of the first call's shapes)."""

    THREADS = 256

    def __init__(self, cp):
        self.cp = cp
        module = compiled_module(cp, _RELU_MASK_SOURCE)
        self.vector, self.scalar = module.get_function("relu_mask4"), module.get_function("relu_mask1")
        self.blocks = 4 * cp.cuda.Device().attributes["MultiProcessorCount"]

    def __call__(self, y, dy, out=None):
        if out is None:
            if y.shape != dy.shape or y.dtype != np.float32 or dy.dtype != np.float32 or not (
                    y.flags.c_contiguous and dy.flags.c_contiguous):
                raise ValueError(f"relu mask: y {y.dtype} {y.shape} and dy {dy.dtype} {dy.shape} must be contiguous "
                                 "float32 of one shape")
            out = self.cp.empty_like(dy)
        n = y.size
        start = 0
        if all(a.data.ptr % 16 == 0 for a in (y, dy, out)):
            start = n - n % 4
            if start:
                grid = min(self.blocks, -(-(start // 4) // self.THREADS))
                self.vector((grid,), (self.THREADS,), (y, dy, out, np.int64(start // 4)))
        if start < n:
            grid = min(self.blocks, -(-(n - start) // self.THREADS))
            self.scalar((grid,), (self.THREADS,), (y, dy, out, np.int64(start), np.int64(n)))
        return out


_LANES = ("x", "y", "z", "w")
# Per element type: the C type of a pointer to it and of four of them in one load.
_VECTORS = {np.dtype(np.float32): ("float", "float4"), np.dtype(np.uint16): ("unsigned short", "ushort4"),
            np.dtype(np.bool_): ("bool", "uchar4")}


def vector_source(node: onnx.NodeProto, kinds: tuple[str, ...], name: str) -> str:
    """The kernel ``name`` computing ``node`` four elements per thread; ``kinds[i]`` says how input i
    is read: "full" (the output's shape), "scalar" (one element) or "row" (the output's trailing
    dimensions, repeated: element ``i % m{i}``)."""
    steps, results = fused_steps(node)
    ins, outs = fused_types(node)
    scalar = [_VECTORS[CUPY_DTYPES[t]][0] for t in ins]
    params = [f"const {c}* __restrict__ x{i}" for i, c in enumerate(scalar)]
    params += [f"{_VECTORS[CUPY_DTYPES[t]][0]}* __restrict__ y{j}" for j, t in enumerate(outs)]
    params += ["long long n4", *(f"long long m{i}" for i, kind in enumerate(kinds) if kind == "row")]
    lines = []
    for i, kind in enumerate(kinds):
        if kind == "scalar":
            lines.append(f"const {scalar[i]} s{i} = x{i}[0];")
        else:
            vector = _VECTORS[CUPY_DTYPES[ins[i]]][1]
            lines.append(f"const {vector} a{i} = *reinterpret_cast<const {vector}*>(x{i} + {'i' if kind == 'full' else f'i % m{i}'});")
    lines += [f"{_VECTORS[CUPY_DTYPES[t]][1]} o{j};" for j, t in enumerate(outs)]
    for lane in _LANES:
        lines += cuda_statements(steps, results, ins, outs, x=lambda i, lane=lane: f"s{i}" if kinds[i] == "scalar" else f"a{i}.{lane}",
                                 t=lambda k, lane=lane: f"t{k}{lane}", y=lambda j, lane=lane: f"o{j}.{lane}")
    lines += [f"*reinterpret_cast<{_VECTORS[CUPY_DTYPES[t]][1]}*>(y{j} + i) = o{j};" for j, t in enumerate(outs)]
    body = "\n        ".join(lines)
    return (f'extern "C" __global__ void {name}({", ".join(params)}) {{\n'
            "    for (long long v = blockIdx.x * (long long)blockDim.x + threadIdx.x; v < n4; "
            "v += (long long)gridDim.x * blockDim.x) {\n"
            f"        const long long i = v * 4;\n        {body}\n    }}\n}}\n")


def input_kinds(shapes: list[tuple[int, ...]], shape: tuple[int, ...]) -> tuple[str, ...] | None:
    """How each input of ``shapes`` is read by the vectorized kernel of output ``shape``
    (``vector_source``), or None where one fits none of its kinds or a count is not a multiple of 4."""
    size = int(np.prod(shape, dtype=np.int64))
    if size == 0 or size % 4:
        return None
    kinds = []
    for dims in shapes:
        count = int(np.prod(dims, dtype=np.int64))
        core = tuple(dims)
        while core and core[0] == 1:
            core = core[1:]
        if count == size:
            kinds.append("full")
        elif count == 1:
            kinds.append("scalar")
        elif core and count % 4 == 0 and tuple(shape[len(shape) - len(core):]) == core:
            kinds.append("row")
        else:
            return None
    return tuple(kinds)


class _Vectorized:
    """A fused node's vectorized kernels, one per input layout seen (the module docstring)."""

    THREADS = 256

    def __init__(self, cp, node: onnx.NodeProto, name: str):
        self.cp, self.node, self.name = cp, node, name
        self.usable = all(t != BOOL for t in fused_types(node)[1])  # no bool outputs (none is written today)
        self.layouts: dict[tuple, tuple[str, ...] | None] = {}
        self.functions: dict[tuple[str, ...], object] = {}
        # Enough blocks for every SM's full 2,048 threads: a memory-bound kernel needs the bytes in
        # flight (four blocks an SM, half of that, left GPT-2-small's 107 fused kernels at 1.78 ms).
        self.blocks = 8 * cp.cuda.Device().attributes["MultiProcessorCount"]

    def __call__(self, args: list, outs: list) -> bool:
        """Launch on ``args`` into ``outs`` (the output's shape) if the layout allows; whether it did."""
        if not self.usable:
            return False
        shape = tuple(outs[0].shape)
        key = (shape, *(tuple(a.shape) for a in args))
        if key not in self.layouts:
            self.layouts[key] = input_kinds([tuple(a.shape) for a in args], shape)
        kinds = self.layouts[key]
        if kinds is None or not all(a.flags.c_contiguous for a in (*args, *outs)):
            return False
        if any(a.data.ptr % (4 * a.itemsize) for a, kind in zip(args, kinds) if kind != "scalar") or any(
                o.data.ptr % (4 * o.itemsize) for o in outs):
            return False
        if kinds not in self.functions:
            source = PREAMBLE + vector_source(self.node, kinds, self.name)
            self.functions[kinds] = compiled_module(self.cp, source).get_function(self.name)
        n4 = outs[0].size // 4
        rows = [np.int64(a.size) for a, kind in zip(args, kinds) if kind == "row"]
        grid = max(1, min(self.blocks, -(-n4 // self.THREADS)))
        self.functions[kinds]((grid,), (self.THREADS,), (*args, *outs, np.int64(n4), *rows))
        return True


class ElementwiseRunner(LaunchRunner):
    """A NativeGroup of fused elementwise nodes: one CuPy ElementwiseKernel launch per node on the
    backend's compute stream; the interface of OrtCudaSegment (``run`` on the first call, then
    ``prepare`` per parity and ``run_bound``)."""

    def __init__(self, group, where: str, backend):
        super().__init__(group.outputs)
        self.cp = backend.cp
        self.stream = backend.compute
        self.where = f"{where}: fused elementwise nodes in {place(group)}"
        self.kernels: list[tuple[onnx.NodeProto, Any, _Vectorized | None]] = []
        cache: dict[tuple, Any] = {}
        vectors: dict[tuple, _Vectorized] = {}
        for node in group.nodes:
            if node.domain != DOMAIN:
                raise RunError(f"{self.where}: node '{node.name}' ({node.domain}::{node.op_type}) is not a fused elementwise node")
            code = next(a.s.decode() for a in node.attribute if a.name == "code")
            ins, outs = ([CUPY_DTYPES[t].name for t in types] for types in fused_types(node))
            key = (code, tuple(ins), tuple(outs))
            if _is_relu_mask(node):
                key = RELU_MASK
                if key not in cache:
                    cache[key] = _ReluMaskKernel(self.cp)
            if key not in cache:
                params_in = ", ".join(f"{t} x{i}" for i, t in enumerate(ins))
                params_out = ", ".join(f"{t} y{j}" for j, t in enumerate(outs))
                cache[key] = self.cp.ElementwiseKernel(params_in, params_out, code, f"fused_elementwise_{len(cache)}",
                                                       preamble=PREAMBLE)
                vectors[key] = _Vectorized(self.cp, node, f"fused_vector_{len(vectors)}")
            self.kernels.append((node, cache[key], vectors.get(key)))

    def launch(self, values, allocate: bool) -> None:
        cp = self.cp
        with self.stream:
            for node, kernel, vectorized in self.kernels:
                args = [values[name] for name in node.input]
                try:
                    if allocate and not all(name in values for name in node.output):  # given: in_session.py
                        if vectorized is None:  # the relu mask's kernel checks its inputs and allocates
                            values[node.output[0]] = kernel(*args)
                            continue
                        shape = np.broadcast_shapes(*(tuple(a.shape) for a in args))
                        values.update((name, cp.empty(shape, CUPY_DTYPES[t]))
                                      for name, t in zip(node.output, fused_types(node)[1]))
                    outs = [values[name] for name in node.output]
                    if vectorized is None or not vectorized(args, outs):
                        kernel(*args, *outs)
                except Exception as exc:  # CuPy's broadcast/dtype errors name no node
                    raise RunError(f"{self.where}: '{node.name}': {str(exc).splitlines()[0]}") from None

