"""``sharded`` (the seed design, Paddle's multi-GPU ParallelExecutor): the default.

Every bucket holds parameters of one root (``group_by_root``). Reduce(mean) of the bucket to its
root; the root alone updates the bucket's parameters and keeps their optimizer state; it
Broadcasts the new values. Optimizer compute and state are spread over the ranks as evenly as the
placement is, at the communication volume of an AllReduce.

All Reduces come first, in the order the backward finishes their buckets (``publish_after_all_updates``),
so that no Reduce waits behind a Broadcast that waits for an update.

The publish runs at the start of the next step (``publish``): a bucket's Broadcast sends the root's
parameter state (the value its update wrote last step) and the step reads the Broadcast's outputs
in place of the state, so each Broadcast needs to finish only before the forward first reads the
bucket, overlapping the forward of the buckets before it instead of ending the step with nothing
beside it (docs/gpu.md, "The publish at the step's start"). Between steps a rank's state of a
parameter it is not the root of is one update behind; the runtime publishes (the step graph's
leading Broadcasts alone) before anything reads the state on the host: a checkpoint, an evaluation,
the end of a run (runtime/trainer.py ``Trainer.publish``). With ``--grad-accumulation`` transpiled
in, the accumulate graph reads the state as it is, so the publish stays at the step's end there.
"""

from __future__ import annotations

from collections import Counter

from onnx_ir.passes import PostconditionError

from transpiler.collectives import append_collective, collective_nodes
from transpiler.names import NEXT, PUBLISHED
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
        if step.job.options.grad_accumulation == 1:
            self._publish_at_start(step, bucket, new_values)
            return
        published = append_collective(
            step.graph, "Broadcast", new_values or [],
            like=[step.params[p] for p in bucket.params],
            output_names=[p + NEXT for p in bucket.params],
            order=step.next_order(), bucket=bucket.id, phase="step", root=bucket.root,
        )
        for name, value in zip(bucket.params, published):
            step.add_state(step.params[name], value, "param", name)

    @staticmethod
    def _publish_at_start(step, bucket, new_values):
        """The bucket's Broadcast of its parameter inputs from the root, read by the whole step in
        their place (the root's own update too: on the root the outputs equal the inputs). The root
        carries its new values to the next step; the others carry what they received."""
        params = [step.params[p] for p in bucket.params]
        root = bucket.root == step.rank
        published = append_collective(
            step.graph, "Broadcast", params if root else [], like=params,
            output_names=[p + PUBLISHED for p in bucket.params],
            order=step.next_order(), bucket=bucket.id, phase="step", root=bucket.root,
        )
        node = published[0].producer()
        step.graph.remove(node)  # before every reader: the graph stays in topological order
        step.graph.insert_before(step.graph.node(0), node)
        for param, value in zip(params, published):
            for user, index in list(param.uses()):
                if user is not node:
                    user.replace_input_with(index, value)
        for name, param, value in zip(bucket.params, params, new_values if root else published):
            step.add_state(param, value, "param", name)

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
            sent = Counter(v.name.removesuffix(NEXT).removesuffix(PUBLISHED)
                           for n in collective_nodes(r.step.graph) if n.op_type == "Broadcast" for v in n.outputs)
            for p in job.problem.params:
                if sent[p] != 1:
                    raise PostconditionError(f"rank {r.rank}: '{p}' is broadcast {sent[p]} times per step")
