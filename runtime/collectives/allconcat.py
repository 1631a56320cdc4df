from __future__ import annotations

from runtime.collectives.allgather import AllGather
from runtime.collectives.base import TensorSpec
from runtime.collectives.op import CollectiveOp, FlatLayout, _size


class AllConcat(AllGather):
    """``y`` = the ranks' ``x`` concatenated on axis 0 in rank order: the rows of a sparse gradient
    (its row indices beside them), whose count the graph leaves symbolic. So the output's shape is
    taken from the input's when the node runs (N times its first dimension), never from the
    graph: the same call as AllGather's on the flattened input."""

    op_type = "AllConcat"

    def check(self):
        CollectiveOp.check(self)
        if len(self.inputs) != 1 or len(self.outputs) != 1:
            raise self.fail(f"AllConcat takes one input and gives one output, has {len(self.inputs)} and "
                            f"{len(self.outputs)}")

    def run(self, comm, inputs):
        (x,) = inputs
        if x.ndim == 0:
            raise self.fail("AllConcat input is a scalar; it concatenates on axis 0")
        return comm.all_gather(x, [TensorSpec(self._out_shape(tuple(x.shape), comm.size), x.dtype)])

    @staticmethod
    def _out_shape(shape: tuple[int, ...], world: int) -> tuple[int, ...]:
        return (world * shape[0], *shape[1:])

    # Flat: N slices of the input's size, this rank's holding its input; the output is the whole buffer.
    def flat_layout(self, in_shapes, world, rank):
        (shape,) = (tuple(s) for s in in_shapes)
        return FlatLayout(world * _size(shape), _size(shape), rank, (shape,), (self._out_shape(shape, world),))

    def flat_inputs(self, layout, buf):
        return {self.inputs[0]: layout.mine(buf).reshape(layout.in_shapes[0])}
