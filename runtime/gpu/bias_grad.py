"""A bias gradient in one pass on the GPU: ``ReduceSum`` over the leading axes of a ``Cast`` to
float32 of a bfloat16 value (the Cast read by nothing else), or of a float32 value, becomes one node
of ``DOMAIN``, run inside its onnxruntime session by one CuPy RawKernel launch that reads the
bfloat16 bits (or the float32 values) and sums in float32.

Why: under ``--precision bf16`` the gradient of an attention's query, key and value arrives from
the fused attention's backward in bfloat16, and the bias of each (float32, summed in float32:
ReduceSum is on autocast's float32 list, docs/precision.md) is the column sum of its widening.
onnxruntime runs a Cast (a float32 copy of the whole gradient) and then its reduction: 36 passes
of each kind over 4,096 x 768 values per GPT-2-small step. Here the sum reads the bfloat16 values
once, and nothing of the activation's size is written. A float32 sum (the MLP's and the projections'
biases, whose gradients the fused elementwise chains write in float32) is onnxruntime's
``reduce_matrix_rows`` after a memset of its output, two graph nodes and a gap of ~5 us between
them on an H200 for each of GPT-2-small's 36; here it is one launch. A float32 sum is taken where
the value's type is known and its summed-over rows are at least 32 wide (a column strip's width).

Kernel ``bias_grad`` (the input viewed as R rows of C, R the product of the summed axes):
column_sums.py's layout, as layernorm.py's parameter gradients (runs of rows over about 512 blocks,
each strip's last block summing its runs in order).
Deterministic (the runs depend only on the shape); float32 sums in another order than
onnxruntime's, so not its bits. The fused node carries a function (the Cast and the ReduceSum), so a
session that cannot take it computes what the graph computed before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from runtime.errors import RunError
from runtime.gpu.column_sums import SOURCE as COLUMN_SUMS
from runtime.gpu.column_sums import ColumnSums
from runtime.gpu.kernel_runner import RawKernelRunner, refuse_unless, vector_width
from runtime.gpu.rewrite_nodes import (
    add_function,
    attribute,
    constant_value,
    drop_nodes,
    readers_of,
    value_types,
)

DOMAIN = "graph_transpiler.gpu.bias_grad"  # the runtime's own: the fused nodes of this rewrite
OP = "BiasGrad"  # (x bfloat16, axes) -> ReduceSum(Cast(x, float32), axes, keepdims), attribute keepdims

SOURCE = COLUMN_SUMS + r"""
// column_sums.py's layout, V adjacent columns a thread: each block sums its run of rows into
// ``partial``; its strip's last block sums the runs. X: bfloat16 bits or float32.
template <int V, typename X>
__device__ __forceinline__ void bias_grad_sums(const X* __restrict__ x, float* __restrict__ partial,
                                               unsigned int* __restrict__ counters, float* __restrict__ out,
                                               long long R, int C, long long rows_per_part) {
    __shared__ float s_sum[PART_LANES][32 * V + 1];  // column k of a thread at k * 32 + x: no bank conflict
    const int col = (blockIdx.x * 32 + threadIdx.x) * V;
    const long long first = blockIdx.y * rows_per_part;
    const long long end = first + rows_per_part < R ? first + rows_per_part : R;
    float a[V] = {}, v[V];
    if (col < C)
        for (long long r = first + threadIdx.y; r < end; r += PART_LANES) {
            gt_load<V>(x + r * C + col, v);
            for (int k = 0; k < V; ++k) a[k] += v[k];
        }
    for (int k = 0; k < V; ++k) s_sum[threadIdx.y][k * 32 + threadIdx.x] = a[k];
    __syncthreads();
    const long long parts = gridDim.y;
    if (threadIdx.y == 0 && col < C)
        for (int k = 0; k < V; ++k) {
            float t = 0.f;
            for (int l = 0; l < PART_LANES; ++l) t += s_sum[l][k * 32 + threadIdx.x];
            partial[(long long)blockIdx.y * C + col + k] = t;
        }
    if (!gt_last_block(counters)) return;
    // Every row lane sums every PART_LANES-th run, then lane 0 the lanes' sums: a fixed order.
    float t[V] = {};
    if (col < C)
        for (long long p = threadIdx.y; p < parts; p += PART_LANES) {
            gt_load_cg<V>(partial + p * C + col, v);
            for (int k = 0; k < V; ++k) t[k] += v[k];
        }
    for (int k = 0; k < V; ++k) s_sum[threadIdx.y][k * 32 + threadIdx.x] = t[k];
    __syncthreads();
    if (threadIdx.y == 0 && col < C)
        for (int k = 0; k < V; ++k) {
            float u = 0.f;
            for (int l = 0; l < PART_LANES; ++l) u += s_sum[l][k * 32 + threadIdx.x];
            out[col + k] = u;
        }
}

#define GT_BIAS_GRAD(NAME, V, X)                                                                    \
    extern "C" __global__ void NAME(const X* __restrict__ x, float* __restrict__ partial,             \
                                    unsigned int* __restrict__ counters, float* __restrict__ out,     \
                                    long long R, int C, long long rows_per_part) {                    \
        bias_grad_sums<V>(x, partial, counters, out, R, C, rows_per_part);                            \
    }
