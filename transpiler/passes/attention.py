"""AttentionPass: --precision bf16|fp16, each attention pattern of the forward as one fused node."""

from __future__ import annotations

from onnx_ir.passes import InPlacePass, PassResult

from transpiler.attention import fuse_attention
from transpiler.job import Job
from transpiler.native_ops import add_op_functions


class AttentionPass(InPlacePass):
    """Rewrite every variant's forward (``job.variants``) with ``Attention`` nodes
    (transpiler/attention.py); nothing for fp32. The count goes into the precision report
    (plan.json's ``precision.rewrite.fused_attention``)."""

    def __init__(self, job: Job):
        super().__init__()
        self.job = job

    def call(self, model):
        if self.job.options.precision == "fp32":
            return PassResult(model, modified=False)
        for key, variant, _ in self.job.distinct_variants():
            written = fuse_attention(variant.graph)
            add_op_functions(variant)
            self.job.precision_report.setdefault(key, {})["fused_attention"] = len(written)
        return PassResult(model, modified=True)
