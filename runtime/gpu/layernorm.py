"""LayerNorm on the GPU: ``graph_transpiler.layernorm::LayerNormGrad`` nodes (transpiler/layernorm_ops.py,
docs/contracts.md) run as two CuPy RawKernel launches each, and the forward LayerNormalization
nodes layernorm_casts.py makes native (float32 X, Y float32 or rounded to bfloat16) as one.

Why: the node's function in standard ops is about 13 onnxruntime kernels, each a pass over the
activation (onnxruntime fuses none of them); PyTorch runs two (``layer_norm_grad_input`` and
``GammaBetaBackward``), and so does this.

Kernels (float32, X viewed as R rows of C):
- ``layer_norm_grad_input``: one block per row. A first pass sums g = dY * scale and g * xhat over
  the row (warp shuffles, then one warp over the warps' sums), a second writes
  dX = inv * (g - sum(g) / C - xhat * sum(g * xhat) / C), re-reading the row (from L1/L2); four
  consecutive elements per thread, as one 16-byte load where the width and pointers allow.
- ``layer_norm_grad_params``: column_sums.py's layout (the rows cut into runs over about 512
  blocks of 32 columns x 8 row lanes, each thread summing every 8th row of its run in its column,
  the strip's last block summing the runs in order).
- ``layer_norm_forward_warp`` (rows of up to 1,024 values) and ``layer_norm_forward`` (wider): one
  warp a row, the row held in its registers (no barrier; X read once), or one block a row as
  ``layer_norm_grad_input`` (X re-read from L1/L2): the row's mean, then the mean of its squared
  deviations from it (two passes: no cancellation as in E[x^2] - E[x]^2), then
  Y = (X - mean) * inv_std_dev * scale + B, each value rounded to
  bfloat16 where Y is bfloat16; mean and inv_std_dev = 1 / sqrt(var + epsilon) (IEEE, as ONNX
  writes it) saved for the gradient. Why not onnxruntime's: its ``cuApplyLayerNorm`` gives a row
  64 threads and reads at about a third of the memory's speed (GPT-2-small: 13.5 us a node on an
  H200, then a Cast to bfloat16 of 5 us); this reads X once and writes Y once.
All are deterministic: the same inputs give the same bits on every run (the runs depend only on
the shape).

Interface: OrtCudaSegment's, through ``LaunchRunner`` (``run`` allocates the outputs on the first
call, whose shapes every bound call keeps; then ``prepare`` and ``run_bound``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from contract.ops import LAYERNORM_GRAD
from runtime.errors import RunError
from runtime.gpu.column_sums import SOURCE as COLUMN_SUMS
from runtime.gpu.column_sums import ColumnSums
from runtime.gpu.kernel_runner import RawKernelRunner, vector_width

WARP_VECS = 8  # the source's: a row of up to 32 * 4 * WARP_VECS values takes one warp
ROWS_A_BLOCK = 8  # warps (rows) a block of layer_norm_forward_warp

SOURCE = COLUMN_SUMS + r"""
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Four consecutive elements of a row: one 16-byte load where ``vec`` (the host checked that the
// width is a multiple of 4 and every pointer 16-byte aligned), else four loads, zero past the end.
__device__ __forceinline__ float4 load4(const float* __restrict__ p, int j, int C, int vec) {
    if (vec) return *reinterpret_cast<const float4*>(p + j);
    return make_float4(p[j], j + 1 < C ? p[j + 1] : 0.f, j + 2 < C ? p[j + 2] : 0.f, j + 3 < C ? p[j + 3] : 0.f);
}

// The sum over the block, in every thread: each warp's sum, then each warp sums the warps' sums
// (in the same order: every thread gets the same bits). ``s`` holds 32 floats; the first barrier
// keeps an earlier call's readers ahead of this call's writers.
__device__ __forceinline__ float block_sum(float v, float* s) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) s[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? s[lane] : 0.f);
}

