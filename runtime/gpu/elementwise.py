"""Elementwise fusion, the runner: the fused nodes of elementwise_fusion.py (its module docstring
says which nodes fuse and why) run as CuPy kernels on the backend's compute stream, each node's
``code`` attribute (the kernel body its steps give) as one ElementwiseKernel, and the relu mask of
``fuse_relu_masks`` as a RawKernel with 16-byte loads.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from runtime.errors import RunError
from runtime.executor import LaunchRunner
from runtime.gpu.cuda import compiled_module
from runtime.gpu.elementwise_steps import CUPY_DTYPES, DOMAIN, PREAMBLE, RELU_MASK, fused_steps, fused_types
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


class ElementwiseRunner(LaunchRunner):
    """A NativeGroup of fused elementwise nodes: one CuPy ElementwiseKernel launch per node on the
    backend's compute stream; the interface of OrtCudaSegment (``run`` on the first call, then
    ``prepare`` per parity and ``run_bound``)."""

    def __init__(self, group, where: str, backend):
        super().__init__(group.outputs)
        self.cp = backend.cp
        self.stream = backend.compute
        self.where = f"{where}: fused elementwise nodes in {place(group)}"
        self.kernels: list[tuple[onnx.NodeProto, Any]] = []
        cache: dict[tuple, Any] = {}
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
            self.kernels.append((node, cache[key]))

    def launch(self, values, allocate: bool) -> None:
        with self.stream:
            for node, kernel in self.kernels:
                args = [values[name] for name in node.input]
                try:
                    if allocate and not all(name in values for name in node.output):  # given: in_session.py
                        result = kernel(*args)
                        values.update(zip(node.output, result if isinstance(result, tuple) else (result,)))
                    else:
                        kernel(*args, *[values[name] for name in node.output])
                except Exception as exc:  # CuPy's broadcast/dtype errors name no node
                    raise RunError(f"{self.where}: '{node.name}': {str(exc).splitlines()[0]}") from None

