from __future__ import annotations

from runtime.collectives.op import CollectiveOp


class ReduceScatter(CollectiveOp):
    """``y`` = this rank's 1/N slice of the reduced bucket, flattened and zero-padded (docs/contracts.md)."""

    op_type = "ReduceScatter"
    required = ("order", "reduction")

    def check(self):
        super().check()
        if len(self.outputs) != 1 or len(self.output_specs[0].shape) != 1:
            raise self.fail(f"ReduceScatter must have one 1-D output, has {len(self.outputs)} output(s)")
        if not self.inputs:
            raise self.fail("ReduceScatter has no inputs")

    def run(self, comm, inputs):
        shard = comm.reduce_scatter(inputs, self.attrs["reduction"])
        expected = self.output_specs[0].size
        if shard.size != expected:
            raise self.fail(f"ReduceScatter slice has {shard.size} elements but output '{self.outputs[0]}' is "
                            f"typed with {expected} (S = ceil(T / world size))")
        return [shard]
