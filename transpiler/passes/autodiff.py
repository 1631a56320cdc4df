"""AutodiffPass: the backward appended to the forward, in default-domain ONNX ops."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError, PreconditionError

from transpiler.autodiff import build_gradients
from transpiler.job import Job
from transpiler.names import NEXT
from transpiler.native_ops import add_op_functions


def _nbytes(value: ir.Value) -> int:
    return int(np.prod(value.shape.numpy(), dtype=np.int64)) * value.dtype.bitwidth // 8


class AutodiffPass(InPlacePass):
    """Append the backward; the gradients of the trainable parameters, then the buffers' updated
    values (``{buffer}.next``), become graph outputs. Differentiates every variant of
    ``job.variants`` (the model it is given is the single-device one)."""

    def __init__(self, job: Job):
        super().__init__()
        self.job = job

    def requires(self, model: ir.Model) -> None:
        if not self.job.variants or self.job.variants["single"][0] is not model:
            raise PreconditionError("AutodiffPass differentiates the variants BatchNormPass made; run it first")

    def call(self, model: ir.Model) -> PassResult:
        for _, variant, buffers in self.job.distinct_variants():
            self._differentiate(variant, buffers)
        return PassResult(model, modified=True)

    def _differentiate(self, model: ir.Model, buffers: list) -> None:
        graph = model.graph
        job = self.job
        # --precision fp16: the loss times the loss scale (PrecisionPass), so every gradient is scaled.
        target = job.differentiated or job.problem.loss
        loss = next(v for v in graph.outputs if v.name == target)
        wrt = [graph.initializers[p] for p in job.problem.params]
        grads = build_gradients(graph, loss, wrt)
        add_op_functions(model)  # the functions of backend-native gradient nodes the rules emitted
        job.grad_order = [v.name for v in grads.order]
        job.sizes = {v.name: _nbytes(v) for v in wrt}
        for value in wrt:
            grad = grads.grads[value]
            job.grad_names[value.name] = grad.name
            graph.outputs.append(grad)
        for buffer in buffers:
            buffer.update.name = buffer.name + NEXT
            graph.outputs.append(buffer.update)

    def ensures(self, model: ir.Model) -> None:
        if sorted(self.job.grad_order) != sorted(self.job.problem.params):
            raise PostconditionError("the backward order must list every trainable parameter exactly once")
