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
a flag; four values an access where HW is a multiple of four and the buffers allow it):
- ``bn_stats`` (grid C x parts): each block the Welford (count, mean, M2) of its part, merged
  across the block in a fixed tree; the channel's last block (column_sums.gt_last_block) merges the
  parts in order and writes the saved mean and 1/sqrt(var + epsilon) and the running statistics
  (``running * momentum + batch * (1 - momentum)``, the variance unbiased; running input and
  output may be one buffer: one thread reads then writes each channel).
- ``bn_apply``: Y = (X - mean) * (scale * inv_std) + B.
- ``bn_grad_sums`` (grid C x parts): per channel sum(dY) and sum(dY * (X - mean)), the last block
  writing dB, dscale and the three coefficients of dX into a scratch buffer.
- ``bn_grad_apply``: dX = dY * k1 - k3 - (X - mean) * k2 (the function's formula,
  transpiler/batchnorm_ops.py).
Deterministic: the parts depend only on the shape and every merge is in a fixed order. The
epsilon is the node's own (cuDNN needed at least 1e-5).

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
PARTIAL_BLOCKS = 512  # blocks of a statistics launch: about four an SM of an H100/H200
MIN_PART = 4 * 4 * THREADS  # values of a part: each thread takes at least four accesses of four
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
// Four consecutive values from i (a multiple of 4, in one row when vec).
__device__ __forceinline__ void gt_ld4(const void* p, unsigned int i, int bf16, int vec, float v[4]) {
    if (vec && bf16) {
        uint2 w = *(const uint2*)((const unsigned short*)p + i);
        v[0] = __uint_as_float(w.x << 16); v[1] = __uint_as_float(w.x & 0xffff0000u);
        v[2] = __uint_as_float(w.y << 16); v[3] = __uint_as_float(w.y & 0xffff0000u);
    } else if (vec) {
        float4 f = *(const float4*)((const float*)p + i);
        v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
    } else {
        for (int k = 0; k < 4; ++k) v[k] = gt_ld(p, i + k, bf16);
    }
}
__device__ __forceinline__ void gt_st4(void* p, unsigned int i, int bf16, int vec, const float v[4]) {
    if (vec && bf16) {
        uint2 w;
        w.x = gt_bf16(v[0]) | (gt_bf16(v[1]) << 16); w.y = gt_bf16(v[2]) | (gt_bf16(v[3]) << 16);
        *(uint2*)((unsigned short*)p + i) = w;
    } else if (vec) {
        *(float4*)((float*)p + i) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
        for (int k = 0; k < 4; ++k) gt_st(p, i + k, bf16, v[k]);
    }
}
// Chan's merge of the Welford triple (n, mean, m2) with (nb, mb, m2b).
__device__ __forceinline__ void gt_merge(float& n, float& mean, float& m2, float nb, float mb, float m2b) {
    if (nb == 0.f) return;
    const float total = n + nb, delta = mb - mean, w = nb / total;
    mean += delta * w;
    m2 += m2b + delta * delta * n * w;
    n = total;
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

extern "C" __global__ void bn_stats(const void* x, int x_bf16, int vec, int C, int HW, unsigned int M,
                                    unsigned int per_part, float* partial, unsigned int* counters,
                                    const float* running_mean, const float* running_var, float* mean_next,
                                    float* var_next, float* saved_mean, float* saved_inv_std, float momentum,
                                    float epsilon) {
    __shared__ float s[3][THREADS / 32];
    const int c = blockIdx.x;
    const unsigned int first = blockIdx.y * per_part, end = min(first + per_part, M);
    float n = 0.f, mean = 0.f, m2 = 0.f;
    for (unsigned int j = first + threadIdx.x * 4; j < end; j += THREADS * 4) {
        float v[4];
        const int k = min(4u, end - j);
        if (k == 4 && vec) gt_ld4(x, gt_at(j, c, C, HW), x_bf16, 1, v);
        else for (int q = 0; q < k; ++q) v[q] = gt_ld(x, gt_at(j + q, c, C, HW), x_bf16);
        float sum = 0.f;
        for (int q = 0; q < k; ++q) sum += v[q];
        const float mb = sum / k;
        float m2b = 0.f;
        for (int q = 0; q < k; ++q) m2b += (v[q] - mb) * (v[q] - mb);
        gt_merge(n, mean, m2, (float)k, mb, m2b);
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

extern "C" __global__ void bn_apply(const void* x, int x_bf16, void* y, int y_bf16, int vec, int C, int HW,
                                    unsigned int total, const float* mean, const float* inv_std,
                                    const float* scale, const float* bias) {
    for (unsigned int i = (blockIdx.x * THREADS + threadIdx.x) * 4; i < total; i += gridDim.x * THREADS * 4) {
        float v[4];
        const int k = min(4u, total - i);
        if (k == 4) gt_ld4(x, i, x_bf16, vec, v);
        else for (int q = 0; q < k; ++q) v[q] = gt_ld(x, i + q, x_bf16);
        const int c0 = (i / HW) % C;  // the channel of all four where vec (rows of a multiple of four)
        for (int q = 0; q < k; ++q) {
            const int c = vec ? c0 : ((i + q) / HW) % C;
            v[q] = (v[q] - mean[c]) * (scale[c] * inv_std[c]) + bias[c];
        }
        if (k == 4) gt_st4(y, i, y_bf16, vec, v);
        else for (int q = 0; q < k; ++q) gt_st(y, i + q, y_bf16, v[q]);
    }
}

extern "C" __global__ void bn_grad_sums(const void* dy, int dy_bf16, const void* x, int x_bf16, int vec, int C,
                                        int HW, unsigned int M, unsigned int per_part, const float* mean,
                                        const float* inv_std, const float* scale, float* partial,
                                        unsigned int* counters, float* dscale, float* dbias, float* coef) {
    __shared__ float s[THREADS / 32];
    const int c = blockIdx.x;
    const float mu = mean[c];
    const unsigned int first = blockIdx.y * per_part, end = min(first + per_part, M);
    float s1 = 0.f, s2 = 0.f;
    for (unsigned int j = first + threadIdx.x * 4; j < end; j += THREADS * 4) {
        float g[4], v[4];
        const int k = min(4u, end - j);
        if (k == 4 && vec) {
            const unsigned int at = gt_at(j, c, C, HW);
            gt_ld4(dy, at, dy_bf16, 1, g);
            gt_ld4(x, at, x_bf16, 1, v);
        } else {
            for (int q = 0; q < k; ++q) {
                const unsigned int at = gt_at(j + q, c, C, HW);
                g[q] = gt_ld(dy, at, dy_bf16);
                v[q] = gt_ld(x, at, x_bf16);
            }
        }
        for (int q = 0; q < k; ++q) { s1 += g[q]; s2 += g[q] * (v[q] - mu); }
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

extern "C" __global__ void bn_grad_apply(const void* dy, int dy_bf16, const void* x, int x_bf16, void* dx,
                                         int dx_bf16, int vec, int C, int HW, unsigned int total,
                                         const float* mean, const float* coef) {
    for (unsigned int i = (blockIdx.x * THREADS + threadIdx.x) * 4; i < total; i += gridDim.x * THREADS * 4) {
        float g[4], v[4];
        const int k = min(4u, total - i);
        if (k == 4) { gt_ld4(dy, i, dy_bf16, vec, g); gt_ld4(x, i, x_bf16, vec, v); }
        else for (int q = 0; q < k; ++q) { g[q] = gt_ld(dy, i + q, dy_bf16); v[q] = gt_ld(x, i + q, x_bf16); }
        const int c0 = (i / HW) % C;
        for (int q = 0; q < k; ++q) {
            const int c = vec ? c0 : ((i + q) / HW) % C;
            v[q] = (g[q] * coef[3 * c] - coef[3 * c + 1]) - (v[q] - mean[c]) * coef[3 * c + 2];
        }
        if (k == 4) gt_st4(dx, i, dx_bf16, vec, v);
        else for (int q = 0; q < k; ++q) gt_st(dx, i + q, dx_bf16, v[q]);
    }
}
"""


def parts(channels: int, per_channel: int) -> tuple[int, int]:
    """(parts, values a part) of a statistics launch: about PARTIAL_BLOCKS blocks in all, no part
    under MIN_PART values (so one part where a channel is small), a part a multiple of four."""
    count = max(1, min(-(-PARTIAL_BLOCKS // channels), per_channel // MIN_PART))
    per_part = -(-per_channel // count)
    per_part += -per_part % 4
    return -(-per_channel // per_part), per_part


@dataclass
class _Node:
    name: str
    forward: bool
    inputs: list[str]
    outputs: list[str]
    epsilon: float
    momentum: float  # ONNX's: running = momentum * running + (1 - momentum) * batch (forward only)

    @classmethod
    def from_node(cls, node, where: str) -> _Node:
        # A fused node of batchnorm_casts.py is named like the node it replaced, with a suffix.
        op = BATCHNORM_TRAINING_GRAD if node.op_type.startswith(BATCHNORM_TRAINING_GRAD) else BATCHNORM_TRAINING
        arity = _ARITY[op] if node.op_type.startswith(BATCHNORM_TRAINING) else None
        if arity is None or (len(node.input), len(node.output)) != arity or not all(node.input):
            raise RunError(f"{where}: node '{node.name}' ({node.domain}::{node.op_type}) is not a "
                           f"{BATCHNORM_TRAINING} (5 inputs, 5 outputs) or {BATCHNORM_TRAINING_GRAD} (5 inputs, 3 outputs) node")
        attrs = {a.name: a.f for a in node.attribute}
        return cls(node.name, op == BATCHNORM_TRAINING, list(node.input), list(node.output),
                   float(attrs.get("epsilon", 1e-5)), float(attrs.get("momentum", 0.9)))


class BatchNormRunner(RawKernelRunner):
    """A NativeGroup of BatchNorm nodes (the module docstring). The partial sums, the channels'
    counters and the gradient coefficients live in buffers the runner keeps (a captured graph
    replays with their pointers); its nodes run one after another on one stream, so they share them."""

    SOURCE = SOURCE
    KERNELS = ("bn_stats", "bn_apply", "bn_grad_sums", "bn_grad_apply")
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
        stats, apply, grad_sums, grad_apply = self.functions()
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
                vec = np.int32(hw % 4 == 0 and aligned(*big))
                flags = [np.int32(a.dtype == _BF16) for a in big]  # (out, in...) as bfloat16
                inp, out = [values[k] for k in op.inputs], [values[k] for k in op.outputs]
                sizes = (np.int32(c), np.int32(hw))
                grid = (min(self.blocks, -(-total // (4 * THREADS))),)
                try:
                    if op.forward:
                        stats((c, count), (THREADS,), (inp[0], flags[1], vec, *sizes, np.uint32(n * hw),
                                                       np.uint32(per_part), self.partial, self.counters, inp[3],
                                                       inp[4], out[1], out[2], out[3], out[4],
                                                       np.float32(op.momentum), np.float32(op.epsilon)))
                        apply(grid, (THREADS,), (inp[0], flags[1], out[0], flags[0], vec, *sizes, np.uint32(total),
                                                 out[3], out[4], inp[1], inp[2]))
                    else:
                        grad_sums((c, count), (THREADS,), (inp[0], flags[1], inp[1], flags[2], vec, *sizes,
                                                           np.uint32(n * hw), np.uint32(per_part), inp[3], inp[4],
                                                           inp[2], self.partial, self.counters, out[1], out[2],
                                                           self.coef))
                        grad_apply(grid, (THREADS,), (inp[0], flags[1], inp[1], flags[2], out[0], flags[0], vec,
                                                      *sizes, np.uint32(total), inp[3], self.coef))
                except Exception as exc:
                    raise self.launch_error(op.name, exc) from None
