"""The fused optimizer updates on the GPU: one multi-tensor CuPy RawKernel launch per run of update
nodes that share op, hyper-parameters, ``lr`` and ``step`` (in practice: per NativeGroup, i.e. per
bucket's updates, or all of them on one device).

Arithmetic: runtime/update_reference.py's ``reference_update``, written out in CUDA with the IEEE
round-to-nearest intrinsics (``__fmul_rn``, ``__fadd_rn``, ``__fdiv_rn``, ``__fsqrt_rn``, ...), which
the compiler never contracts into FMAs, and ``__fmaf_rn`` exactly where torch's kernels fuse (``add``
with alpha, ``addcmul``, ``lerp``). The per-step scalars (``-lr``, AdamW's ``1 - lr*wd``, ``-lr/bc1``,
``sqrt(bc2)``) are computed by thread 0 of every block in float64 from the device values of ``lr``
and ``step`` (never kernel arguments, so a launch stays valid in a CUDA graph across steps) and
rounded to float32 once, like torch's Python-float math; doing it per block costs a few hundred
cycles and saves a separate launch and its buffer.

Work layout: each tensor is cut into chunks of CHUNK elements and every block runs one chunk
(``chunks``: tensor index, first element). Each tensor's row in ``table`` holds its pointers, inputs
then outputs (param, grad, *slots, param', *slots'), its element count and how its gradient is
stored (``GRAD_KINDS``): float32, or a bfloat16 gradient (gradient_casts.py) as its raw bits or,
where it crossed between sessions as float32, as float32 rounded to bfloat16 when read, as the
graph's narrowing would have rounded it. Every kind is read as the float32 the graph's update took,
so the results do not depend on it. GpuProgram double-buffers
state by step parity (runtime/gpu/program.py), so the pointers of a parity change only in the first
calls: the table is rebuilt (one small host-to-device copy) only when a pointer differs from the
last launch of that parity.
"""

from __future__ import annotations

import contextlib
from collections import ChainMap
from typing import Any

import numpy as np

from runtime.errors import RunError
from runtime.executor import SegmentRunner
from runtime.gpu.cuda import compiled_module
from runtime.gpu.elementwise_steps import PREAMBLE
from runtime.gpu.gradient_casts import bfloat16_gradients
from runtime.segments import place
from runtime.update_reference import OPS, UpdateOp

CHUNK = 8192  # elements per block
THREADS = 256