extern "C" __global__ void layer_norm_grad_input(const float* __restrict__ dy, const float* __restrict__ x,
                                                 const float* __restrict__ scale, const float* __restrict__ mean,
                                                 const float* __restrict__ inv, float* __restrict__ dx, int C, int vec) {
    __shared__ float s_g[32], s_gx[32];
    const long long row = blockIdx.x;
    const float* dy_row = dy + row * C;
    const float* x_row = x + row * C;
    const float mu = mean[row], rs = inv[row];
    float sum_g = 0.f, sum_gx = 0.f;
    for (int j = 4 * threadIdx.x; j < C; j += 4 * blockDim.x) {  // past the end every lane reads 0
        const float4 d = load4(dy_row, j, C, vec), xs = load4(x_row, j, C, vec), w = load4(scale, j, C, vec);
        const float g0 = d.x * w.x, g1 = d.y * w.y, g2 = d.z * w.z, g3 = d.w * w.w;
        sum_g += g0; sum_g += g1; sum_g += g2; sum_g += g3;
        sum_gx += g0 * ((xs.x - mu) * rs); sum_gx += g1 * ((xs.y - mu) * rs);
        sum_gx += g2 * ((xs.z - mu) * rs); sum_gx += g3 * ((xs.w - mu) * rs);
    }
    const float mean_g = block_sum(sum_g, s_g) / (float)C, mean_gx = block_sum(sum_gx, s_gx) / (float)C;
    float* dx_row = dx + row * C;
    for (int j = 4 * threadIdx.x; j < C; j += 4 * blockDim.x) {
        const float4 d = load4(dy_row, j, C, vec), xs = load4(x_row, j, C, vec), w = load4(scale, j, C, vec);
        float4 out;
        out.x = (d.x * w.x - mean_g - ((xs.x - mu) * rs) * mean_gx) * rs;
        out.y = (d.y * w.y - mean_g - ((xs.y - mu) * rs) * mean_gx) * rs;
        out.z = (d.z * w.z - mean_g - ((xs.z - mu) * rs) * mean_gx) * rs;
        out.w = (d.w * w.w - mean_g - ((xs.w - mu) * rs) * mean_gx) * rs;
        if (vec) { *reinterpret_cast<float4*>(dx_row + j) = out; continue; }
        dx_row[j] = out.x;
        if (j + 1 < C) dx_row[j + 1] = out.y;
        if (j + 2 < C) dx_row[j + 2] = out.z;
        if (j + 3 < C) dx_row[j + 3] = out.w;
    }
}

// Y's four values at element j of a row (``at``: the row's first element), float32 or rounded to
// bfloat16; one vector store where ``vec``, else the values before the row's end.
__device__ __forceinline__ void store_y(void* __restrict__ y, int y_bf16, long long at, int j, int C, int vec,
                                        const float out[4]) {
    if (y_bf16) {
        unsigned short* yb = (unsigned short*)y + at + j;
        unsigned short h[4];
        for (int k = 0; k < 4; ++k) h[k] = gt_bf16_bits(gt_round_bf16(out[k]));
        if (vec) *reinterpret_cast<ushort4*>(yb) = make_ushort4(h[0], h[1], h[2], h[3]);
        else for (int k = 0; k < 4 && j + k < C; ++k) yb[k] = h[k];
    } else {
        float* yf = (float*)y + at + j;
        if (vec) *reinterpret_cast<float4*>(yf) = make_float4(out[0], out[1], out[2], out[3]);
        else for (int k = 0; k < 4 && j + k < C; ++k) yf[k] = out[k];
    }
}

