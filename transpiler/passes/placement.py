"""PlacementPass: the root rank of every parameter (transpiler/placement.py). Changes no graph."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from transpiler.job import Job
from transpiler.placement import place


class PlacementPass(InPlacePass):
    def __init__(self, job: Job):
        super().__init__()
        self.job = job

    def call(self, model: ir.Model) -> PassResult:
        self.job.placement = place(self.job.sizes, self.job.options.world_size, self.job.options.placement)
        return PassResult(model, modified=False)

    def ensures(self, model: ir.Model) -> None:
        roots = self.job.placement.roots
        if set(roots) != set(self.job.problem.params) or not all(
                0 <= r < self.job.options.world_size for r in roots.values()):
            raise PostconditionError("every trainable parameter needs one root rank in [0, world size)")