SOURCE = PREAMBLE + r"""
#define STEP_SCALARS_ADAM()                                                                        \
    __shared__ float s_neg_step_size, s_bc2_sqrt, s_decay;                                        \
    if (threadIdx.x == 0) {                                                                       \
        double lr = (double)lr_ptr[0], step = (double)step_ptr[0];                                \
        double bc1 = __dsub_rn(1.0, pow(beta1, step));                                            \
        double bc2 = __dsub_rn(1.0, pow(beta2, step));                                            \
        s_neg_step_size = (float)(-__ddiv_rn(lr, bc1));                                           \
        s_bc2_sqrt = (float)__dsqrt_rn(bc2);                                                      \
        s_decay = (float)__dsub_rn(1.0, __dmul_rn(lr, weight_decay));                             \
    }                                                                                             \
    __syncthreads();

#define CHUNK_RANGE(stride)                                                                       \
    const long long t = chunks[2 * blockIdx.x], start = chunks[2 * blockIdx.x + 1];               \
    const long long* row = table + t * (stride);                                                  \
    const long long n = row[(stride) - 2];                                                        \
    const int g_kind = (int)row[(stride) - 1];                                                    \
    const long long end = start + chunk < n ? start + chunk : n;

// Gradient element i as float32, by GRAD_KINDS: 0 float32; 1 bfloat16 bits, widened exactly;
// 2 float32 rounded to bfloat16 to nearest even (a bfloat16 gradient that crossed as float32).
__device__ __forceinline__ float grad_at(const void* g, long long i, int kind) {
    if (kind == 1) return gt_value(((const unsigned short*)g)[i]);
    const float x = ((const float*)g)[i];
    return kind == 2 ? gt_round_bf16(x) : x;
}

// Four gradient elements from i (a multiple of 4) in one access: 16 bytes of float32, 8 of bfloat16.
__device__ __forceinline__ float4 grad4_at(const void* g, long long i, int kind) {
    float x[4];
    if (kind == 1) gt_load<4>((const unsigned short*)g + i, x);
    else gt_load<4>((const float*)g + i, x);
    if (kind == 2)
        for (int k = 0; k < 4; ++k) x[k] = gt_round_bf16(x[k]);
    return make_float4(x[0], x[1], x[2], x[3]);
}

extern "C" __global__ void fused_sgd(const long long* __restrict__ table, const long long* __restrict__ chunks,
                                     const float* __restrict__ lr_ptr, float wd, int use_wd, long long chunk) {
    CHUNK_RANGE(5)
    const float* p = (const float*)row[0];
    const void* g = (const void*)row[1];
    float* p_out = (float*)row[2];
    const float neg_lr = -lr_ptr[0];
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        float gi = grad_at(g, i, g_kind), pi = p[i];
        if (use_wd) gi = __fmaf_rn(pi, wd, gi);             // grad.add(param, alpha=wd)
        p_out[i] = __fmaf_rn(gi, neg_lr, pi);                // param.add_(grad, alpha=-lr)
    }
}

extern "C" __global__ void fused_momentum(const long long* __restrict__ table, const long long* __restrict__ chunks,
                                          const float* __restrict__ lr_ptr, float wd, int use_wd, float mu,
                                          int nesterov, long long chunk) {
    CHUNK_RANGE(7)
    const float* p = (const float*)row[0];
    const void* g = (const void*)row[1];
    const float* buf = (const float*)row[2];
    float* p_out = (float*)row[3];
    float* buf_out = (float*)row[4];
    const float neg_lr = -lr_ptr[0];
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        float gi = grad_at(g, i, g_kind), pi = p[i];
        if (use_wd) gi = __fmaf_rn(pi, wd, gi);
        float b = __fadd_rn(__fmul_rn(buf[i], mu), gi);    // buf.mul_(mu).add_(grad): two roundings
        buf_out[i] = b;
        gi = nesterov ? __fmaf_rn(b, mu, gi) : b;           // grad.add(buf, alpha=mu)
        p_out[i] = __fmaf_rn(gi, neg_lr, pi);
    }
}

// One element of Adam/AdamW (mode: 0 no weight decay, 1 Adam's L2 penalty into the gradient,
// 2 AdamW's decoupled decay); the same operations in the same order for every element, whether it
// came in a 16-byte load or alone, so the bits do not depend on the alignment.
__device__ __forceinline__ void adam_element(float& pi, float gi, float& mi, float& vi, int mode, float decay,
                                             float wd_f, bool small_weight, float w, float w_minus_one,
                                             float one_minus_beta2, float beta2_f, float bc2_sqrt, float eps,
                                             float neg_step_size) {
    if (mode == 2) pi = __fmul_rn(pi, decay);            // param.mul_(1 - lr*wd)
    else if (mode == 1) gi = __fmaf_rn(pi, wd_f, gi);    // grad.add(param, alpha=wd)
    float diff = __fsub_rn(gi, mi);                      // exp_avg.lerp_(grad, 1 - beta1)
    mi = small_weight ? __fmaf_rn(w, diff, mi) : __fmaf_rn(w_minus_one, diff, gi);
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    vi = __fmaf_rn(__fmul_rn(one_minus_beta2, gi), gi, __fmul_rn(vi, beta2_f));
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
    pi = __fadd_rn(pi, __fdiv_rn(__fmul_rn(neg_step_size, mi), denom));  // addcdiv_
}

extern "C" __global__ void fused_adam(const long long* __restrict__ table, const long long* __restrict__ chunks,
                                      const float* __restrict__ lr_ptr, const float* __restrict__ step_ptr,
                                      double beta1, double beta2, double weight_decay,
                                      float w, float w_minus_one, float one_minus_beta2, float beta2_f, float eps,
                                      float wd_f, int mode, long long chunk) {
    STEP_SCALARS_ADAM()
    CHUNK_RANGE(9)
    const float* p = (const float*)row[0];
    const void* g = (const void*)row[1];
    const float* m = (const float*)row[2];
    const float* v = (const float*)row[3];
    float* p_out = (float*)row[4];
    float* m_out = (float*)row[5];
    float* v_out = (float*)row[6];
    const float neg_step_size = s_neg_step_size, bc2_sqrt = s_bc2_sqrt, decay = s_decay;
    const bool small_weight = fabsf(w) < 0.5f;
    long long i = start;  // chunks start at multiples of CHUNK, a multiple of 4
    // Four elements per access where all seven tensors are aligned to one (16 bytes; 8 for bfloat16
    // gradient bits; a view into a flat bucket may not be): the update moves 28 bytes an element
    // (float32 gradients), so its speed is the memory's.
    bool aligned = (row[1] & (g_kind == 1 ? 7 : 15)) == 0;
    for (int k = 0; k < 7; ++k) aligned = aligned && (k == 1 || (row[k] & 15) == 0);
    if (aligned) {
        const long long quads = (end - start) >> 2;
        for (long long q = threadIdx.x; q < quads; q += blockDim.x) {
            const long long e = start + 4 * q;
            float4 p4 = *reinterpret_cast<const float4*>(p + e), g4 = grad4_at(g, e, g_kind);
            float4 m4 = *reinterpret_cast<const float4*>(m + e), v4 = *reinterpret_cast<const float4*>(v + e);
            adam_element(p4.x, g4.x, m4.x, v4.x, mode, decay, wd_f, small_weight, w, w_minus_one, one_minus_beta2, beta2_f, bc2_sqrt, eps, neg_step_size);
            adam_element(p4.y, g4.y, m4.y, v4.y, mode, decay, wd_f, small_weight, w, w_minus_one, one_minus_beta2, beta2_f, bc2_sqrt, eps, neg_step_size);
            adam_element(p4.z, g4.z, m4.z, v4.z, mode, decay, wd_f, small_weight, w, w_minus_one, one_minus_beta2, beta2_f, bc2_sqrt, eps, neg_step_size);
            adam_element(p4.w, g4.w, m4.w, v4.w, mode, decay, wd_f, small_weight, w, w_minus_one, one_minus_beta2, beta2_f, bc2_sqrt, eps, neg_step_size);
            *reinterpret_cast<float4*>(p_out + e) = p4;
            *reinterpret_cast<float4*>(m_out + e) = m4;
            *reinterpret_cast<float4*>(v_out + e) = v4;
        }
        i = start + 4 * quads;  // the tensor's last few elements, if its size is no multiple of 4
    }
    for (i += threadIdx.x; i < end; i += blockDim.x) {
        float pi = p[i], mi = m[i], vi = v[i];
        adam_element(pi, grad_at(g, i, g_kind), mi, vi, mode, decay, wd_f, small_weight, w, w_minus_one, one_minus_beta2, beta2_f, bc2_sqrt, eps, neg_step_size);
        p_out[i] = pi;
        m_out[i] = mi;
        v_out[i] = vi;
    }
}
"""

