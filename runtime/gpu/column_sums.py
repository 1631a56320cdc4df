"""Column sums over many rows in one launch, the layout the LayerNorm parameter gradients
(layernorm.py) and the bias gradients (bias_grad.py) share: the rows (R of them, C columns) are cut
into runs, a block of 32 columns x PART_LANES row lanes sums one run of one strip of 32 columns into
a buffer of partial sums, and the strip's last block to finish sums the strip's runs in order.

Why: one block per strip over all rows (the first LayerNorm form) kept 24 blocks busy on
GPT-2-small's 768 columns (27 us a node on an H200); a second launch for the final sums cost
2.5 us more a node. Deterministic: the runs depend only on the shape, every sum is in a fixed order.

- ``SOURCE``: ``PART_LANES`` and ``gt_last_block(counters)``, which every thread of a block calls
  after writing its partial sums: whether the block is its strip's last to finish (the CUDA
  samples' threadfence reduction: its partials are visible device-wide before it is counted). That
  block alone goes on, and the strip's counter is set back to 0 for the next launch (a captured
  graph replays it).
- ``ColumnSums``: a runner's partial sums and counters (grown by its first calls; its nodes run one
  after another on one stream, so they share them) and each launch's grid.
"""

from __future__ import annotations

import numpy as np

PART_LANES = 8  # the row lanes of a block
PARTIAL_BLOCKS = 512  # about four blocks per SM of an H100/H200: enough to keep every SM reading
MIN_PART_ROWS = 64  # a run shorter than this costs more in its partial sums than it spreads

SOURCE = f"#define PART_LANES {PART_LANES}\n" + r"""
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


def row_parts(rows: int, width: int) -> int:
    """How many runs the rows are cut into: about PARTIAL_BLOCKS blocks in all, no run shorter than
    MIN_PART_ROWS rows (so one run where the rows are few)."""
    column_blocks = -(-width // 32)
    return max(1, min(rows // MIN_PART_ROWS, -(-PARTIAL_BLOCKS // column_blocks)))


class ColumnSums:
    """The partial sums (``sums`` per run and column: LayerNorm's dscale and dbias are two) and the
    strips' counters of one runner, device buffers a captured graph replays with."""

    def __init__(self, cp, sums: int = 1):
        self.cp, self.sums = cp, sums
        self.partial = None
        self.counters = None

    def reserve(self, rows: int, width: int) -> None:
        """Buffers large enough for ``rows`` x ``width`` (a first call; the counters start at 0)."""
        size = self.sums * row_parts(rows, width) * width
        if self.partial is None or self.partial.size < size:
            self.partial = self.cp.empty(size, dtype=np.float32)
        if self.counters is None or self.counters.size < -(-width // 32):
            self.counters = self.cp.zeros(-(-width // 32), dtype=np.uint32)

    @staticmethod
    def layout(rows: int, width: int) -> tuple[tuple[int, int], tuple[int, int], np.int64]:
        """(grid, block, rows per run) of a launch over ``rows`` x ``width``."""
        parts = row_parts(rows, width)
        return (-(-width // 32), parts), (32, PART_LANES), np.int64(-(-rows // parts))