GT_BIAS_GRAD(bias_grad, 1, unsigned short)
GT_BIAS_GRAD(bias_grad_f32, 1, float)
GT_BIAS_GRAD(bias_grad4, 4, unsigned short)
GT_BIAS_GRAD(bias_grad_f32_4, 4, float)
"""


def fuse_bias_grads(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each ReduceSum over leading axes (a constant ``axes`` input [0, .., k-1]) of a
    Cast to float32 that only it reads made one ``DOMAIN`` node reading the Cast's input, and each
    such ReduceSum of a float32 value (its type and trailing dimensions known, the rows at least 32
    wide) one reading that value, in place; returned. A Cast is taken only where its input's type
    is known to be bfloat16 or float32 (TAKES lists int64 for ``axes``: an int64 input would be
    taken in and refused by the runner)."""
    graph = model.graph
    types = value_types(graph)
    nodes = list(graph.node)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output}
    readers = readers_of(nodes)
    outputs = {o.name for o in graph.output}
    dropped, fused = set(), 0
    for node in graph.node:
        if node.op_type != "ReduceSum" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        lead = _leading(producer.get(node.input[1]), nodes)
        if not lead:
            continue
        c = producer.get(node.input[0])
        cast = None if c is None else nodes[c]
        if (cast is None or cast.op_type != "Cast" or len(readers.get(cast.output[0], ())) != 1
                or cast.output[0] in outputs or attribute(cast, "to") != onnx.TensorProto.FLOAT
                or types.get(cast.input[0], (None,))[0] not in _SUMMED):
            cast = None
            if not _wide_float(types.get(node.input[0]), lead):
                continue
        keepdims = attribute(node, "keepdims", 1)
        op_type = f"{OP}_{fused}"
        body = [helper.make_node("Cast", ["x"], ["wide"], to=onnx.TensorProto.FLOAT),
                helper.make_node("ReduceSum", ["wide", "axes"], ["sum"], keepdims=keepdims)]
        add_function(model, DOMAIN, op_type, ["x", "axes"], ["sum"], body)
        if cast is not None:
            node.input[0] = cast.input[0]
            dropped.add(c)
        node.domain, node.op_type = DOMAIN, op_type
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("keepdims", keepdims))
        fused += 1
    if fused:
        drop_nodes(graph, nodes, dropped)
    return model


_SUMMED = (onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT)  # what the kernels read


def _leading(k: int | None, nodes) -> int:
    """n where node ``k`` is a Constant of axes [0, 1, .., n-1], else 0."""
    value = constant_value(None if k is None else nodes[k])
    axes = None if value is None else value.reshape(-1).tolist()
    return len(axes) if axes and axes == list(range(len(axes))) else 0


def _wide_float(value_type: tuple | None, lead: int) -> bool:
    """Whether a value of ``value_type`` (rewrite_nodes.value_types) is float32 whose dimensions
    after the first ``lead`` are static and hold at least 32 values."""
    dtype, dims = value_type or (None, None)
    rows = None if dtype != onnx.TensorProto.FLOAT or dims is None or len(dims) <= lead else dims[lead:]
    return rows is not None and None not in rows and int(np.prod(rows)) >= 32


@dataclass
class _Node:
    name: str
    inputs: list[str]  # x, axes
    output: str

    @classmethod
    def from_node(cls, node, where: str) -> _Node:
        refuse_unless(node, where, OP, 2, 1)
        return cls(node.name, list(node.input), node.output[0])


class BiasGradRunner(RawKernelRunner):
    """One fused node's launch (the module docstring); the partial sums and the strips' counters live
    in buffers the runner keeps (a captured graph replays with their pointers)."""

    SOURCE = SOURCE
    KERNELS = ("bias_grad", "bias_grad_f32", "bias_grad4", "bias_grad_f32_4")
    WHAT = "bias gradients"

    def __init__(self, group, where: str, device):
        super().__init__(group, where, device)
        self.sums = ColumnSums(self.cp)

    def parse(self, node) -> _Node:
        return _Node.from_node(node, self.where)

    def launch(self, values, allocate: bool) -> None:
        cp = self.cp
        kernels = dict(zip([(t, v) for v in (1, 4) for t in (np.dtype(np.uint16), np.dtype(np.float32))],
                           self.functions()))
        with self.stream:
            for op in self.ops:
                x, axes = values[op.inputs[0]], values[op.inputs[1]]
                lead = int(axes.size)
                rows = int(np.prod(x.shape[:lead], dtype=np.int64))
                width = int(np.prod(x.shape[lead:], dtype=np.int64))
                if allocate:
                    if (x.dtype, 1) not in kernels or not x.flags.c_contiguous or lead > x.ndim:
                        raise RunError(f"{self.where}: '{op.name}': x must be contiguous bfloat16 or float32 with at least "
                                       f"{lead} axes, got {x.dtype} {tuple(x.shape)}")
                    if op.output not in values:  # given where the node runs inside a session (in_session.py)
                        values[op.output] = cp.empty(x.shape[lead:], np.float32)
                    if values[op.output].size != width or values[op.output].dtype != np.float32:
                        raise RunError(f"{self.where}: '{op.name}': the output must be float32 of {width} elements")
                    self.sums.reserve(rows, width)
                vec = vector_width(width, x)
                grid, block, per_run = self.sums.layout(rows, width, vec)
                try:
                    kernels[x.dtype, vec](grid, block, (x, self.sums.partial, self.sums.counters, values[op.output], np.int64(rows),
                                         np.int32(width), per_run))
                except Exception as exc:
                    raise self.launch_error(op.name, exc) from None