// A row of at most 32 * 4 * WARP_VECS values: one warp a row, the row read once into registers
// (GPT-2-small's 768: six float4 a lane), no barrier.
#define WARP_VECS """ + str(WARP_VECS) + r"""
extern "C" __global__ void layer_norm_forward_warp(const float* __restrict__ x, const float* __restrict__ scale,
                                                   const float* __restrict__ bias, int has_bias, void* __restrict__ y,
                                                   int y_bf16, float* __restrict__ mean, float* __restrict__ inv,
                                                   long long R, int C, int vec, float epsilon) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= R) return;
    const int lane = threadIdx.x & 31;
    const float* x_row = x + row * C;
    float4 v[WARP_VECS];
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < WARP_VECS; ++k) {
        const int j = 4 * (lane + 32 * k);
        v[k] = j < C ? load4(x_row, j, C, vec) : make_float4(0.f, 0.f, 0.f, 0.f);  // past the end: 0
        sum += v[k].x; sum += v[k].y; sum += v[k].z; sum += v[k].w;
    }
    const float mu = warp_sum(sum) / (float)C;
    float sq = 0.f;
#pragma unroll
    for (int k = 0; k < WARP_VECS; ++k) {
        const int j = 4 * (lane + 32 * k);
        const float d0 = j < C ? v[k].x - mu : 0.f, d1 = j + 1 < C ? v[k].y - mu : 0.f,
                    d2 = j + 2 < C ? v[k].z - mu : 0.f, d3 = j + 3 < C ? v[k].w - mu : 0.f;
        sq += d0 * d0; sq += d1 * d1; sq += d2 * d2; sq += d3 * d3;
    }
    const float rs = 1.0f / sqrtf(warp_sum(sq) / (float)C + epsilon);
    if (lane == 0) { mean[row] = mu; inv[row] = rs; }
#pragma unroll
    for (int k = 0; k < WARP_VECS; ++k) {
        const int j = 4 * (lane + 32 * k);
        if (j >= C) break;
        const float4 w = load4(scale, j, C, vec);
        const float4 b = has_bias ? load4(bias, j, C, vec) : make_float4(0.f, 0.f, 0.f, 0.f);
        const float out[4] = {(v[k].x - mu) * rs * w.x + b.x, (v[k].y - mu) * rs * w.y + b.y,
                              (v[k].z - mu) * rs * w.z + b.z, (v[k].w - mu) * rs * w.w + b.w};
        store_y(y, y_bf16, row * C, j, C, vec, out);
    }
}

// A wider row: one block a row, as ``layer_norm_grad_input``; X read three times (the second and
// third from L1/L2).
extern "C" __global__ void layer_norm_forward(const float* __restrict__ x, const float* __restrict__ scale,
                                              const float* __restrict__ bias, int has_bias, void* __restrict__ y,
                                              int y_bf16, float* __restrict__ mean, float* __restrict__ inv,
                                              int C, int vec, float epsilon) {
    __shared__ float s_sum[32];
    const long long row = blockIdx.x;
    const float* x_row = x + row * C;
    float sum = 0.f;
    for (int j = 4 * threadIdx.x; j < C; j += 4 * blockDim.x) {  // past the end: 0
        const float4 v = load4(x_row, j, C, vec);
        sum += v.x; sum += v.y; sum += v.z; sum += v.w;
    }
    const float mu = block_sum(sum, s_sum) / (float)C;
    float sq = 0.f;
    for (int j = 4 * threadIdx.x; j < C; j += 4 * blockDim.x) {
        const float4 v = load4(x_row, j, C, vec);
        const float d0 = v.x - mu, d1 = j + 1 < C ? v.y - mu : 0.f, d2 = j + 2 < C ? v.z - mu : 0.f,
                    d3 = j + 3 < C ? v.w - mu : 0.f;
        sq += d0 * d0; sq += d1 * d1; sq += d2 * d2; sq += d3 * d3;
    }
    const float rs = 1.0f / sqrtf(block_sum(sq, s_sum) / (float)C + epsilon);
    if (threadIdx.x == 0) { mean[row] = mu; inv[row] = rs; }
    for (int j = 4 * threadIdx.x; j < C; j += 4 * blockDim.x) {
        const float4 v = load4(x_row, j, C, vec), w = load4(scale, j, C, vec);
        const float4 b = has_bias ? load4(bias, j, C, vec) : make_float4(0.f, 0.f, 0.f, 0.f);
        const float out[4] = {(v.x - mu) * rs * w.x + b.x, (v.y - mu) * rs * w.y + b.y,
                              (v.z - mu) * rs * w.z + b.z, (v.w - mu) * rs * w.w + b.w};
        store_y(y, y_bf16, row * C, j, C, vec, out);
    }
}