# Inside a session (in_session.py) the pointers are onnxruntime's, known only at each call, and a
# captured graph replays what the call enqueued: so the table is written on the stream by a kernel
# whose arguments are its entries (a replay writes them again), up to TABLE_ARGS a launch (within
# CUDA's 4 KiB of kernel arguments), just before the update reads it.
TABLE_ARGS = 480
TABLE_SOURCE = (
    "extern \"C\" __global__ void write_table(long long* __restrict__ dst, int n, "
    + ", ".join(f"long long a{k}" for k in range(TABLE_ARGS)) + ") {\n"
    # One thread, straight-line stores from the arguments: an array indexed at run time would live
    # in local memory, whose reservation for every thread the device can hold cost 0.4-0.5 GiB.
    + "    if (threadIdx.x != 0) return;\n"
    + "".join(f"    if ({k} < n) dst[{k}] = a{k};\n" for k in range(TABLE_ARGS)) + "}\n")

# How a gradient is stored, as the kernels' grad_at reads it: its float32 values; a bfloat16
# gradient's raw bits (CuPy holds bfloat16 as uint16); a bfloat16 gradient's float32 widening (where
# it crossed between items as float32: compile.WidenBfloat16), rounded to bfloat16 when read.
GRAD_KINDS = {"float32": 0, "bfloat16": 1, "bfloat16 as float32": 2}


