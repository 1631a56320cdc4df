from __future__ import annotations

from runtime.collectives.op import CollectiveOp


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