// dscale and dbias in one launch, column_sums.py's layout (V adjacent columns a thread): each block
// sums its run of rows into ``partial`` (parts x C for dscale, then for dbias); its strip's last
// block sums the runs.
template <int V>
__device__ __forceinline__ void grad_params(const float* __restrict__ dy, const float* __restrict__ x,
                                            const float* __restrict__ mean, const float* __restrict__ inv,
                                            float* __restrict__ partial, unsigned int* __restrict__ counters,
                                            float* __restrict__ dscale, float* __restrict__ dbias,
                                            long long R, int C, long long rows_per_part) {
    __shared__ float s_scale[PART_LANES][32 * V + 1], s_bias[PART_LANES][32 * V + 1];  // column k at k * 32 + x
    const int col = (blockIdx.x * 32 + threadIdx.x) * V;
    const long long first = blockIdx.y * rows_per_part;
    const long long end = first + rows_per_part < R ? first + rows_per_part : R;
    float a[V] = {}, b[V] = {}, d[V], xs[V];
    if (col < C) {
        for (long long r = first + threadIdx.y; r < end; r += PART_LANES) {
            gt_load<V>(dy + r * C + col, d);
            gt_load<V>(x + r * C + col, xs);
            const float mu = mean[r], rs = inv[r];
            for (int k = 0; k < V; ++k) { a[k] += d[k] * ((xs[k] - mu) * rs); b[k] += d[k]; }
        }
    }
    for (int k = 0; k < V; ++k) { s_scale[threadIdx.y][k * 32 + threadIdx.x] = a[k]; s_bias[threadIdx.y][k * 32 + threadIdx.x] = b[k]; }
    __syncthreads();
    const long long parts = gridDim.y;
    if (threadIdx.y == 0 && col < C)
        for (int k = 0; k < V; ++k) {
            float ta = 0.f, tb = 0.f;
            for (int l = 0; l < PART_LANES; ++l) { ta += s_scale[l][k * 32 + threadIdx.x]; tb += s_bias[l][k * 32 + threadIdx.x]; }
            partial[(long long)blockIdx.y * C + col + k] = ta;
            partial[(parts + blockIdx.y) * C + col + k] = tb;
        }
    if (!gt_last_block(counters)) return;
    // Every row lane sums every PART_LANES-th run, then lane 0 the lanes' sums: a fixed order, the
    // same bits on every run.
    float ta[V] = {}, tb[V] = {};
    if (col < C)
        for (long long p = threadIdx.y; p < parts; p += PART_LANES) {
            gt_load_cg<V>(partial + p * C + col, d);
            gt_load_cg<V>(partial + (parts + p) * C + col, xs);
            for (int k = 0; k < V; ++k) { ta[k] += d[k]; tb[k] += xs[k]; }
        }
    for (int k = 0; k < V; ++k) { s_scale[threadIdx.y][k * 32 + threadIdx.x] = ta[k]; s_bias[threadIdx.y][k * 32 + threadIdx.x] = tb[k]; }
    __syncthreads();
    if (threadIdx.y == 0 && col < C)
        for (int k = 0; k < V; ++k) {
            float ua = 0.f, ub = 0.f;
            for (int l = 0; l < PART_LANES; ++l) { ua += s_scale[l][k * 32 + threadIdx.x]; ub += s_bias[l][k * 32 + threadIdx.x]; }
            dscale[col + k] = ua;
            dbias[col + k] = ub;
        }
}

