"""The LayerNorm gradient on the GPU: ``graph_transpiler.layernorm::LayerNormGrad`` nodes
(transpiler/layernorm_ops.py, docs/contracts.md) run as two CuPy RawKernel launches each.

Why: the node's function in standard ops is about 13 onnxruntime kernels, each a pass over the
activation (onnxruntime fuses none of them); PyTorch runs two (``layer_norm_grad_input`` and
``GammaBetaBackward``), and so does this.

Kernels (float32, X viewed as R rows of C):
- ``layer_norm_grad_input``: one block per row. A first pass sums g = dY * scale and g * xhat over
  the row (warp shuffles, then one warp over the warps' sums), a second writes
  dX = inv * (g - sum(g) / C - xhat * sum(g * xhat) / C), re-reading the row (from L1/L2).
- ``layer_norm_grad_params``: one block of 32 x 32 threads per 32 columns; each thread sums every
  32nd row of its column, then one row of threads sums the 32 partial sums in a fixed order.
Both are deterministic: the same inputs give the same bits on every run.

Interface: OrtCudaSegment's, through ``LaunchRunner`` (``run`` allocates the outputs on the first
call, whose shapes every bound call keeps; then ``prepare`` and ``run_bound``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from contract.ops import LAYERNORM_GRAD
from runtime.errors import RunError
from runtime.gpu.kernel_runner import RawKernelRunner

SOURCE = r"""
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

extern "C" __global__ void layer_norm_grad_input(const float* __restrict__ dy, const float* __restrict__ x,
                                                 const float* __restrict__ scale, const float* __restrict__ mean,
                                                 const float* __restrict__ inv, float* __restrict__ dx, int C) {
    __shared__ float s_g[32], s_gx[32];
    const long long row = blockIdx.x;
    const float* dy_row = dy + row * C;
    const float* x_row = x + row * C;
    const float mu = mean[row], rs = inv[row];
    float sum_g = 0.f, sum_gx = 0.f;
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        const float g = dy_row[j] * scale[j];
        sum_g += g;
        sum_gx += g * ((x_row[j] - mu) * rs);
    }
    sum_g = warp_sum(sum_g);
    sum_gx = warp_sum(sum_gx);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    if (lane == 0) { s_g[warp] = sum_g; s_gx[warp] = sum_gx; }
    __syncthreads();
    if (warp == 0) {
        sum_g = warp_sum(lane < warps ? s_g[lane] : 0.f);
        sum_gx = warp_sum(lane < warps ? s_gx[lane] : 0.f);
        if (lane == 0) { s_g[0] = sum_g; s_gx[0] = sum_gx; }
    }
    __syncthreads();
    const float mean_g = s_g[0] / (float)C, mean_gx = s_gx[0] / (float)C;
    float* dx_row = dx + row * C;
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        const float xhat = (x_row[j] - mu) * rs;
        dx_row[j] = (dy_row[j] * scale[j] - mean_g - xhat * mean_gx) * rs;
    }
}