def grad_kind(bfloat16: bool, dtype) -> int | None:
    """The GRAD_KINDS entry of a gradient array of ``dtype`` whose graph value is bfloat16 (or
    float32); None where the kernels cannot read it."""
    if dtype == np.float32:
        return GRAD_KINDS["bfloat16 as float32" if bfloat16 else "float32"]
    return GRAD_KINDS["bfloat16"] if bfloat16 and dtype == np.uint16 else None


_KERNEL = {"SGD": "fused_sgd", "Momentum": "fused_momentum", "Adam": "fused_adam", "AdamW": "fused_adam"}


def kernel_arguments(op: UpdateOp) -> tuple:
    """The scalar arguments after (table, chunks, lr[, step]), typed as the kernel declares them."""
    h, c = op.h, op.constants()
    wd = h["weight_decay"]
    if op.op_type == "SGD":
        return (c["weight_decay"], np.int32(wd != 0))
    if op.op_type == "Momentum":
        return (c["weight_decay"], np.int32(wd != 0), c["momentum"], np.int32(bool(h["nesterov"])))
    mode = 0 if wd == 0 else (2 if op.op_type == "AdamW" else 1)
    return (np.float64(h["beta1"]), np.float64(h["beta2"]), np.float64(wd), c["one_minus_beta1"],
            c["one_minus_beta1_minus_one"], c["one_minus_beta2"], c["beta2"], c["eps"], c["weight_decay"],
            np.int32(mode))


