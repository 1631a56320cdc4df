from __future__ import annotations

from runtime.collectives.op import CollectiveOp


class AllReduce(CollectiveOp):
    """``y_i = reduce over ranks of x_i`` on every rank."""

    op_type = "AllReduce"
    required = ("order", "reduction")

    def check(self):
        super().check()
        if len(self.inputs) != len(self.outputs):
            raise self.fail(f"AllReduce has {len(self.inputs)} inputs but {len(self.outputs)} outputs")

    def run(self, comm, inputs):
        return comm.allreduce(inputs, self.attrs["reduction"])

    def call_flat(self, comm, buf, label):
        comm.all_reduce_flat(buf, label)

    def launch_direct(self, comm, sends, recvs, label: str) -> None:
        """Out of place on the caller's buffers, one tensor each (runtime/gpu/session_collectives.py);
        the mean included. Needs a communicator with ``all_reduce_many`` (the nccl one)."""
        comm.all_reduce_many(sends, recvs, self.attrs["reduction"] == "mean", label)
