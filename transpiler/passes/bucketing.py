"""BucketingPass: gradients grouped in backward order (transpiler/bucketing.py). Changes no graph."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from transpiler.bucketing import auto_cap_mb, make_buckets
from transpiler.job import Job
from transpiler.sparse_grads import sparse_params
from transpiler.strategies import strategy_for


class BucketingPass(InPlacePass):
    def __init__(self, job: Job):
        super().__init__()
        self.job = job

    def call(self, model: ir.Model) -> PassResult:
        opts = self.job.options
        if opts.sparse_grads and opts.world_size > 1:
            self.job.sparse = sparse_params(self.job, self.job.variants["ranks"][0].graph)
        cap_mb = opts.bucket_mb if opts.bucket_mb is not None else auto_cap_mb(sum(self.job.sizes.values()))
        self.job.bucket_mb = cap_mb
        self.job.buckets = make_buckets(
            self.job.grad_order,
            self.job.sizes,
            self.job.placement.roots,
            int(cap_mb * 2**20),
            # The strategy's placement need: a bucket reduced to one root holds that root's parameters.
            group_by_root=strategy_for(opts.strategy, opts.world_size).group_by_root,
            first_cap_bytes=None if opts.first_bucket_mb is None else int(opts.first_bucket_mb * 2**20),
            alone=frozenset(self.job.sparse),
        )
        return PassResult(model, modified=False)

    def ensures(self, model: ir.Model) -> None:
        bucketed = [p for b in self.job.buckets for p in b.params]
        if sorted(bucketed) != sorted(self.job.grad_order):
            raise PostconditionError("every gradient must be in exactly one bucket")
        if strategy_for(self.job.options.strategy, self.job.options.world_size).group_by_root:
            roots = self.job.placement.roots
            mixed = [b.id for b in self.job.buckets if {roots[p] for p in b.params} != {b.root}]
            if mixed:
                raise PostconditionError(f"buckets {mixed} mix roots; the strategy reduces a bucket to one root")
