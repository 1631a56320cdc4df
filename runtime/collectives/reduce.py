from __future__ import annotations

from runtime.collectives.op import CollectiveOp


class Reduce(CollectiveOp):
    """``y_i = reduce over ranks of x_i`` on ``root``; other ranks contribute and get no outputs."""

    op_type = "Reduce"
    required = ("order", "root", "reduction")

    def check(self):
        super().check()
        root = self.attrs["root"]
        expected = len(self.inputs) if self.rank == root else 0
        if len(self.outputs) != expected:
            role = "root" if self.rank == root else f"non-root (root is {root})"
            raise self.fail(f"Reduce on rank {self.rank} ({role}) has {len(self.outputs)} outputs, expected {expected}")

    def run(self, comm, inputs):
        return comm.reduce(inputs, self.attrs["root"], self.attrs["reduction"]) or []

    # Flat: the whole bucket, reduced in place on the root; other ranks' buffers are only sent.
    def call_flat(self, comm, buf, label):
        comm.reduce_flat(buf, self.attrs["root"], label)

    def receives_result(self, rank):
        return rank == self.attrs["root"]

    def launch_direct(self, comm, sends, recvs, label: str) -> None:
        """Out of place on the caller's buffers (AllReduce.launch_direct); ``recvs`` empty off the root."""
        comm.reduce_many(sends, recvs, self.attrs["root"], self.attrs["reduction"] == "mean", label)