class _Launch:
    """Consecutive update nodes with one launch key: one kernel launch per call."""

    def __init__(self, ops: list[UpdateOp], bfloat16_grads: frozenset[str]):
        self.ops = ops
        self.first = ops[0]
        self.bfloat16_grads = bfloat16_grads  # gradients the graph gives in bfloat16 (gradient_casts.py)
        self.arguments = kernel_arguments(self.first)
        # (2 + slots) inputs, (1 + slots) outputs, numel, the gradient's kind
        self.stride = 2 * len(OPS[self.first.op_type][0]) + 5
        self.tables: list[tuple[tuple, Any] | None] = [None, None]  # per parity: (pointers, device table)
        self.chunks = None  # device (tensor, start) pairs, fixed once the sizes are known
        self.grid = 0
        self.names = [(*op.tensors_in, *op.outputs) for op in ops]  # table order, per node
        self.kernel = None
        # Inside a session (launch_inside): the gradients' kinds, the table's buffer, its writer.
        self.kinds: list[int] = []
        self.inside_table = None
        self.writer = None
        self.written: list[int] = []  # the entries the last uncaptured call wrote
        self.writer_captured = False  # a capture holds the writer: its replays write the table too

    def _rows(self, values: dict[str, Any], where: str) -> list[tuple[list[Any], int]]:
        """Each node's arrays in table order, checked (contiguous, of one element count, float32 but
        for a bfloat16 gradient's raw bits), and its gradient's kind (GRAD_KINDS)."""
        rows = []
        for op, names in zip(self.ops, self.names):
            arrays = [values[name] for name in names]
            size = arrays[0].size
            kind = grad_kind(op.grad in self.bfloat16_grads, arrays[1].dtype)
            for k, (name, array) in enumerate(zip(names, arrays)):
                ok = kind is not None if k == 1 else array.dtype == np.float32
                if not ok or array.size != size or not array.flags.c_contiguous:
                    needs = "float32" + (" or bfloat16" if op.grad in self.bfloat16_grads and k == 1 else "")
                    raise RunError(f"{where}: fused {op.op_type} of '{op.param}': '{name}' is {array.dtype} "
                                   f"{list(array.shape)}; the kernel needs contiguous {needs} of {size} elements")
            rows.append((arrays, kind))
        return rows

    def launch(self, cp, parity: int, values: dict[str, Any], where: str) -> None:
        """Between sessions: the program's buffers, whose pointers change only in the first calls."""
        # Only the pointers are compared every step; the arrays are checked when they change.
        pointers = tuple(values[name].data.ptr for names in self.names for name in names)
        cached = self.tables[parity]
        if cached is None or cached[0] != pointers:
            rows = self._rows(values, where)
            table = np.array([self._row(arrays, kind) for arrays, kind in rows], dtype=np.int64)
            cached = (pointers, cp.asarray(table.reshape(-1)))
            self.tables[parity] = cached
            self._set_chunks(cp, rows)
        self._update(cp, cached[1], values)

    def launch_inside(self, cp, values: dict[str, Any], where: str, allocate: bool) -> None:
        """Inside a session (in_session.py): onnxruntime's buffers, this call's. The table is
        written on the stream from this call's pointers (TABLE_SOURCE), then read by the update.
        ``allocate``: the first call, which checks the arrays and makes the table's buffer (the
        session's sizes are static, so the chunks never change)."""
        if allocate:
            rows = self._rows(values, where)
            self.kinds = [kind for _, kind in rows]
            self.inside_table = cp.empty(max(len(rows) * self.stride, 1), dtype=np.int64)
            self._set_chunks(cp, rows)
            self.writer = compiled_module(cp, TABLE_SOURCE).get_function("write_table")
        entries = [entry for names, kind in zip(self.names, self.kinds)
                   for entry in self._row([values[name] for name in names], kind)]
        # The table holds the last entries written, unless a captured graph holding the writer
        # replayed since (with its own): once one may exist, write every call.
        if cp.cuda.get_current_stream().is_capturing():
            self.writer_captured = True
        elif entries == self.written and not self.writer_captured:
            self._update(cp, self.inside_table, values)
            return
        self.written = entries
        for first in range(0, len(entries), TABLE_ARGS):
            part = entries[first:first + TABLE_ARGS]
            padded = [np.int64(e) for e in part] + [np.int64(0)] * (TABLE_ARGS - len(part))
            self.writer((1,), (32,), (self.inside_table[first:], np.int32(len(part)), *padded))
        self._update(cp, self.inside_table, values)

    def _row(self, arrays: list[Any], kind: int) -> list[int]:
        """A tensor's row of the table: its pointers (table order), its element count, its gradient's kind."""
        row = [a.data.ptr for a in arrays] + [arrays[0].size, kind]
        assert len(row) == self.stride, (len(row), self.stride)  # the kernel's row length
        return row

    def _set_chunks(self, cp, rows) -> None:
        if self.chunks is None:  # sizes never change after the first call
            pairs = [(t, start) for t, (arrays, _) in enumerate(rows) for start in range(0, arrays[0].size, CHUNK)]
            self.grid = len(pairs)
            self.chunks = cp.asarray(np.array(pairs or [(0, 0)], dtype=np.int64).reshape(-1))

    def _update(self, cp, table, values: dict[str, Any]) -> None:
        if self.grid == 0:
            return
        lr = values[self.first.lr]
        step = (values[self.first.step],) if self.first.step is not None else ()
        if self.kernel is None:
            self.kernel = compiled_module(cp, SOURCE).get_function(_KERNEL[self.first.op_type])
        self.kernel((self.grid,), (THREADS,), (table, self.chunks, lr, *step, *self.arguments, np.int64(CHUNK)))


