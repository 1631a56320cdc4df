from __future__ import annotations

from runtime.collectives.base import flat_size
from runtime.collectives.op import CollectiveOp, FlatLayout, _size


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

    # Flat: the bucket zero-padded to N*S; rank r's reduced slice lands in place at [r*S, (r+1)*S).
    def flat_layout(self, in_shapes, world, rank):
        in_shapes = tuple(tuple(s) for s in in_shapes)
        _, shard = flat_size([_size(s) for s in in_shapes], world)
        return FlatLayout(world * shard, shard, rank, in_shapes, self._out_shapes())

    def flat_outputs(self, layout, buf):
        return {self.outputs[0]: layout.mine(buf)}

    def flat_mean_view(self, layout, buf):
        return layout.mine(buf)

    def call_flat(self, comm, buf, label):
        comm.reduce_scatter_flat(buf, label)
