from __future__ import annotations

from runtime.collectives.op import CollectiveOp, FlatLayout, _size


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

    # Flat: N slices of the input's size; this rank's input is its own slice, the outputs are the
    # gathered buffer's first T elements.
    def flat_layout(self, in_shapes, world, rank):
        in_shapes = tuple(tuple(s) for s in in_shapes)
        shard = _size(in_shapes[0])
        return FlatLayout(world * shard, shard, rank, in_shapes, self._out_shapes())

    def flat_inputs(self, layout, buf):
        return {self.inputs[0]: layout.mine(buf)}

    def call_flat(self, comm, buf, label):
        comm.all_gather_flat(buf, label)