#define GT_GRAD_PARAMS(NAME, V)                                                                     \
    extern "C" __global__ void NAME(const float* __restrict__ dy, const float* __restrict__ x,         \
                                    const float* __restrict__ mean, const float* __restrict__ inv,    \
                                    float* __restrict__ partial, unsigned int* __restrict__ counters, \
                                    float* __restrict__ dscale, float* __restrict__ dbias, long long R, \
                                    int C, long long rows_per_part) {                                 \
        grad_params<V>(dy, x, mean, inv, partial, counters, dscale, dbias, R, C, rows_per_part);      \
    }
GT_GRAD_PARAMS(layer_norm_grad_params, 1)
GT_GRAD_PARAMS(layer_norm_grad_params4, 4)
"""


def row_threads(width: int) -> int:
    """Threads per row block: about four elements each, a whole number of warps, 32 to 512."""
    per_thread = -(-width // 4)
    return min(512, max(32, -(-per_thread // 32) * 32))


FORWARD = "LayerNormalization"  # a fused forward node's op_type starts so (layernorm_casts.py)
_FLOAT, _BF16 = np.dtype(np.float32), np.dtype(np.uint16)  # bfloat16 is viewed as its raw bits


@dataclass
class _Node:
    name: str
    forward: bool
    inputs: list[str]  # dY, X, scale, mean, inv_std_dev; forward: X, scale[, B]
    outputs: list[str]  # dX, dscale, dB; forward: Y, mean, inv_std_dev
    epsilon: float = 0.0  # forward only

    @classmethod
    def from_node(cls, node, where: str) -> _Node:
        if node.op_type.startswith(FORWARD) and len(node.input) in (2, 3) and len(node.output) == 3 \
                and all(node.input) and all(node.output):
            attrs = {a.name: a for a in node.attribute}
            if (attrs["axis"].i if "axis" in attrs else -1) == -1:
                return cls(node.name, True, list(node.input), list(node.output),
                           attrs["epsilon"].f if "epsilon" in attrs else 1e-5)
        if node.op_type != LAYERNORM_GRAD or len(node.input) != 5 or len(node.output) != 3 or not all(node.input):
            raise RunError(f"{where}: node '{node.name}' ({node.domain}::{node.op_type}) is not a "
                           f"{LAYERNORM_GRAD} node (5 inputs, 3 outputs) or a {FORWARD} over the last axis "
                           "(2 or 3 inputs, 3 outputs)")
        return cls(node.name, False, list(node.input), list(node.output))


class LayerNormRunner(RawKernelRunner):
    """A NativeGroup of LayerNormGrad nodes, or of fused forward nodes, run on the device's compute
    stream (the module docstring)."""

    SOURCE = SOURCE
    KERNELS = ("layer_norm_grad_input", "layer_norm_grad_params", "layer_norm_grad_params4", "layer_norm_forward",
               "layer_norm_forward_warp")
    WHAT = "LayerNorms"

    def __init__(self, group, where: str, device):
        super().__init__(group, where, device)
        self.sums = ColumnSums(self.cp, sums=2)  # dscale's and dbias's partial sums

    def parse(self, node) -> _Node:
        return _Node.from_node(node, self.where)

    def _check(self, op: _Node, values) -> tuple[int, int]:
        """(rows, width) of X, every input contiguous float32 of its contract shape (a forward's Y
        float32 or bfloat16): the kernels would read past a smaller buffer without an error."""
        x = values[op.inputs[0 if op.forward else 1]]
        if x.dtype != np.float32 or x.ndim < 1 or x.size == 0:
            raise RunError(f"{self.where}: '{op.name}': X must be a non-empty float32 tensor, got {x.dtype} {tuple(x.shape)}")
        width = int(x.shape[-1])
        rows = x.size // width
        if op.forward:
            sizes = {name: width for name in op.inputs[1:]}
            y = values[op.outputs[0]]
            if y.dtype not in (_FLOAT, _BF16) or not y.flags.c_contiguous or tuple(y.shape) != tuple(x.shape):
                raise RunError(f"{self.where}: '{op.name}': Y must be a contiguous float32 or bfloat16 tensor shaped "
                               f"like X {tuple(x.shape)}, got {y.dtype} {tuple(y.shape)}")
        else:
            sizes = {op.inputs[0]: x.size, op.inputs[2]: width, op.inputs[3]: rows, op.inputs[4]: rows}
        for name, size in sizes.items():
            value = values[name]
            if value.dtype != np.float32 or not value.flags.c_contiguous or value.size != size:
                raise RunError(f"{self.where}: '{op.name}': input '{name}' must be contiguous float32 of {size} "
                               f"elements, got {value.dtype} {tuple(value.shape)}")
        if not op.forward and tuple(values[op.inputs[0]].shape) != tuple(x.shape):
            raise RunError(f"{self.where}: '{op.name}': dY {tuple(values[op.inputs[0]].shape)} is not shaped like "
                           f"X {tuple(x.shape)}")
        return rows, width

    def launch(self, values, allocate: bool) -> None:
        cp = self.cp
        grad_input, grad_params, grad_params4, *forward = self.functions()
        with self.stream:
            for op in self.ops:
                x = values[op.inputs[0 if op.forward else 1]]
                width = int(x.shape[-1])
                rows = x.size // width
                if allocate:  # a first call: its shapes are every bound call's
                    # Given where the node runs inside a session (in_session.py), else float32 (a
                    # bfloat16 value crosses between sessions as float32: compile.WidenBfloat16).
                    shapes = [x.shape, (*x.shape[:-1], 1), (*x.shape[:-1], 1)] if op.forward else \
                        [x.shape, (width,), (width,)]
                    for name, shape in zip(op.outputs, shapes):
                        if name not in values:
                            values[name] = cp.empty(shape, dtype=np.float32)
                    self._check(op, values)
                    if not op.forward:
                        self.sums.reserve(rows, width)
                try:
                    if op.forward:
                        self._forward(forward, op, values, rows, width)
                        continue
                    dy, _, scale, mean, inv = (values[name] for name in op.inputs)
                    dx, dscale, dbias = (values[name] for name in op.outputs)
                    vec = vector_width(width, dy, x, scale, dx)  # 4: every row 16-byte aligned
                    grid, block, per_run = self.sums.layout(rows, width, vec)
                    grad_input((rows,), (row_threads(width),), (dy, x, scale, mean, inv, dx, np.int32(width),
                                                                np.int32(vec == 4)))
                    (grad_params4 if vec == 4 else grad_params)(grid, block, (dy, x, mean, inv, self.sums.partial, self.sums.counters, dscale, dbias,
                                              np.int64(rows), np.int32(width), per_run))
                except Exception as exc:
                    raise self.launch_error(op.name, exc) from None

    @staticmethod
    def _forward(kernels, op: _Node, values, rows: int, width: int) -> None:
        """A row a warp where it fits in the warp's registers, else a row a block."""
        x, scale, *bias = (values[name] for name in op.inputs)
        y, mean, inv = (values[name] for name in op.outputs)
        vec = np.int32(vector_width(width, x, scale, *bias, y) == 4)
        head = (x, scale, bias[0] if bias else scale, np.int32(bool(bias)), y, np.int32(y.dtype == _BF16), mean, inv)
        tail = (np.int32(width), vec, np.float32(op.epsilon))
        by_block, by_warp = kernels
        if width <= 32 * 4 * WARP_VECS:
            by_warp((-(-rows // ROWS_A_BLOCK),), (32 * ROWS_A_BLOCK,), (*head, np.int64(rows), *tail))
        else:
            by_block((rows,), (row_threads(width),), (*head, *tail))
