"""``allreduce`` (PyTorch DDP, Horovod): the reference strategy.

Per bucket, one AllReduce(mean) of its gradients on every rank; every rank then updates every
parameter and keeps all the optimizer state. No collective publishes the new values: every
replica computes the same ones. It is the simplest correct strategy and the one the others are
measured against (their N ranks must equal one device exactly as this one's do); its cost is
N copies of the update and of the optimizer state.

Buckets may mix roots, and the placement moves nothing: as DDP does at construction, rank 0
Broadcasts every initial value. So every rank runs the same step graph, and ranks 1..N-1 the same
init graph: OUT holds three rank files whatever N is (docs/scale.md).
"""

from __future__ import annotations

from transpiler.collectives import append_collective
from transpiler.sparse_grads import emit_rows_mean
from transpiler.strategies.base import Strategy


class AllReduce(Strategy):
    name = "allreduce"
    summary = "AllReduce of each bucket, every rank updates everything (DDP/Horovod)"

    def reduce(self, step, bucket):
        return append_collective(
            step.graph, "AllReduce", [step.grads[p] for p in bucket.params],
            like=[step.params[p] for p in bucket.params],
            output_names=[f"{step.job.grad_names[p]}.mean" for p in bucket.params],
            order=step.next_order(), bucket=bucket.id, phase="step", reduction="mean",
        )

    def reduce_rows(self, step, bucket):
        # Every rank scatter-adds every rank's rows: the same sums in the same order (index order,
        # runtime/gpu/scatter_add.py; onnxruntime's CPU kernel), so the replicas stay equal.
        return emit_rows_mean(step, bucket, holds=True)

    def broadcast_at_init(self, state):
        # A parameter's own optimizer state goes with it, so replicas also agree when the state is
        # not zeros; a bucket's flat state (no single parameter, hence no root) starts as zeros on
        # every rank, equal without a collective.
        return super().broadcast_at_init(state) + [e for e in state if e.kind == "optimizer" and e.param is not None]

    def init_roots(self, job):
        return dict.fromkeys(job.placement.roots, 0)

    def rank_key(self, job, rank):
        return rank == 0  # the only rank whose graphs differ: its init graph holds the initial values

    def updates_per_param(self, world):
        return world, world
