"""Row scatter-add on the GPU: a ``ScatterND`` node with ``reduction="add"`` whose indices pick
whole rows (the gradient of a ``Gather`` over axis 0: an embedding's, the autodiff writes it as
ScatterND(zeros, Unsqueeze(indices), dY)) becomes one node of ``DOMAIN``, run inside its
onnxruntime session by CuPy RawKernel launches (after a copy of ``data`` where onnxruntime gave
the output a buffer of its own).

Why: onnxruntime's CUDA kernel (``_ScatterNDKernelReduction``) runs one thread per index, which
adds its whole row element by element: GPT-2-small's token embedding (4,096 rows of 768) took
0.29 ms of its 13.2 ms bf16 step on an H200, one thread's 768 strided atomic adds after another.
Here the threads of a block add consecutive elements of a row (coalesced).

The sums are deterministic: each row adds its updates in their order, as onnxruntime's CPU
kernel and NumPy's ``np.add.at`` do, bit for bit, on every run and every rank. That is what lets
`allreduce` scatter-add the ranks' gathered rows on every rank (--sparse-grads): atomic adds would
sum a repeated row in another order on each rank and the replicas would drift. How, in five
launches on n indices of a [rows, C] table: count each row's indices; an exclusive scan of the
counts (one block) gives each row its segment; each index takes a slot in its row's segment (an
atomic counter, in any order); each index's rank among its segment's indices (those smaller than
it) puts the segment in index order; one block per row with indices adds them in that order, its
threads over the columns (coalesced). A row that many indices repeat is summed by one block in
series (a Zipfian token of 5% of GPT-2-small's 16,384 gathered rows: about 800 row reads).
An index outside [-rows, rows) adds nothing (onnxruntime's clamps it to the edge; the forward
Gather of such an index has already failed). The fused node carries a function (the ScatterND it
replaced), so a session that cannot take it computes what the graph computed before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import onnx
from onnx import helper

from runtime.collectives import COLLECTIVE_DOMAIN, publishes_updates
from runtime.errors import RunError
from runtime.gpu.kernel_runner import RawKernelRunner, refuse_unless
from runtime.gpu.rewrite_nodes import add_function, attribute, constant_value, renamed

DOMAIN = "graph_transpiler.gpu.scatter_add"  # the runtime's own: the fused nodes of this rewrite
OP = "ScatterAddRows"  # (data, indices, updates) -> output, ScatterND(reduction="add") over rows
THREADS = 256

SCAN_THREADS = 1024
SOURCE = r"""
__device__ __forceinline__ long long row_of(const long long* indices, int i, long long rows) {
    long long r = indices[i];
    if (r < 0) r += rows;
    return (r < 0 || r >= rows) ? -1 : r;
}

extern "C" __global__ void count_rows(const long long* __restrict__ indices, int n, long long rows, int* counts) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long r = row_of(indices, i, rows);
    if (r >= 0) atomicAdd(counts + r, 1);
}

// One block of 1024 threads: starts[r] = counts[0] + ... + counts[r - 1], for r in [0, rows].
extern "C" __global__ void scan_rows(const int* __restrict__ counts, long long rows, int* starts) {
    __shared__ int partial[1024];
    long long chunk = (rows + blockDim.x - 1) / blockDim.x;
    long long lo = threadIdx.x * chunk, hi = lo + chunk < rows ? lo + chunk : rows;
    int sum = 0;
    for (long long r = lo; r < hi; ++r) sum += counts[r];
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int step = 1; step < blockDim.x; step <<= 1) {  // inclusive scan of the partial sums
        int add = threadIdx.x >= step ? partial[threadIdx.x - step] : 0;
        __syncthreads();
        partial[threadIdx.x] += add;
        __syncthreads();
    }
    int running = threadIdx.x ? partial[threadIdx.x - 1] : 0;
    for (long long r = lo; r < hi; ++r) { starts[r] = running; running += counts[r]; }
    if (threadIdx.x == blockDim.x - 1) starts[rows] = partial[threadIdx.x];
}

extern "C" __global__ void place_rows(const long long* __restrict__ indices, int n, long long rows,
                                      const int* __restrict__ starts, int* fill, int* slots) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long r = row_of(indices, i, rows);
    if (r >= 0) slots[starts[r] + atomicAdd(fill + r, 1)] = i;
}

extern "C" __global__ void order_rows(const long long* __restrict__ indices, int n, long long rows,
                                      const int* __restrict__ starts, const int* __restrict__ slots, int* ordered) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long r = row_of(indices, i, rows);
    if (r < 0) return;
    int lo = starts[r], hi = starts[r + 1], rank = 0;
    for (int k = lo; k < hi; ++k) rank += slots[k] < i;
    ordered[lo + rank] = i;
}

