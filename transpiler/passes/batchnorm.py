"""BatchNormPass: BatchNormalization decomposed into primitive ops with batch statistics."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import FunctionalPass, PassResult

from transpiler.batchnorm import decompose_batchnorm
from transpiler.job import Job


class BatchNormPass(FunctionalPass):
    """Return the forward with every BatchNormalization decomposed (transpiler/batchnorm.py):
    PyTorch's train-mode semantics, running statistics as buffers updated every step.

    The model it returns is the single-device variant. With --sync-bn on several ranks the rank
    graphs need another variant, whose statistics are all-reduced inside the forward; it goes on
    ``job.variants["ranks"]`` (without --sync-bn both keys hold the same model). The user's model
    (``job.problem.model``) is left as it is: the init graphs read the initial values from it.
    """

    def __init__(self, job: Job):
        super().__init__()
        self.job = job

    def call(self, model: ir.Model) -> PassResult:
        job = self.job
        world = job.options.world_size
        source = ir.serde.serialize_model(model)
        job.variants["single"] = decompose_batchnorm(ir.serde.deserialize_model(source), world_size=1)
        if job.options.sync_bn and world > 1:
            job.variants["ranks"] = decompose_batchnorm(ir.serde.deserialize_model(source), world_size=world)
        job.variants.setdefault("ranks", job.variants["single"])
        return PassResult(job.variants["single"][0], modified=True)

    def ensures(self, model: ir.Model) -> None:
        found = sorted(b.name for b in self.job.variants["single"][1])
        if found != sorted(self.job.problem.buffers):
            raise ir.passes.PostconditionError(
                f"the decomposition found buffers {found}, loading found {sorted(self.job.problem.buffers)}")
