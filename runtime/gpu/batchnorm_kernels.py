"""The CUDA source of batchnorm.py's kernels (CuPy RawKernels), their launch constants and how a
statistics launch cuts each channel into parts.

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
threads and parts keep the exact division. ResNet-18 bf16 on one H200 (run h200-s46): 1.23 -> 0.84
ms of BatchNorm a step, the step 6.84 -> 6.39 ms.
"""

from __future__ import annotations

from runtime.gpu.column_sums import SOURCE as LAST_BLOCK

THREADS = 256
# Values an access where ``vec``: 8 where every X-shaped tensor of the node is bfloat16 and HW a
# multiple of 8 (16 bytes), else 4 (float32's 16 bytes; bfloat16's 8). float32 in two accesses of
# eight slowed bn_apply 0.30 -> 0.38 ms a ResNet-18 step (run h200-s46).
WIDTHS = (4, 8)
PARTIAL_BLOCKS = 512  # blocks of a statistics launch: about four an SM of an H100/H200
MIN_PART = 2 * 8 * THREADS  # values of a part: each thread takes at least two accesses of eight (four of four)

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
