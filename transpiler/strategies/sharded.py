"""``sharded`` (the seed design, Paddle's multi-GPU ParallelExecutor): the default.

Every bucket holds parameters of one root (``group_by_root``). Reduce(mean) of the bucket to its
root; the root alone updates the bucket's parameters and keeps their optimizer state; it
Broadcasts the new values. Optimizer compute and state are spread over the ranks as evenly as the
placement is, at the communication volume of an AllReduce.

All Reduces come first, in the order the backward finishes their buckets, then the Broadcasts in
the same bucket order (``publish_after_all_updates``): each Reduce can start as soon as its
gradients exist, and no Reduce waits behind a Broadcast that waits for an update.
"""

from __future__ import annotations

from collections import Counter

from onnx_ir.passes import PostconditionError

from transpiler.collectives import append_collective, collective_nodes
from transpiler.names import NEXT
from transpiler.sparse_grads import emit_rows_mean
from transpiler.strategies.base import Strategy
from transpiler.update import emit_bucket_update


class Sharded(Strategy):
    name = "sharded"
    summary = "Reduce each bucket to its root, update there, Broadcast"
    group_by_root = True
    holds_part_of_gradients = True
    publish_after_all_updates = True

    def reduce(self, step, bucket):
        root = bucket.root == step.rank
        grads = append_collective(
            step.graph, "Reduce", [step.grads[p] for p in bucket.params],
            like=[step.params[p] for p in bucket.params],
            output_names=[f"{step.job.grad_names[p]}.mean" for p in bucket.params] if root else None,
            order=step.next_order(), bucket=bucket.id, phase="step", root=bucket.root, reduction="mean",
        )
        return grads if root else None

    def reduce_rows(self, step, bucket):
        return emit_rows_mean(step, bucket, holds=bucket.root == step.rank)

    def update(self, step, bucket, grads):
        new_values = emit_bucket_update(step, bucket, grads)
        for name, value in zip(bucket.params, new_values):
            value.name = f"{name}.updated"
        return new_values

    def publish(self, step, bucket, new_values):
        published = append_collective(
            step.graph, "Broadcast", new_values or [],
            like=[step.params[p] for p in bucket.params],
            output_names=[p + NEXT for p in bucket.params],
            order=step.next_order(), bucket=bucket.id, phase="step", root=bucket.root,
        )
        for name, value in zip(bucket.params, published):
            step.add_state(step.params[name], value, "param", name)

    def rank_key(self, job, rank):
        # A rank's graphs differ from another's only in the buckets it is the root of (it receives
        # their Reduce, updates them, sends their Broadcast, stores their initial values); the
        # ranks that root none (most, once N exceeds the buckets) share one set of files.
        return tuple(b.id for b in job.buckets if b.root == rank)

    def updates_per_param(self, world):
        return 1, 1

    def ensures(self, job):
        super().ensures(job)
        for r in {id(r.step): r for r in job.ranks}.values():  # each distinct graph once
            sent = Counter(v.name for n in collective_nodes(r.step.graph) if n.op_type == "Broadcast" for v in n.outputs)
            for p in job.problem.params:
                if sent[p + NEXT] != 1:
                    raise PostconditionError(f"rank {r.rank}: '{p}' is broadcast {sent[p + NEXT]} times per step")