class FusedUpdateRunner(SegmentRunner):
    """A NativeGroup of fused update nodes on the GPU; the interface of OrtCudaSegment (``run`` on the
    first call, then ``prepare`` per parity and ``run_bound``), so GpuProgram treats it like a segment:
    its outputs are bound into the same double buffers and collective slots."""

    def __init__(self, group, where: str, device):
        self.cp = device.cp
        self.where = f"{where}: fused updates in {place(group)}"
        self.ops = [UpdateOp.from_node(node, where) for node in group.nodes]
        self.bfloat16_grads = bfloat16_gradients(group.nodes)
        self.launches = _launches(self.ops, self.bfloat16_grads)
        self.inputs, self.outputs = list(group.inputs), list(group.outputs)
        self.prepared: list[dict[str, Any] | None] = [None, None]
        # The device's compute stream (the one onnxruntime runs on), whatever stream is current.
        self.stream = getattr(device, "compute", None)

    def bfloat16_inputs(self) -> frozenset[str]:
        """Inputs it reads as bfloat16 where they come so (buffers.bfloat16_edges)."""
        return self.bfloat16_grads

    def in_place_pairs(self) -> dict[str, str]:
        """Output -> the input it may overwrite: param' -> param, slot' -> slot. Each element is
        read once and written once, by the same thread, so the kernels are correct in place."""
        return {out: src for op in self.ops for src, out in zip((op.param, *op.slots), op.outputs)}

    def launch(self, values: dict[str, Any], *, allocate: bool) -> None:
        """One call inside a session (in_session.py), on its arrays (onnxruntime's buffers; an
        output the program binds over its input is the input's buffer: in place, as above)."""
        with self._on_stream():
            for launch in self.launches:
                launch.launch_inside(self.cp, values, self.where, allocate)

    def _on_stream(self):
        return self.stream if self.stream is not None else contextlib.nullcontext()

    def run(self, feeds):
        """First call: outputs allocated here, pointer tables built for this call only."""
        cp = self.cp
        values = dict(feeds)
        with self._on_stream():
            for launch in self.launches:
                for op in launch.ops:
                    for source, name in zip((op.param, *op.slots), op.outputs):
                        values[name] = cp.empty_like(values[source])
                launch.launch(cp, 0, values, self.where)
                launch.tables[0] = None  # these outputs are temporary; the bound ones differ
        return [values[name] for name in self.outputs]

    def prepare(self, parity: int, outputs: dict[str, Any]) -> None:
        self.prepared[parity] = dict(outputs)

    def run_bound(self, parity: int, env: dict[str, Any]) -> None:
        # A view, not a merged copy: run every step, and the program's env holds every value of it.
        values = ChainMap(self.prepared[parity], env)
        with self._on_stream():
            for launch in self.launches:
                launch.launch(self.cp, parity, values, self.where)


def _launches(ops: list[UpdateOp], bfloat16_grads: frozenset[str]) -> list[_Launch]:
    """``ops`` in order as launches: consecutive nodes of one launch key, a new launch wherever a
    node reads what the launch before it writes."""
    runs: list[list[UpdateOp]] = []
    produced: set[str] = set()  # by the current run: a node reading one starts a new launch
    for op in ops:
        if runs and runs[-1][0].launch_key() == op.launch_key() and not produced & {*op.tensors_in, op.lr}:
            runs[-1].append(op)
        else:
            runs.append([op])
            produced = set()
        produced |= set(op.outputs)
    return [_Launch(run, bfloat16_grads) for run in runs]