// One block per index; the block of a row's first index adds the row's updates in index order.
extern "C" __global__ void sum_rows(const long long* __restrict__ indices, long long rows,
                                    const int* __restrict__ starts, const int* __restrict__ ordered,
                                    const float* __restrict__ updates, float* __restrict__ out, int C) {
    long long r = row_of(indices, blockIdx.x, rows);
    if (r < 0 || ordered[starts[r]] != (int)blockIdx.x) return;
    int lo = starts[r], hi = starts[r + 1];
    float* dst = out + r * C;
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        float acc = dst[j];
        for (int k = lo; k < hi; ++k) acc += updates[(long long)ordered[k] * C + j];
        dst[j] = acc;
    }
}
"""


def fuse_scatter_add(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each ScatterND(reduction="add") whose indices an Unsqueeze over the last axis
    makes (so each index picks a whole row) replaced by a ``DOMAIN`` node with a function of it, in
    place; returned. Which dtypes the kernel takes is in_session.TAKES' to decide (float32)."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    fused = 0
    for node in graph.node:
        if node.op_type != "ScatterND" or node.domain not in ("", "ai.onnx") or len(node.input) != 3:
            continue
        if attribute(node, "reduction", b"none") != b"add" or not _rows_of(producer.get(node.input[1]), producer):
            continue
        op_type = f"{OP}_{fused}"
        add_function(model, DOMAIN, op_type, ["data", "indices", "updates"], ["output"],
                     [renamed(node, ["data", "indices", "updates"], ["output"])])
        node.domain, node.op_type = DOMAIN, op_type
        del node.attribute[:]
        if _zeros(producer.get(node.input[0])):
            node.attribute.append(helper.make_attribute("zeros", 1))
        fused += 1
    return model


def _zeros(node) -> bool:
    """Whether ``node`` (data's producer) is a ConstantOfShape of 0: the kernel then clears the
    output (a memset) instead of copying a constant onnxruntime folded (GPT-2-small: 154 MB)."""
    if node is None or node.op_type != "ConstantOfShape":
        return False
    value = attribute(node, "value")
    return value is None or not onnx.numpy_helper.to_array(value).any()


def refuse_unordered_row_sums(model: onnx.ModelProto) -> None:
    """A step that sums every rank's gathered rows itself and publishes nothing (--sparse-grads
    under `allreduce`) needs each row's adds in one order on every rank, which the row scatter-add
    kernel gives and onnxruntime's atomic ScatterND does not: refused where the kernel is off
    (GpuBackend.prepare_step_graph), before the replicas drift apart. (Under `sharded` one root sums and Broadcasts.)"""
    nodes = list(model.graph.node)
    read = {name for node in nodes for name in node.input}
    gathered = [n for n in nodes if n.domain == COLLECTIVE_DOMAIN and n.op_type == "AllConcat"
                and any(o in read for o in n.output)]
    if gathered and not publishes_updates(model):
        raise RunError(f"{model.graph.name or 'the step graph'}: every rank sums the gathered rows of "
                       f"'{gathered[0].output[0]}' (--sparse-grads under allreduce), which needs the GPU's row "
                       "scatter-add kernel (one summation order on every rank); it is off here (see the banner's "
                       "kernels line): transpile with --strategy sharded, or without --sparse-grads")


def _rows_of(node, producer) -> bool:
    """Whether ``node`` (the indices' producer) is an Unsqueeze that adds the last axis: a
    constant ``axes`` input of [-1], as the autodiff writes an embedding's gradient."""
    if node is None or node.op_type != "Unsqueeze" or len(node.input) != 2:
        return False
    axes = constant_value(producer.get(node.input[1]))
    return axes is not None and axes.reshape(-1).tolist() == [-1]


@dataclass
class _Node:
    name: str
    inputs: list[str]  # data, indices, updates
    output: str
    zeros: bool  # data is all zeros (fuse_scatter_add saw a ConstantOfShape of 0)

    @classmethod
    def from_node(cls, node, where: str) -> _Node:
        refuse_unless(node, where, OP, 3, 1)
        zeros = any(a.name == "zeros" and a.i for a in node.attribute)
        return cls(node.name, list(node.input), node.output[0], zeros)


class _Scratch(NamedTuple):
    """One int32 buffer for an op's launches on ``sizes`` = (rows, n) indices: counts and fill
    (rows each, together ``cleared`` every launch), starts (rows + 1), slots and ordered (n each)."""

    sizes: tuple[int, int]
    cleared: Any
    counts: Any
    fill: Any
    starts: Any
    slots: Any
    ordered: Any

    @classmethod
    def make(cls, cp, rows: int, n: int) -> _Scratch:
        b = cp.zeros(3 * rows + 1 + 2 * n, dtype=np.int32)
        slots = 3 * rows + 1
        return cls((rows, n), b[:2 * rows], b[:rows], b[rows:2 * rows], b[2 * rows:slots], b[slots:slots + n],
                   b[slots + n:])


class ScatterAddRunner(RawKernelRunner):
    """One fused node: the output cleared where data is zeros, else the copy of ``data`` (none
    where onnxruntime shares its buffer with the output, ``may_inplace``), then the row adds in
    index order (the module docstring), on the device's compute stream."""

    SOURCE = SOURCE
    KERNELS = ("count_rows", "scan_rows", "place_rows", "order_rows", "sum_rows")
    WHAT = "row scatter-add"
    may_inplace = ((0, 0),)  # data -> output: onnxruntime may hand the output data's dead buffer

    def __init__(self, group, where: str, device):
        super().__init__(group, where, device)
        self.scratch: dict[str, _Scratch] = {}

    def parse(self, node) -> _Node:
        return _Node.from_node(node, self.where)

    def _check(self, op: _Node, values) -> None:
        """The contract's shapes (the first call's: every bound call's): the kernel would read or
        write past a smaller buffer without an error."""
        data, indices, updates = (values[name] for name in op.inputs)
        out = values[op.output]
        if data.dtype != np.float32 or data.ndim < 1 or out.shape != data.shape or out.dtype != data.dtype:
            raise RunError(f"{self.where}: '{op.name}': data and output must be float32 of one shape, got "
                           f"{data.dtype} {tuple(data.shape)} and {out.dtype} {tuple(out.shape)}")
        if indices.dtype != np.int64 or indices.ndim < 1 or indices.shape[-1] != 1:
            raise RunError(f"{self.where}: '{op.name}': indices must be int64 (..., 1), got {indices.dtype} "
                           f"{tuple(indices.shape)}")
        want = tuple(indices.shape[:-1]) + tuple(data.shape[1:])
        if updates.dtype != np.float32 or tuple(updates.shape) != want:
            raise RunError(f"{self.where}: '{op.name}': updates must be float32 {want}, got {updates.dtype} "
                           f"{tuple(updates.shape)}")
        if not all(v.flags.c_contiguous for v in (data, indices, updates, out)):
            raise RunError(f"{self.where}: '{op.name}': every input and the output must be contiguous")

    def _scratch(self, op: _Node, rows: int, n: int, allocate: bool) -> _Scratch:
        """The op's int32 scratch (``_Scratch``), made on an allocating launch (never while a CUDA
        graph captures) where the sizes are new, then kept: a captured graph replays its pointers."""
        kept = self.scratch.get(op.name)
        if kept is not None and kept.sizes != (rows, n) and not allocate:
            raise RunError(f"{self.where}: '{op.name}': {n} indices into {rows} rows, its scratch was made for "
                           f"{kept.sizes[1]} into {kept.sizes[0]} (a bound call's shapes changed)")
        if kept is None or kept.sizes != (rows, n):
            kept = self.scratch[op.name] = _Scratch.make(self.cp, rows, n)
        return kept

    def launch(self, values, allocate: bool) -> None:
        count, scan, place_, order, add = self.functions()
        with self.stream:
            for op in self.ops:
                data, indices, updates = (values[name] for name in op.inputs)
                if allocate:
                    if op.output not in values:  # given where the node runs inside a session (in_session.py)
                        values[op.output] = self.cp.empty_like(data)
                    self._check(op, values)
                out = values[op.output]
                if op.zeros:
                    self.cp.cuda.runtime.memsetAsync(out.data.ptr, 0, out.nbytes, self.stream.ptr)
                elif out.data.ptr != data.data.ptr:
                    out[...] = data
                rows, width, n = int(data.shape[0]), int(data.size // max(data.shape[0], 1)), int(indices.size)
                if n == 0 or width == 0:
                    continue
                sc = self._scratch(op, rows, n, allocate)
                blocks, big = ((n + THREADS - 1) // THREADS,), np.int64(rows)
                try:
                    self.cp.cuda.runtime.memsetAsync(sc.cleared.data.ptr, 0, sc.cleared.nbytes, self.stream.ptr)
                    count(blocks, (THREADS,), (indices, np.int32(n), big, sc.counts))
                    scan((1,), (SCAN_THREADS,), (sc.counts, big, sc.starts))
                    place_(blocks, (THREADS,), (indices, np.int32(n), big, sc.starts, sc.fill, sc.slots))
                    order(blocks, (THREADS,), (indices, np.int32(n), big, sc.starts, sc.slots, sc.ordered))
                    add((n,), (THREADS,), (indices, big, sc.starts, sc.ordered, updates, out, np.int32(width)))
                except Exception as exc:
                    raise self.launch_error(op.name, exc) from None
