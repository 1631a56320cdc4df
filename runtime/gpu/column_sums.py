"""Column sums over many rows in one launch, the layout the LayerNorm parameter gradients
(layernorm.py) and the bias gradients (bias_grad.py) share: the rows (R of them, C columns) are cut
into runs, a block of 32 columns x PART_LANES row lanes sums one run of one strip of 32 columns into
a buffer of partial sums, and the strip's last block to finish sums the strip's runs in a fixed order.

Why: one block per strip over all rows (the first LayerNorm form) kept 24 blocks busy on
GPT-2-small's 768 columns (27 us a node on an H200); a second launch for the final sums cost
2.5 us more a node. Deterministic: the runs depend only on the shape, every sum is in a fixed order.

Where the width is a multiple of 4 and the pointers 16-byte aligned (kernel_runner.vector_width), each thread takes
4 adjacent columns, one vector load a row (a strip then 128 columns wide): a warp reads 512 bytes of
a float32 row per load instead of 128 (the float32 bias sums of GPT-2-small ran at 1.5 TB/s).

- ``SOURCE``: ``PART_LANES`` (with elementwise_steps' PREAMBLE and its ``gt_load<V>``, V adjacent
  values of bfloat16 bits or float32 widened) and ``gt_last_block(counters)``, which every thread of a block calls
  after writing its partial sums: whether the block is its strip's last to finish (the CUDA
  samples' threadfence reduction: its partials are visible device-wide before it is counted). That
  block alone goes on, and the strip's counter is set back to 0 for the next launch (a captured
  graph replays it); its row lanes share summing the runs (each every PART_LANES-th run, then
  lane 0 the lanes' sums, a fixed order), where one lane summing them in turn made a chain of
  ``parts`` dependent reads of L2 per column (``gt_load_cg``).
- ``ColumnSums``: a runner's partial sums and counters (grown by its first calls; its nodes run one
  after another on one stream, so they share them) and each launch's grid.
"""

from __future__ import annotations

import numpy as np

from runtime.gpu.elementwise_steps import PREAMBLE

PART_LANES = 8  # the row lanes of a block
PARTIAL_BLOCKS = 512  # about four blocks per SM of an H100/H200: enough to keep every SM reading
MIN_PART_ROWS = 64  # a run shorter than this costs more in its partial sums than it spreads

# With elementwise_steps' PREAMBLE (its bfloat16 helpers), which a source including this one has.
SOURCE = PREAMBLE + f"#define PART_LANES {PART_LANES}\n" + r"""
// V adjacent partial sums, read past L1 (another block wrote them): one 16-byte load for 4.
template <int V>
__device__ __forceinline__ void gt_load_cg(const float* __restrict__ p, float* v) {
    if (V == 4) {
        const float4 a = __ldcg(reinterpret_cast<const float4*>(p));
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    } else {
        for (int k = 0; k < V; ++k) v[k] = __ldcg(p + k);
    }
}
__device__ __forceinline__ bool gt_last_block(unsigned int* counters) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) {
        last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
        if (last) counters[blockIdx.x] = 0u;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}
"""


def row_parts(rows: int, width: int, vec: int = 1) -> int:
    """How many runs the rows are cut into: about PARTIAL_BLOCKS blocks in all (strips of 32 * vec
    columns), no run shorter than MIN_PART_ROWS rows (so one run where the rows are few)."""
    column_blocks = -(-width // (32 * vec))
    return max(1, min(rows // MIN_PART_ROWS, -(-PARTIAL_BLOCKS // column_blocks)))


class ColumnSums:
    """The partial sums (``sums`` per run and column: LayerNorm's dscale and dbias are two) and the
    strips' counters of one runner, device buffers a captured graph replays with."""

    def __init__(self, cp, sums: int = 1):
        self.cp, self.sums = cp, sums
        self.partial = None
        self.counters = None

    def reserve(self, rows: int, width: int) -> None:
        """Buffers large enough for ``rows`` x ``width`` at either vector width (a first call; the
        counters start at 0)."""
        size = self.sums * max(row_parts(rows, width, 1), row_parts(rows, width, 4)) * width
        if self.partial is None or self.partial.size < size:
            self.partial = self.cp.empty(size, dtype=np.float32)
        if self.counters is None or self.counters.size < -(-width // 32):
            self.counters = self.cp.zeros(-(-width // 32), dtype=np.uint32)

    @staticmethod
    def layout(rows: int, width: int, vec: int = 1) -> tuple[tuple[int, int], tuple[int, int], np.int64]:
        """(grid, block, rows per run) of a launch over ``rows`` x ``width``, ``vec`` columns a thread."""
        parts = row_parts(rows, width, vec)
        return (-(-width // (32 * vec)), parts), (32, PART_LANES), np.int64(-(-rows // parts))
