"""Training BatchNorm on the GPU: ``graph_transpiler.batchnorm::BatchNormTraining`` and
``BatchNormTrainingGrad`` nodes (transpiler/batchnorm_ops.py, docs/contracts.md), and the same nodes
with their bfloat16 casts folded in (batchnorm_casts.py), as CuPy RawKernels: two launches a node.

Why not cuDNN (``cudnnBatchNormalizationForwardTraining``/``Backward``, which this ran before):
its spatial-mode NCHW kernels give each channel one block, 64 blocks for ResNet-18's first stage on
132 SMs: 20 nodes cost 3.8 ms of a 12.2 ms float32 step on an H200 (run h200-s42), about eight
times the bytes they move. Here each channel's N x H x W values are cut into parts over about 512
blocks, and the activations take 16-byte accesses. And cuDNN reads and writes float32 only, so
under ``--precision bf16`` every BatchNorm sat between two casts and kept a float32 copy of its
input for the backward; these kernels read and write bfloat16 where the fused nodes have it, with
float32 statistics and arithmetic (what torch.autocast runs).

Kernels, X viewed as (N, C, HW), M = N x HW values a channel (each tensor float32 or bfloat16 by
a flag; accesses of eight values (16 bytes) where every X-shaped tensor is bfloat16 and HW is a
multiple of eight, else of four (16 bytes of float32, 8 of bfloat16) where HW is a multiple of four,
the buffers 16-byte aligned, ``vec``; else one value an access):
- ``bn_stats`` (grid C x parts): each block the Welford (count, mean, M2) of its part, merged
  across the block in a fixed tree; the channel's last block (column_sums.gt_last_block) merges the
  parts in order and writes the saved mean and 1/sqrt(var + epsilon) and the running statistics
  (``running * momentum + batch * (1 - momentum)``, the variance unbiased; running input and
  output may be one buffer: one thread reads then writes each channel).
- ``bn_apply``: Y = (X - mean) * (scale * inv_std) + B (then max(Y, 0) where the node took its
  Relu in, batchnorm_casts.py).
- ``bn_grad_sums`` (grid C x parts): per channel sum(dY) and sum(dY * (X - mean)), the last block
  writing dB, dscale and the three coefficients of dX into a scratch buffer.
- ``bn_grad_apply``: dX = dY * k1 - k3 - (X - mean) * k2 (the function's formula,
  transpiler/batchnorm_ops.py).
Deterministic: the parts depend only on the shape and every merge is in a fixed order. The
epsilon is the node's own (cuDNN needed at least 1e-5).

Cost per value, which made the first form compute-bound at about a fifth of the H200's bandwidth
(ResNet-18 bf16: 1.23 ms of BatchNorm a step, run h200-s45): an integer division for the index of
every access of four and a true division in every Welford merge. Now a thread walks its accesses
with the row and offset (or channel and offset) carried from one to the next (the stride's
quotient and remainder come from the host), and merges each access (or, unvectorized, each value)
into its running triple with a fast reciprocal (``gt_mergev``, ``gt_merge1``); the merges across
threads and parts keep the exact division. ResNet-18 bf16 on one H200 (run h200-s46): 1.23 -> 0.84 ms of BatchNorm a step, the step
6.84 -> 6.39 ms.

Interface: OrtCudaSegment's (``run`` allocates the outputs on the first call; then ``prepare`` and
``run_bound``); inside a session (in_session.py) the outputs are onnxruntime's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from contract.ops import BATCHNORM_TRAINING, BATCHNORM_TRAINING_GRAD
from runtime.errors import RunError
from runtime.gpu.column_sums import SOURCE as LAST_BLOCK
from runtime.gpu.kernel_runner import RawKernelRunner, aligned

_ARITY = {BATCHNORM_TRAINING: (5, 5), BATCHNORM_TRAINING_GRAD: (5, 3)}  # op -> (inputs, outputs)
THREADS = 256
# Values an access where ``vec``: 8 where every X-shaped tensor of the node is bfloat16 and HW a
# multiple of 8 (16 bytes), else 4 (float32's 16 bytes; bfloat16's 8). float32 in two accesses of
# eight slowed bn_apply 0.30 -> 0.38 ms a ResNet-18 step (run h200-s46).
WIDTHS = (4, 8)
PARTIAL_BLOCKS = 512  # blocks of a statistics launch: about four an SM of an H100/H200
MIN_PART = 2 * 8 * THREADS  # values of a part: each thread takes at least two accesses of eight (four of four)
_FLOAT, _BF16 = np.dtype(np.float32), np.dtype(np.uint16)  # bfloat16 is viewed as its raw bits

SOURCE = LAST_BLOCK + r"""
#define THREADS 256
__device__ __forceinline__ float gt_ld(const void* p, unsigned int i, int bf16) {
    return bf16 ? __uint_as_float(((unsigned int)((const unsigned short*)p)[i]) << 16) : ((const float*)p)[i];
}
__device__ __forceinline__ unsigned int gt_bf16(float f) {  // round to nearest even; NaN stays NaN
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ((u | 0x00400000u) >> 16);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ void gt_st(void* p, unsigned int i, int bf16, float v) {
    if (bf16) ((unsigned short*)p)[i] = (unsigned short)gt_bf16(v); else ((float*)p)[i] = v;
}
// W consecutive values from i (a multiple of W; the buffer aligned to the access): W = 8 takes
// bfloat16 in one 16-byte access (float32 in two), W = 4 float32 in one (bfloat16 in 8 bytes).
template <int W> __device__ __forceinline__ void gt_ldv(const void* p, unsigned int i, int bf16, float v[W]) {
    if (bf16) {
        unsigned int u[W / 2];
        if (W == 8) { const uint4 w = *(const uint4*)((const unsigned short*)p + i); u[0] = w.x; u[1] = w.y; u[2] = w.z; u[3] = w.w; }
        else { const uint2 w = *(const uint2*)((const unsigned short*)p + i); u[0] = w.x; u[1] = w.y; }
        for (int k = 0; k < W / 2; ++k) { v[2 * k] = __uint_as_float(u[k] << 16); v[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u); }
    } else {
        for (int k = 0; k < W; k += 4) {
            const float4 a = *(const float4*)((const float*)p + i + k);
            v[k] = a.x; v[k + 1] = a.y; v[k + 2] = a.z; v[k + 3] = a.w;
        }
    }
}
template <int W> __device__ __forceinline__ void gt_stv(void* p, unsigned int i, int bf16, const float v[W]) {
    if (bf16) {
        unsigned int u[W / 2];
        for (int k = 0; k < W / 2; ++k) u[k] = gt_bf16(v[2 * k]) | (gt_bf16(v[2 * k + 1]) << 16);
        if (W == 8) *(uint4*)((unsigned short*)p + i) = make_uint4(u[0], u[1], u[2], u[3]);
        else *(uint2*)((unsigned short*)p + i) = make_uint2(u[0], u[1]);
    } else {
        for (int k = 0; k < W; k += 4) *(float4*)((float*)p + i + k) = make_float4(v[k], v[k + 1], v[k + 2], v[k + 3]);
    }
}
// (row, offset) = divmod(index, HW) carried over a stride of step_rows * HW + step_rem values.
__device__ __forceinline__ void gt_advance(unsigned int& row, unsigned int& r, unsigned int step_rows,
                                           unsigned int step_rem, unsigned int HW) {
    row += step_rows; r += step_rem;
    if (r >= HW) { r -= HW; ++row; }
}
// ONNX's Relu where ``relu`` (NaN to 0, as x > 0 ? x : 0), else the value.
__device__ __forceinline__ float gt_relu(float v, int relu) { return relu && !(v > 0.f) ? 0.f : v; }
// Chan's merge of the Welford triple (n, mean, m2) with (nb, mb, m2b).
__device__ __forceinline__ void gt_merge(float& n, float& mean, float& m2, float nb, float mb, float m2b) {
    if (nb == 0.f) return;
    const float total = n + nb, delta = mb - mean, w = nb / total;
    mean += delta * w;
    m2 += m2b + delta * delta * n * w;
    n = total;
}
// An access of W values (their mean mb, their m2b) into a thread's running triple, its weight by a
// fast reciprocal: the cross-thread merges (gt_merge) keep the exact division.
template <int W> __device__ __forceinline__ void gt_mergev(float& n, float& mean, float& m2, const float v[W]) {
    float sum = 0.f;
    for (int q = 0; q < W; ++q) sum += v[q];
    const float mb = sum * (1.f / W);
    float m2b = 0.f;
    for (int q = 0; q < W; ++q) m2b += (v[q] - mb) * (v[q] - mb);
    const float total = n + (float)W, delta = mb - mean, w = __fdividef((float)W, total);
    mean += delta * w;
    m2 += m2b + delta * delta * n * w;
    n = total;
}
// One value into a thread's running triple (Welford's update), by a fast reciprocal.
__device__ __forceinline__ void gt_merge1(float& n, float& mean, float& m2, float v) {
    n += 1.f;
    const float delta = v - mean;
    mean += delta * __fdividef(1.f, n);
    m2 += delta * (v - mean);
}
// The flat index of value j (of M = N * HW) of channel c.
__device__ __forceinline__ unsigned int gt_at(unsigned int j, int c, int C, int HW) {
    const unsigned int n = j / HW;
    return (n * C + c) * HW + (j - n * HW);
}
// Sums of a block (THREADS threads) in a fixed tree; the result in thread 0.
__device__ __forceinline__ float gt_block_sum(float a, float* s) {
    for (int o = 16; o > 0; o >>= 1) a += __shfl_down_sync(0xffffffffu, a, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = a;
    __syncthreads();
    if (threadIdx.x == 0) { a = 0.f; for (int k = 0; k < THREADS / 32; ++k) a += s[k]; }
    return a;
}

template <int W> __device__ __forceinline__ void bn_stats_body(const void* x, int x_bf16, int vec, int C, int HW, unsigned int M,
                                    unsigned int per_part, unsigned int step_rows, unsigned int step_rem,
                                    float* partial, unsigned int* counters,
                                    const float* running_mean, const float* running_var, float* mean_next,
                                    float* var_next, float* saved_mean, float* saved_inv_std, float momentum,
                                    float epsilon) {
    __shared__ float s[3][THREADS / 32];
    const int c = blockIdx.x;
    const unsigned int first = blockIdx.y * per_part, end = min(first + per_part, M);
    float n = 0.f, mean = 0.f, m2 = 0.f;
    if (vec) {  // HW, first and per_part multiples of W: whole accesses, each in one row
        unsigned int j = first + threadIdx.x * W, row = j / HW, r = j - row * HW;
#pragma unroll 4
        for (; j < end; j += THREADS * W) {
            float v[W];
            gt_ldv<W>(x, (row * C + c) * HW + r, x_bf16, v);
            gt_mergev<W>(n, mean, m2, v);
            gt_advance(row, r, step_rows, step_rem, HW);
        }
    } else {
        for (unsigned int j = first + threadIdx.x; j < end; j += THREADS)
            gt_merge1(n, mean, m2, gt_ld(x, gt_at(j, c, C, HW), x_bf16));
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float nb = __shfl_down_sync(0xffffffffu, n, o), mb = __shfl_down_sync(0xffffffffu, mean, o);
        const float m2b = __shfl_down_sync(0xffffffffu, m2, o);
        gt_merge(n, mean, m2, nb, mb, m2b);
    }
    if ((threadIdx.x & 31) == 0) { s[0][threadIdx.x >> 5] = n; s[1][threadIdx.x >> 5] = mean; s[2][threadIdx.x >> 5] = m2; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < THREADS / 32; ++k) gt_merge(n, mean, m2, s[0][k], s[1][k], s[2][k]);
        partial[2 * ((size_t)blockIdx.y * C + c)] = mean;
        partial[2 * ((size_t)blockIdx.y * C + c) + 1] = m2;
    }
    if (!gt_last_block(counters)) return;
    if (threadIdx.x == 0) {
        n = 0.f; mean = 0.f; m2 = 0.f;
        for (unsigned int p = 0; p < gridDim.y; ++p) {
            const float count = (float)(min(per_part, M - p * per_part));
            gt_merge(n, mean, m2, count, __ldcg(partial + 2 * ((size_t)p * C + c)), __ldcg(partial + 2 * ((size_t)p * C + c) + 1));
        }
        const float var = m2 / n;
        saved_mean[c] = mean;
        saved_inv_std[c] = 1.f / sqrtf(var + epsilon);
        const float unbiased = var * (n / (n - 1.f));
        mean_next[c] = running_mean[c] * momentum + mean * (1.f - momentum);
        var_next[c] = running_var[c] * momentum + unbiased * (1.f - momentum);
    }
}

// The elementwise passes walk i over a grid stride of step_rows * HW + step_rem values, carrying
// the channel c = (i / HW) % C and the offset r = i % HW (step_c = step_rows % C).
__device__ __forceinline__ void gt_walk_start(unsigned int i, int C, int HW, unsigned int& r, unsigned int& c) {
    const unsigned int row = i / HW;
    r = i - row * HW;
    c = row % C;
}
__device__ __forceinline__ void gt_walk_next(unsigned int& r, unsigned int& c, unsigned int step_c,
                                             unsigned int step_rem, int C, int HW) {
    r += step_rem; c += step_c;
    if (r >= (unsigned int)HW) { r -= HW; ++c; }
    if (c >= (unsigned int)C) c -= C;
}

template <int W> __device__ __forceinline__ void bn_apply_body(const void* x, int x_bf16, void* y, int y_bf16, int vec, int C, int HW,
                                    unsigned int total, unsigned int step_c, unsigned int step_rem,
                                    const float* mean, const float* inv_std, const float* scale, const float* bias,
                                    int relu) {
    if (vec) {
        unsigned int i = (blockIdx.x * THREADS + threadIdx.x) * W, r, c;
        gt_walk_start(i, C, HW, r, c);
#pragma unroll 2
        for (; i < total; i += gridDim.x * THREADS * W) {
            float v[W];
            gt_ldv<W>(x, i, x_bf16, v);
            const float k = scale[c] * inv_std[c], mu = mean[c], b = bias[c];
            for (int q = 0; q < W; ++q) v[q] = gt_relu((v[q] - mu) * k + b, relu);
            gt_stv<W>(y, i, y_bf16, v);
            gt_walk_next(r, c, step_c, step_rem, C, HW);
        }
    } else {
        for (unsigned int i = blockIdx.x * THREADS + threadIdx.x; i < total; i += gridDim.x * THREADS) {
            const unsigned int c = (i / HW) % C;
            gt_st(y, i, y_bf16, gt_relu((gt_ld(x, i, x_bf16) - mean[c]) * (scale[c] * inv_std[c]) + bias[c], relu));
        }
    }
}

template <int W> __device__ __forceinline__ void bn_grad_sums_body(const void* dy, int dy_bf16, const void* x, int x_bf16, int vec, int C,
                                        int HW, unsigned int M, unsigned int per_part, unsigned int step_rows,
                                        unsigned int step_rem, const float* mean,
                                        const float* inv_std, const float* scale, float* partial,
                                        unsigned int* counters, float* dscale, float* dbias, float* coef) {
    __shared__ float s[THREADS / 32];
    const int c = blockIdx.x;
    const float mu = mean[c];
    const unsigned int first = blockIdx.y * per_part, end = min(first + per_part, M);
    float s1 = 0.f, s2 = 0.f;
    if (vec) {
        unsigned int j = first + threadIdx.x * W, row = j / HW, r = j - row * HW;
#pragma unroll 4
        for (; j < end; j += THREADS * W) {
            float g[W], v[W];
            const unsigned int at = (row * C + c) * HW + r;
            gt_ldv<W>(dy, at, dy_bf16, g);
            gt_ldv<W>(x, at, x_bf16, v);
            for (int q = 0; q < W; ++q) { s1 += g[q]; s2 += g[q] * (v[q] - mu); }
            gt_advance(row, r, step_rows, step_rem, HW);
        }
    } else {
        for (unsigned int j = first + threadIdx.x; j < end; j += THREADS) {
            const unsigned int at = gt_at(j, c, C, HW);
            const float g = gt_ld(dy, at, dy_bf16);
            s1 += g; s2 += g * (gt_ld(x, at, x_bf16) - mu);
        }
    }
    s1 = gt_block_sum(s1, s);
    s2 = gt_block_sum(s2, s);
    if (threadIdx.x == 0) {
        partial[2 * ((size_t)blockIdx.y * C + c)] = s1;
        partial[2 * ((size_t)blockIdx.y * C + c) + 1] = s2;
    }
    if (!gt_last_block(counters)) return;
    if (threadIdx.x == 0) {
        s1 = 0.f; s2 = 0.f;
        for (unsigned int p = 0; p < gridDim.y; ++p) {
            s1 += __ldcg(partial + 2 * ((size_t)p * C + c));
            s2 += __ldcg(partial + 2 * ((size_t)p * C + c) + 1);
        }
        const float inv = inv_std[c], count = (float)M, k1 = scale[c] * inv;
        dbias[c] = s1;
        dscale[c] = s2 * inv;
        coef[3 * c] = k1;
        coef[3 * c + 1] = k1 * (s1 / count);
        coef[3 * c + 2] = k1 * ((s2 / count) * (inv * inv));
    }
}

template <int W> __device__ __forceinline__ void bn_grad_apply_body(const void* dy, int dy_bf16, const void* x, int x_bf16, void* dx,
                                         int dx_bf16, int vec, int C, int HW, unsigned int total,
                                         unsigned int step_c, unsigned int step_rem, const float* mean,
                                         const float* coef) {
    if (vec) {
        unsigned int i = (blockIdx.x * THREADS + threadIdx.x) * W, r, c;
        gt_walk_start(i, C, HW, r, c);
#pragma unroll 2
        for (; i < total; i += gridDim.x * THREADS * W) {
            float g[W], v[W];
            gt_ldv<W>(dy, i, dy_bf16, g);
            gt_ldv<W>(x, i, x_bf16, v);
            const float k1 = coef[3 * c], k3 = coef[3 * c + 1], k2 = coef[3 * c + 2], mu = mean[c];
            for (int q = 0; q < W; ++q) v[q] = (g[q] * k1 - k3) - (v[q] - mu) * k2;
            gt_stv<W>(dx, i, dx_bf16, v);
            gt_walk_next(r, c, step_c, step_rem, C, HW);
        }
    } else {
        for (unsigned int i = blockIdx.x * THREADS + threadIdx.x; i < total; i += gridDim.x * THREADS) {
            const unsigned int c = (i / HW) % C;
            const float g = gt_ld(dy, i, dy_bf16), v = gt_ld(x, i, x_bf16);
            gt_st(dx, i, dx_bf16, (g * coef[3 * c] - coef[3 * c + 1]) - (v - mean[c]) * coef[3 * c + 2]);
        }
    }
}

// Each kernel for W = 4 and W = 8 (the host takes 8 where every X-shaped tensor is bfloat16).
#define GT_WIDTHS(name, params, args) \
    extern "C" __global__ void name##4 params { name##_body<4> args; } \
    extern "C" __global__ void name##8 params { name##_body<8> args; }
GT_WIDTHS(bn_stats, (const void* x, int x_bf16, int vec, int C, int HW, unsigned int M,
                                    unsigned int per_part, unsigned int step_rows, unsigned int step_rem,
                                    float* partial, unsigned int* counters,
                                    const float* running_mean, const float* running_var, float* mean_next,
                                    float* var_next, float* saved_mean, float* saved_inv_std, float momentum,
                                    float epsilon),
          (x, x_bf16, vec, C, HW, M, per_part, step_rows, step_rem, partial, counters, running_mean,
           running_var, mean_next, var_next, saved_mean, saved_inv_std, momentum, epsilon))
GT_WIDTHS(bn_apply, (const void* x, int x_bf16, void* y, int y_bf16, int vec, int C, int HW,
                                    unsigned int total, unsigned int step_c, unsigned int step_rem,
                                    const float* mean, const float* inv_std, const float* scale, const float* bias,
                                    int relu),
          (x, x_bf16, y, y_bf16, vec, C, HW, total, step_c, step_rem, mean, inv_std, scale, bias, relu))
GT_WIDTHS(bn_grad_sums, (const void* dy, int dy_bf16, const void* x, int x_bf16, int vec, int C,
                                        int HW, unsigned int M, unsigned int per_part, unsigned int step_rows,
                                        unsigned int step_rem, const float* mean,
                                        const float* inv_std, const float* scale, float* partial,
                                        unsigned int* counters, float* dscale, float* dbias, float* coef),
          (dy, dy_bf16, x, x_bf16, vec, C, HW, M, per_part, step_rows, step_rem, mean, inv_std, scale,
           partial, counters, dscale, dbias, coef))
GT_WIDTHS(bn_grad_apply, (const void* dy, int dy_bf16, const void* x, int x_bf16, void* dx,
                                         int dx_bf16, int vec, int C, int HW, unsigned int total,
                                         unsigned int step_c, unsigned int step_rem, const float* mean,
                                         const float* coef),
          (dy, dy_bf16, x, x_bf16, dx, dx_bf16, vec, C, HW, total, step_c, step_rem, mean, coef))
"""


def parts(channels: int, per_channel: int) -> tuple[int, int]:
    """(parts, values a part) of a statistics launch: about PARTIAL_BLOCKS blocks in all, no part
    under MIN_PART values (so one part where a channel is small), a part a multiple of eight."""
    count = max(1, min(-(-PARTIAL_BLOCKS // channels), per_channel // MIN_PART))
    per_part = -(-per_channel // count)
    per_part += -per_part % 8
    return -(-per_channel // per_part), per_part


@dataclass
class _Node:
    name: str
    forward: bool
    inputs: list[str]
    outputs: list[str]
    epsilon: float
    momentum: float  # ONNX's: running = momentum * running + (1 - momentum) * batch (forward only)
    relu: bool = False  # Y = max(BatchNorm, 0) (a forward of batchnorm_casts.py that took its Relu in)

    @classmethod
    def from_node(cls, node, where: str) -> _Node:
        # A fused node of batchnorm_casts.py is named like the node it replaced, with a suffix.
        op = BATCHNORM_TRAINING_GRAD if node.op_type.startswith(BATCHNORM_TRAINING_GRAD) else BATCHNORM_TRAINING
        arity = _ARITY[op] if node.op_type.startswith(BATCHNORM_TRAINING) else None
        if arity is None or (len(node.input), len(node.output)) != arity or not all(node.input):
            raise RunError(f"{where}: node '{node.name}' ({node.domain}::{node.op_type}) is not a "
                           f"{BATCHNORM_TRAINING} (5 inputs, 5 outputs) or {BATCHNORM_TRAINING_GRAD} (5 inputs, 3 outputs) node")
        attrs = {a.name: a.f for a in node.attribute}
        relu = any(a.name == "relu" and a.i for a in node.attribute)
        return cls(node.name, op == BATCHNORM_TRAINING, list(node.input), list(node.output),
                   float(attrs.get("epsilon", 1e-5)), float(attrs.get("momentum", 0.9)), relu)


class BatchNormRunner(RawKernelRunner):
    """A NativeGroup of BatchNorm nodes (the module docstring). The partial sums, the channels'
    counters and the gradient coefficients live in buffers the runner keeps (a captured graph
    replays with their pointers); its nodes run one after another on one stream, so they share them."""

    SOURCE = SOURCE
    KERNELS = tuple(f"{name}{width}" for width in WIDTHS for name in ("bn_stats", "bn_apply", "bn_grad_sums", "bn_grad_apply"))
    WHAT = "BatchNorms"

    def __init__(self, group, where: str, device):
        super().__init__(group, where, device)
        self.blocks = 0
        self.partial = self.counters = self.coef = None

    def parse(self, node) -> _Node:
        return _Node.from_node(node, self.where)

    def in_place_pairs(self) -> dict[str, str]:
        """Running-statistic outputs that may share their input's buffer (each channel's is read
        before it is written, by one thread)."""
        return {out: src for op in self.ops if op.forward for out, src in zip(op.outputs[1:3], op.inputs[3:5])}

    def _check(self, op: _Node, values) -> tuple:
        """(N, C, HW) of X; every tensor contiguous, X-shaped ones float32 or bfloat16, the
        per-channel ones float32 (C,). The kernels would read past a smaller buffer without an error."""
        x = values[op.inputs[0] if op.forward else op.inputs[1]]
        if x.ndim != 4 or x.dtype not in (_FLOAT, _BF16) or x.size >= 2**31:
            raise RunError(f"{self.where}: '{op.name}': X must be a float32 or bfloat16 (N, C, H, W) tensor of "
                           f"fewer than 2**31 values, got {x.dtype} {tuple(x.shape)}")
        full = 1 if op.forward else 2  # leading inputs shaped like X: X, or dY and X
        for index, name in enumerate(op.inputs):
            value = values[name]
            shape, kinds = (tuple(x.shape), (_FLOAT, _BF16)) if index < full else ((x.shape[1],), (_FLOAT,))
            if value.dtype not in kinds or not value.flags.c_contiguous or tuple(value.shape) != shape:
                raise RunError(f"{self.where}: '{op.name}': input '{name}' must be a contiguous "
                               f"{' or '.join('bfloat16' if k == _BF16 else 'float32' for k in kinds)} tensor of "
                               f"shape {shape}, got {value.dtype} {tuple(value.shape)}")
        return x.shape[0], x.shape[1], x.shape[2] * x.shape[3]

    def _reserve(self, n: int, c: int, hw: int) -> None:
        count, _ = parts(c, n * hw)
        if self.partial is None or self.partial.size < 2 * count * c:
            self.partial = self.cp.empty(2 * count * c, dtype=np.float32)
        if self.counters is None or self.counters.size < c:
            self.counters = self.cp.zeros(c, dtype=np.uint32)
        if self.coef is None or self.coef.size < 3 * c:
            self.coef = self.cp.empty(3 * c, dtype=np.float32)
        if not self.blocks:
            self.blocks = 8 * self.cp.cuda.Device().attributes["MultiProcessorCount"]

    def launch(self, values, allocate: bool) -> None:
        cp = self.cp
        kernels = self.functions()
        with self.stream:
            for op in self.ops:
                x = values[op.inputs[0] if op.forward else op.inputs[1]]
                if allocate:  # a first call: its shapes are every bound call's
                    n, c, hw = self._check(op, values)
                    self._reserve(n, c, hw)
                    channels = (c,)
                    for name, shape in zip(op.outputs, [x.shape, channels, channels, channels, channels]):
                        if name not in values:  # given where the node runs inside a session (in_session.py)
                            values[name] = cp.empty(shape, dtype=np.float32)
                n, c, h, w = x.shape
                hw, total = h * w, x.size
                count, per_part = parts(c, n * hw)
                big = [values[op.outputs[0]], *(values[name] for name in op.inputs[:1 if op.forward else 2])]
                flags = [np.int32(a.dtype == _BF16) for a in big]  # (out, in...) as bfloat16
                # 8 only where every X-shaped tensor is bf16 and the rows hold whole accesses of 8;
                # else 4 (bf16 at 8 bytes an access: 14 x 14 planes stay vectorized)
                width = WIDTHS[-1] if all(flags) and hw % WIDTHS[-1] == 0 else WIDTHS[0]
                vec = hw % width == 0 and aligned(*big)
                stats, apply, grad_sums, grad_apply = kernels[4 * WIDTHS.index(width):][:4]
                values_an_access = width if vec else 1
                inp, out = [values[k] for k in op.inputs], [values[k] for k in op.outputs]
                sizes = (np.int32(vec), np.int32(c), np.int32(hw))
                # A statistics thread's stride, and an elementwise grid's, as (rows, remainder) of HW.
                parts_step = [np.uint32(v) for v in divmod(THREADS * values_an_access, hw)]
                grid = min(self.blocks, -(-total // (THREADS * values_an_access)))
                rows, rem = divmod(grid * THREADS * values_an_access, hw)
                walk_step = (np.uint32(rows % c), np.uint32(rem))
                try:
                    if op.forward:
                        stats((c, count), (THREADS,), (inp[0], flags[1], *sizes, np.uint32(n * hw),
                                                       np.uint32(per_part), *parts_step, self.partial, self.counters,
                                                       inp[3], inp[4], out[1], out[2], out[3], out[4],
                                                       np.float32(op.momentum), np.float32(op.epsilon)))
                        apply((grid,), (THREADS,), (inp[0], flags[1], out[0], flags[0], *sizes, np.uint32(total),
                                                    *walk_step, out[3], out[4], inp[1], inp[2], np.int32(op.relu)))
                    else:
                        grad_sums((c, count), (THREADS,), (inp[0], flags[1], inp[1], flags[2], *sizes,
                                                           np.uint32(n * hw), np.uint32(per_part), *parts_step,
                                                           inp[3], inp[4], inp[2], self.partial, self.counters,
                                                           out[1], out[2], self.coef))
                        grad_apply((grid,), (THREADS,), (inp[0], flags[1], inp[1], flags[2], out[0], flags[0],
                                                         *sizes, np.uint32(total), *walk_step, inp[3], self.coef))
                except Exception as exc:
                    raise self.launch_error(op.name, exc) from None
