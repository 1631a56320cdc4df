from __future__ import annotations

from runtime.collectives.op import CollectiveOp


class AllGather(CollectiveOp):
    """``y_1..y_k`` = the ranks' 1-D slices concatenated in rank order, cut to the outputs' types."""

    op_type = "AllGather"
    required = ("order",)

    def check(self):
        super().check()
        if len(self.inputs) != 1:
            raise self.fail(f"AllGather takes one 1-D input, has {len(self.inputs)}")
        if not self.outputs:
            raise self.fail("AllGather has no outputs")

    def run(self, comm, inputs):
        (shard,) = inputs
        total = sum(spec.size for spec in self.output_specs)
        if shard.ndim != 1 or shard.size * comm.size < total:
            raise self.fail(f"AllGather input has shape {list(shard.shape)}; {comm.size} slices must hold the "
                            f"{total} output elements (S = ceil(T / world size))")
        return comm.all_gather(shard, self.output_specs)
