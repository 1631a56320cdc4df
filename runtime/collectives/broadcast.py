from __future__ import annotations

from runtime.collectives.base import aligned_offsets
from runtime.collectives.op import FLAT_ALIGN, CollectiveOp, FlatLayout


class Broadcast(CollectiveOp):
    """``y_i = x_i of root`` on every rank; only the root has inputs, receivers allocate from the output types."""

    op_type = "Broadcast"
    required = ("order", "root")

    def check(self):
        super().check()
        root = self.attrs["root"]
        expected = len(self.outputs) if self.rank == root else 0
        if len(self.inputs) != expected:
            role = "root" if self.rank == root else f"non-root (root is {root})"
            raise self.fail(f"Broadcast on rank {self.rank} ({role}) has {len(self.inputs)} inputs, expected {expected}")

    def run(self, comm, inputs):
        root = self.attrs["root"]
        return comm.broadcast(inputs if self.rank == root else None, root, self.output_specs)

    # Flat: sized from the outputs, which every rank has (a non-root has no inputs).
    def flat_layout(self, in_shapes, world, rank):
        out_shapes = self._out_shapes()
        return FlatLayout(aligned_offsets(out_shapes, FLAT_ALIGN)[-1], 0, rank, tuple(tuple(s) for s in in_shapes),
                          out_shapes, FLAT_ALIGN)

    def call_flat(self, comm, buf, label):
        comm.broadcast_flat(buf, self.attrs["root"], label)

    def launch_direct(self, comm, sends, recvs, label: str) -> None:
        """Out of place on the caller's buffers (AllReduce.launch_direct); ``sends`` empty off the root."""
        comm.broadcast_many(sends, recvs, self.attrs["root"], label)