extern "C" __global__ void layer_norm_grad_params(const float* __restrict__ dy, const float* __restrict__ x,
                                                  const float* __restrict__ mean, const float* __restrict__ inv,
                                                  float* __restrict__ dscale, float* __restrict__ dbias,
                                                  long long R, int C) {
    __shared__ float s_scale[32][33], s_bias[32][33];
    const int col = blockIdx.x * 32 + threadIdx.x;
    float a = 0.f, b = 0.f;
    if (col < C) {
        for (long long r = threadIdx.y; r < R; r += 32) {
            const float d = dy[r * C + col];
            a += d * ((x[r * C + col] - mean[r]) * inv[r]);
            b += d;
        }
    }
    s_scale[threadIdx.y][threadIdx.x] = a;
    s_bias[threadIdx.y][threadIdx.x] = b;
    __syncthreads();
    if (threadIdx.y == 0 && col < C) {
        float ta = 0.f, tb = 0.f;
        for (int k = 0; k < 32; ++k) { ta += s_scale[k][threadIdx.x]; tb += s_bias[k][threadIdx.x]; }
        dscale[col] = ta;
        dbias[col] = tb;
    }
}
"""


def row_threads(width: int) -> int:
    """Threads per row block: about four elements each, a whole number of warps, 32 to 512."""
    per_thread = -(-width // 4)
    return min(512, max(32, -(-per_thread // 32) * 32))


@dataclass
class _Node:
    name: str
    inputs: list[str]  # dY, X, scale, mean, inv_std_dev
    outputs: list[str]  # dX, dscale, dB

    @classmethod
    def from_node(cls, node, where: str) -> _Node:
        if node.op_type != LAYERNORM_GRAD or len(node.input) != 5 or len(node.output) != 3 or not all(node.input):
            raise RunError(f"{where}: node '{node.name}' ({node.domain}::{node.op_type}) is not a "
                           f"{LAYERNORM_GRAD} node (5 inputs, 3 outputs)")
        return cls(node.name, list(node.input), list(node.output))


class LayerNormRunner(RawKernelRunner):
    """A NativeGroup of LayerNormGrad nodes, run on the device's compute stream (the module docstring)."""

    SOURCE = SOURCE
    KERNELS = ("layer_norm_grad_input", "layer_norm_grad_params")
    WHAT = "LayerNorm gradients"

    def parse(self, node) -> _Node:
        return _Node.from_node(node, self.where)

    def _check(self, op: _Node, values) -> tuple[int, int]:
        """(rows, width) of X, every input contiguous float32 of its contract shape: the kernels
        would read past a smaller buffer without an error."""
        x = values[op.inputs[1]]
        if x.dtype != np.float32 or x.ndim < 1 or x.size == 0:
            raise RunError(f"{self.where}: '{op.name}': X must be a non-empty float32 tensor, got {x.dtype} {tuple(x.shape)}")
        width = int(x.shape[-1])
        rows = x.size // width
        sizes = {op.inputs[0]: x.size, op.inputs[1]: x.size, op.inputs[2]: width, op.inputs[3]: rows, op.inputs[4]: rows}
        for name, size in sizes.items():
            value = values[name]
            if value.dtype != np.float32 or not value.flags.c_contiguous or value.size != size:
                raise RunError(f"{self.where}: '{op.name}': input '{name}' must be contiguous float32 of {size} "
                               f"elements, got {value.dtype} {tuple(value.shape)}")
        if tuple(values[op.inputs[0]].shape) != tuple(x.shape):
            raise RunError(f"{self.where}: '{op.name}': dY {tuple(values[op.inputs[0]].shape)} is not shaped like "
                           f"X {tuple(x.shape)}")
        return rows, width

    def launch(self, values, allocate: bool) -> None:
        cp = self.cp
        grad_input, grad_params = self.functions()
        with self.stream:
            for op in self.ops:
                x = values[op.inputs[1]]
                if allocate:  # a first call: its shapes are every bound call's
                    self._check(op, values)
                    for name, shape in zip(op.outputs, [x.shape, (x.shape[-1],), (x.shape[-1],)]):
                        if name not in values:  # given where the node runs inside a session (in_session.py)
                            values[name] = cp.empty(shape, dtype=np.float32)
                width = int(x.shape[-1])
                rows = x.size // width
                dy, _, scale, mean, inv = (values[name] for name in op.inputs)
                dx, dscale, dbias = (values[name] for name in op.outputs)
                try:
                    grad_input((rows,), (row_threads(width),), (dy, x, scale, mean, inv, dx, np.int32(width)))
                    grad_params((-(-width // 32),), (32, 32), (dy, x, mean, inv, dscale, dbias, np.int64(rows),
                                                              np.int32(width)))
                except Exception as exc:
                    raise self.launch_error(op.name, exc) from None
