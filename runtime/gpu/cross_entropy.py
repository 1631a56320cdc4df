"""The loss and its gradient in one pass on the GPU: a SoftmaxCrossEntropyLoss node and the
``graph_transpiler.loss::SoftmaxCrossEntropyGrad`` node of its gradient (transpiler/loss_ops.py,
docs/contracts.md) become one node of ``DOMAIN``, run inside its onnxruntime session by three
CuPy RawKernel launches.

Why: onnxruntime computes the forward node's log-probabilities in float32 (a LogSoftmax pass and a
(rows, classes) tensor kept until the backward), and the gradient's function is four more passes
over tensors of that size; under ``--precision bf16`` the scores are also widened to float32 first
and the gradient rounded back after. For GPT-2-small (4,096 x 50,257 logits) each such tensor is
0.77 GiB in float32. The fused node reads the scores twice (once for each row's log-sum-exp and
loss, once for the gradient) and writes the gradient once, in its consumer's dtype; no
(rows, classes) value lives between the forward and the backward. llm.c's fused classifier and
Liger's fused cross-entropy do the same.

The rewrite (``fuse_cross_entropy``) takes a pair only where the gradient node reads the forward
node's scores, labels and log_prob, nobody else reads log_prob, and the seed ``dloss`` is computed
before the forward node or by a node of no inputs (the step's constant 1, which then moves; the fp16
loss scale is a step input): the fused node takes the forward node's place. A Cast to float32 that only the pair reads (the scores of a bf16 step) and a
Cast that is the gradient's only reader join the node, which then reads and writes bfloat16 as its
raw bits. The fused node carries a function of the nodes it replaced (the gradient node keeps its
own), so a session that cannot take it computes what the graph computed before.

Kernels (one node: R rows of C classes, scores float32 or bfloat16):
- ``ce_weights``: one block counts the rows whose label is not ``ignore_index`` (their weight is 1,
  the others' 0) and writes ``dloss / count`` and ``count``;
- ``ce_rows``: one block per row; a first pass keeps a running maximum and sum of exponentials
  (online softmax), merged once per eight scores a thread reads (one 16-byte load of bfloat16
  where the row's alignment allows; the first form's scalar loads and per-element merge took
  0.86 ms of GPT-2-small's bf16 step on an H200), so the row's log-sum-exp ``lse`` takes one read; the row's loss
  ``weight * (lse - x[label])``; a second pass writes
  ``dloss / count * weight * (exp(x - lse) - (j == label))``;
- ``ce_loss``: one block sums the rows' losses in a fixed order and divides by the count (the mean
  of SoftmaxCrossEntropyLoss with ``ignore_index``).
All three are deterministic. A label outside [0, C) that is not ignored makes the row's loss NaN
(onnxruntime's CPU kernel raises; the trainer's non-finite check stops the run).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from contract.ops import CROSS_ENTROPY_GRAD, LOSS_DOMAIN, LOSS_VERSION, NO_IGNORED_LABEL
from runtime.errors import RunError
from runtime.gpu.elementwise_steps import PREAMBLE
from runtime.gpu.kernel_runner import RawKernelRunner, aligned, refuse_unless
from runtime.gpu.rewrite_nodes import add_function, attribute, readers_of

DOMAIN = "graph_transpiler.gpu.cross_entropy"  # the runtime's own: the fused nodes of this rewrite
OP = "SoftmaxCrossEntropy"  # (scores, labels, dloss) -> (loss, dscores), attribute ignore_index
THREADS = 1024  # the one-block kernels over the rows
ROW_THREADS = 512  # ce_rows: eight classes a thread a sweep (GPT-2-small's 50,304: about 12 sweeps)

SOURCE = PREAMBLE + r"""
#define GT_INF __int_as_float(0x7f800000)  /* NVRTC has no INFINITY */
__device__ __forceinline__ float gt_load(const void* p, long long i, int bf16) {
    return bf16 ? gt_widen_bf16(((const unsigned short*)p)[i]) : ((const float*)p)[i];
}
__device__ __forceinline__ long long gt_label(const void* p, long long i, int wide) {
    return wide ? ((const long long*)p)[i] : (long long)((const int*)p)[i];
}
__device__ __forceinline__ float gt_block_sum(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < warps ? shared[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;  // every thread holds the block's sum
}
// (m, s) = a running maximum and the sum of exp(x - m): two merged into one.
__device__ __forceinline__ void gt_merge(float& m, float& s, float m2, float s2) {
    const float M = fmaxf(m, m2);
    if (M == -GT_INF) return;
    s = (m == -GT_INF ? 0.f : s * expf(m - M)) + (m2 == -GT_INF ? 0.f : s2 * expf(m2 - M));
    m = M;
}

extern "C" __global__ void ce_weights(const void* labels, int wide, long long rows, long long ignore,
                                      const float* dloss, float* scalars) {
    __shared__ float shared[32];
    float count = 0.f;
    for (long long r = threadIdx.x; r < rows; r += blockDim.x) count += gt_label(labels, r, wide) != ignore ? 1.f : 0.f;
    count = gt_block_sum(count, shared);
    if (threadIdx.x == 0) { scalars[0] = dloss[0] / count; scalars[1] = count; }
}

// Eight consecutive scores of a row from element j: one 16-byte load of bfloat16 (two of float32)
// where ``vec`` (the host checked: C a multiple of 8, the buffers 16-byte aligned), else eight
// loads, -inf past the row's end (no weight in a sum of exponentials).
__device__ __forceinline__ void gt_load8(const void* p, long long base, int j, int C, int bf16, int vec, float v[8]) {
    if (vec && bf16) {
        const uint4 u = *reinterpret_cast<const uint4*>((const unsigned short*)p + base + j);
        const unsigned int w[4] = {u.x, u.y, u.z, u.w};
        for (int k = 0; k < 4; ++k) { v[2 * k] = __uint_as_float(w[k] << 16); v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u); }
    } else if (vec) {
        const float4 a = *reinterpret_cast<const float4*>((const float*)p + base + j);
        const float4 b = *reinterpret_cast<const float4*>((const float*)p + base + j + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        for (int k = 0; k < 8; ++k) v[k] = j + k < C ? gt_load(p, base + j + k, bf16) : -GT_INF;
    }
}

extern "C" __global__ void ce_rows(const void* scores, int in_bf16, const void* labels, int wide, long long ignore,
                                   int C, const float* scalars, float* row_loss, void* dscores, int out_bf16, int vec) {
    __shared__ float shared_m[32], shared_s[32];
    const long long base = (long long)blockIdx.x * C;
    float m = -GT_INF, s = 0.f;
    float v[8];
    for (int j = 8 * threadIdx.x; j < C; j += 8 * blockDim.x) {  // eight scores, one merge
        gt_load8(scores, base, j, C, in_bf16, vec, v);
        float top = v[0];
        for (int k = 1; k < 8; ++k) top = fmaxf(top, v[k]);
        if (top == -GT_INF) continue;
        float sum = 0.f;
        for (int k = 0; k < 8; ++k) sum += expf(v[k] - top);
        gt_merge(m, s, top, sum);
    }
    for (int o = 16; o > 0; o >>= 1) gt_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    if (lane == 0) { shared_m[warp] = m; shared_s[warp] = s; }
    __syncthreads();
    m = lane < warps ? shared_m[lane] : -GT_INF;
    s = lane < warps ? shared_s[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) gt_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    const float lse = m + logf(s);
    const long long label = gt_label(labels, blockIdx.x, wide);
    const float weight = label != ignore ? 1.f : 0.f;
    const long long hit = label != ignore ? label : 0;  // an ignored row points at class 0, weight 0
    const bool inside = hit >= 0 && hit < C;
    if (threadIdx.x == 0)
        row_loss[blockIdx.x] = !inside ? __int_as_float(0x7fc00000) : weight == 0.f ? 0.f : lse - gt_load(scores, base + hit, in_bf16);
    const float coefficient = scalars[0] * weight;
    for (int j = 8 * threadIdx.x; j < C; j += 8 * blockDim.x) {
        gt_load8(scores, base, j, C, in_bf16, vec, v);
        float d[8];
        for (int k = 0; k < 8; ++k) d[k] = coefficient * (expf(v[k] - lse) - (j + k == hit ? 1.f : 0.f));
        if (vec && out_bf16) {
            unsigned int w[4];
            for (int k = 0; k < 4; ++k)
                w[k] = (unsigned int)gt_bf16_bits(gt_round_bf16(d[2 * k])) | ((unsigned int)gt_bf16_bits(gt_round_bf16(d[2 * k + 1])) << 16);
            *reinterpret_cast<uint4*>((unsigned short*)dscores + base + j) = make_uint4(w[0], w[1], w[2], w[3]);
        } else if (vec) {
            *reinterpret_cast<float4*>((float*)dscores + base + j) = make_float4(d[0], d[1], d[2], d[3]);
            *reinterpret_cast<float4*>((float*)dscores + base + j + 4) = make_float4(d[4], d[5], d[6], d[7]);
        } else {
            for (int k = 0; k < 8 && j + k < C; ++k) {
                if (out_bf16) ((unsigned short*)dscores)[base + j + k] = gt_bf16_bits(gt_round_bf16(d[k]));
                else ((float*)dscores)[base + j + k] = d[k];
            }
        }
    }
}

extern "C" __global__ void ce_loss(const float* row_loss, long long rows, const float* scalars, float* loss) {
    __shared__ float shared[32];
    float total = 0.f;
    for (long long r = threadIdx.x; r < rows; r += blockDim.x) total += row_loss[r];
    total = gt_block_sum(total, shared);
    if (threadIdx.x == 0) loss[0] = total / scalars[1];
}
"""

# -- the rewrite --------------------------------------------------------------------------------


def fuse_cross_entropy(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each SoftmaxCrossEntropyLoss and its SoftmaxCrossEntropyGrad node fused (the
    module docstring says where), in place; returned."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    fused = 0
    while (pair := _next_pair(list(graph.node), outputs)) is not None:
        _fuse(model, *pair, op_type=f"{OP}_{fused}")
        fused += 1
    return model


def _next_pair(nodes: list, outputs: set[str]) -> tuple[int, int, int | None, int | None] | None:
    """The positions of (forward, grad, widen or None, narrow or None) of the first pair the rewrite
    takes (positions: a protobuf gives a new Python object at each access, so no identities)."""
    producer = {o: k for k, n in enumerate(nodes) for o in n.output}
    readers = defaultdict(list, readers_of(nodes))
    for g, grad in enumerate(nodes):
        if (grad.domain, grad.op_type) != (LOSS_DOMAIN, CROSS_ENTROPY_GRAD):
            continue
        dloss, scores, labels, log_prob = grad.input
        f = producer.get(log_prob)
        forward = None if f is None else nodes[f]
        if (forward is None or forward.op_type != "SoftmaxCrossEntropyLoss" or forward.domain not in ("", "ai.onnx")
                or list(forward.input) != [scores, labels] or len(forward.output) < 2 or forward.output[1] != log_prob
                or readers[log_prob] != [g] or log_prob in outputs
                or attribute(forward, "reduction", b"mean") not in (b"mean", "mean")
                or attribute(forward, "ignore_index", NO_IGNORED_LABEL) != attribute(grad, "ignore_index", None)
                or (producer.get(dloss, -1) > f and nodes[producer[dloss]].input)):
            continue
        w = producer.get(scores)
        if not (w is not None and nodes[w].op_type == "Cast"
                and attribute(nodes[w], "to", None) == onnx.TensorProto.FLOAT
                and set(readers[scores]) == {f, g} and scores not in outputs):
            w = None
        narrow = readers[grad.output[0]]
        n = narrow[0] if (len(narrow) == 1 and nodes[narrow[0]].op_type == "Cast" and grad.output[0] not in outputs) else None
        return f, g, w, n
    return None


def _fuse(model, f: int, g: int, w: int | None, n: int | None, op_type: str) -> None:
    graph = model.graph
    nodes = list(graph.node)
    forward, grad = nodes[f], nodes[g]
    scores = nodes[w].input[0] if w is not None else forward.input[0]
    dscores = nodes[n].output[0] if n is not None else grad.output[0]
    inputs, results = [scores, forward.input[1], grad.input[0]], [forward.output[0], dscores]
    replaced = [k for k in (w, f, g, n) if k is not None]
    body = []
    for k in replaced:
        copy = onnx.NodeProto()
        copy.CopyFrom(nodes[k])
        body.append(copy)
    add_function(model, DOMAIN, op_type, inputs, results, body, (helper.make_opsetid(LOSS_DOMAIN, LOSS_VERSION),))
    node = helper.make_node(op_type, inputs, results, name=f"{forward.name or 'loss'}/fused", domain=DOMAIN,
                            ignore_index=int(attribute(grad, "ignore_index", NO_IGNORED_LABEL)))
    # The seed, where a node of no inputs (the autodiff's Constant 1) made it after the forward
    # node, moves to just before the fused node.
    seed = next((k for k, x in enumerate(nodes) if grad.input[0] in x.output and k > f), None)
    kept = []
    for k, x in enumerate(nodes):
        if k == f:
            kept += [nodes[seed], node] if seed is not None else [node]
        elif k not in replaced and k != seed:
            kept.append(x)
    del graph.node[:]
    graph.node.extend(kept)


# -- the kernels --------------------------------------------------------------------------------


@dataclass
class _Node:
    name: str
    inputs: list[str]  # scores, labels, dloss
    outputs: list[str]  # loss, dscores
    ignore_index: int

    @classmethod
    def from_node(cls, node, where: str) -> _Node:
        refuse_unless(node, where, OP, 3, 2)
        return cls(node.name, list(node.input), list(node.output),
                   int(attribute(node, "ignore_index", NO_IGNORED_LABEL)))


# How each value arrives (in_session.VIEWS): float32, bfloat16 as its raw bits, int32/int64 labels.
_FLOATS = {np.dtype(np.float32): 0, np.dtype(np.uint16): 1}
_LABELS = {np.dtype(np.int32): 0, np.dtype(np.int64): 1}


def _vectorized(scores, dscores) -> np.int32:
    """Whether ce_rows may move eight classes with one 16-byte access: every row starts 16-byte
    aligned (the classes a multiple of 8, the buffers aligned; onnxruntime's and CuPy's are at least
    256-byte aligned)."""
    return np.int32(scores.shape[1] % 8 == 0 and aligned(scores, dscores))


class CrossEntropyRunner(RawKernelRunner):
    """One fused node's three launches on the device's compute stream (the module docstring); the
    rows' losses and the two scalars live in a scratch buffer the runner keeps (a captured graph
    replays with its pointers)."""

    SOURCE = SOURCE
    KERNELS = ("ce_weights", "ce_rows", "ce_loss")
    WHAT = "fused cross-entropy"

    def __init__(self, group, where: str, device):
        super().__init__(group, where, device)
        self.scratch: dict[str, object] = {}

    def parse(self, node) -> _Node:
        return _Node.from_node(node, self.where)

    def _check(self, op: _Node, values) -> None:
        """Every input and output of its contract dtype and shape (the first call's: every bound
        call's): the kernels would read or write past a smaller buffer without an error."""
        scores, labels, dloss = (values[name] for name in op.inputs)
        if scores.ndim != 2 or scores.dtype not in _FLOATS or not scores.flags.c_contiguous:
            raise RunError(f"{self.where}: '{op.name}': scores must be contiguous float32 or bfloat16 (rows, "
                           f"classes), got {scores.dtype} {tuple(scores.shape)}")
        if labels.dtype not in _LABELS or tuple(labels.shape) != scores.shape[:1]:
            raise RunError(f"{self.where}: '{op.name}': labels must be int32 or int64 of shape {scores.shape[:1]}, "
                           f"got {labels.dtype} {tuple(labels.shape)}")
        if dloss.dtype != np.float32 or dloss.size != 1:
            raise RunError(f"{self.where}: '{op.name}': dloss must be one float32, got {dloss.dtype} {tuple(dloss.shape)}")
        dscores = values[op.outputs[1]]
        if dscores.shape != scores.shape or dscores.dtype not in _FLOATS:
            raise RunError(f"{self.where}: '{op.name}': dscores must be float32 or bfloat16 shaped like "
                           f"the scores {tuple(scores.shape)}, got {dscores.dtype} {tuple(dscores.shape)}")

    def launch(self, values, allocate: bool) -> None:
        cp = self.cp
        weights, rows_kernel, loss_kernel = self.functions()
        with self.stream:
            for op in self.ops:
                scores, labels, dloss = (values[name] for name in op.inputs)
                if allocate:  # a first call: its shapes are every bound call's
                    for name, (shape, dtype) in zip(op.outputs, [((), np.float32), (scores.shape, scores.dtype)]):
                        if name not in values:  # given where the node runs inside a session (in_session.py)
                            values[name] = cp.empty(shape, dtype)
                    self._check(op, values)
                    self.scratch[op.name] = cp.empty(scores.shape[0] + 2, dtype=np.float32)
                loss, dscores = (values[name] for name in op.outputs)
                rows, classes = int(scores.shape[0]), int(scores.shape[1])
                scratch = self.scratch[op.name]
                scalars, row_loss = scratch[rows:], scratch[:rows]
                wide, ignore = np.int32(_LABELS[labels.dtype]), np.int64(op.ignore_index)
                try:
                    weights((1,), (THREADS,), (labels, wide, np.int64(rows), ignore, dloss, scalars))
                    rows_kernel((rows,), (ROW_THREADS,), (scores, np.int32(_FLOATS[scores.dtype]), labels, wide, ignore,
                                                          np.int32(classes), scalars, row_loss, dscores,
                                                          np.int32(_FLOATS[dscores.dtype]), _vectorized(scores, dscores)))
                    loss_kernel((1,), (THREADS,), (row_loss, np.int64(rows), scalars, loss))
                except Exception as exc:
                    raise self.launch_error(op.name, exc) from None
