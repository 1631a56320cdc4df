"""The interface every data-parallel strategy implements (one module per strategy, one table).

A strategy decides, per gradient bucket, on each rank:

1. ``reduce``: how the bucket's gradients are reduced (the collective it appends), and which
   reduced gradients this rank then holds (None: none of this bucket);
2. ``update``: the new values this rank computes from the gradients it holds (through
   ``transpiler.update``, the one place optimizer updates are emitted);
3. ``publish``: how every rank gets the new parameter values (nothing, Broadcast, AllGather), and
   which state outputs carry them;

and, for the whole graph, ``broadcast_at_init`` (which initial state is Broadcast from its root),
its placement need (``group_by_root``) and its invariants (``ensures``).

Clipping (--clip-grad-norm) and gradient accumulation are not strategies' business:
the rank builder wraps any strategy with them once (transpiler/rank_step.py, transpiler/update.py).

Invariants every strategy must keep, like DDP's comm hooks: every rank appends the same
collectives (op, bucket, root, reduction, tensor types) in the same order, whatever it holds;
a rank that skips one hangs the others. ``transpiler.collectives.check_same_sequence`` checks it
for every strategy after the graphs are built. ``allreduce`` is the reference the others are
measured against: N ranks of any strategy equal one device (tests/test_strategies.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Hashable
from typing import TYPE_CHECKING, ClassVar

import onnx_ir as ir
from onnx_ir.passes import PostconditionError

from transpiler.bucketing import Bucket
from transpiler.collectives import collective_nodes
from transpiler.errors import TranspileError
from transpiler.update import emit_bucket_update

if TYPE_CHECKING:
    from transpiler.job import Job, StateEntry
    from transpiler.rank_step import RankStep

REDUCING_OPS = ("AllReduce", "Reduce", "ReduceScatter")


class Strategy(ABC):
    name: ClassVar[str]
    summary: ClassVar[str] = ""  # one line for --strategy's help
    # Chosen by --strategy (the single-device strategy is not: it is what --gpus 1 and the
    # single-device graphs use, whatever --strategy says).
    user_selectable: ClassVar[bool] = True
    single_device: ClassVar[bool] = False
    # Placement need: every bucket holds parameters of one root (it is reduced to that root).
    group_by_root: ClassVar[bool] = False
    # A rank holds only part of the reduced gradients: the global norm of --clip-grad-norm sums the
    # ranks' parts (one scalar AllReduce after the gradient collectives).
    holds_part_of_gradients: ClassVar[bool] = False
    # Publish (Broadcast) only after every update: the Reduces then all come before any Broadcast,
    # so none waits behind an update.
    publish_after_all_updates: ClassVar[bool] = False
    # How many times each gradient is sent through a reducing collective per step, on each rank.
    reductions_per_gradient: ClassVar[int] = 1
    # Largest relative difference from the reference strategy (allreduce) on the same ranks, without
    # clipping: 0 for a strategy that computes the same numbers (tests/test_strategies.py).
    reference_tolerance: ClassVar[float] = 0.0

    @abstractmethod
    def reduce(self, step: RankStep, bucket: Bucket) -> list[ir.Value] | None:
        """Append the bucket's gradient collective; the reduced gradients this rank holds (None:
        none of this bucket)."""

    def reduce_rows(self, step: RankStep, bucket: Bucket) -> list[ir.Value] | None:
        """--sparse-grads: the bucket's one table gradient from every rank's rows (AllConcat,
        transpiler/sparse_grads.py) instead of ``reduce``; the mean gradient where this rank updates
        the table, None elsewhere. `zero` does not take it (Options.validate says why)."""
        raise TranspileError(f"--sparse-grads: not with --strategy {self.name}")

    def update(self, step: RankStep, bucket: Bucket, grads: list[ir.Value]) -> list[ir.Value]:
        """The new values of the bucket's parameters from the gradients this rank holds. Default:
        every parameter of the bucket updated here."""
        return emit_bucket_update(step, bucket, grads)

    def publish(self, step: RankStep, bucket: Bucket, new_values: list[ir.Value] | None) -> None:
        """Make the new values every rank's parameter state. Default: this rank computed them all,
        so they are its state outputs as they are (no collective)."""
        for name, value in zip(bucket.params, new_values):
            step.add_state(step.params[name], value, "param", name)

    def broadcast_at_init(self, state: list[StateEntry]) -> list[StateEntry]:
        """The state entries the init graph Broadcasts from their parameter's root (the others start
        as zeros on every rank, equal without a collective). Default: the parameters, whose initial
        values are stored on their root only."""
        return [e for e in state if e.kind == "param"]

    def init_roots(self, job: Job) -> dict[str, int]:
        """The rank each parameter's initial value is stored on and Broadcast from. Default: its
        placement root, so the init graphs spread the initial values over the ranks."""
        return job.placement.roots

    def rank_key(self, job: Job, rank: int) -> Hashable:
        """Ranks with equal keys get identical graphs, built once and written to one file (OUT
        then does not grow with the world size where the strategy's graphs do not). Default: the
        rank itself, every rank its own graphs. An override must key on everything the strategy's
        graphs read of the rank (tests/test_strategies.py builds every rank alone to check)."""
        return rank

    @abstractmethod
    def updates_per_param(self, world: int) -> tuple[int, int]:
        """(fewest, most) ranks on which a parameter's update runs, for ``ensures``."""

    def ensures(self, job: Job) -> None:
        """Raise PostconditionError unless every parameter is updated on as many ranks as
        ``updates_per_param`` says and every gradient is reduced ``reductions_per_gradient`` times."""
        from transpiler.job import reduced_gradient_name

        low, high = self.updates_per_param(len(job.ranks))
        updates = Counter(p for r in job.ranks for p in r.updates)
        wrong = [p for p in job.problem.params if not low <= updates[p] <= high]
        if wrong:
            raise PostconditionError(f"parameters updated on the wrong number of ranks: {wrong}")
        for r in {id(r.step): r for r in job.ranks}.values():  # each distinct graph once
            sent = sent_to_reduction(r.step.graph)
            for p in job.problem.params:
                count = sent[reduced_gradient_name(job, p)]
                # A table sent as rows (--sparse-grads) is reduced by no reducing collective: its
                # rows go through one AllConcat instead.
                if count != (0 if p in job.sparse else self.reductions_per_gradient):
                    raise PostconditionError(f"rank {r.rank}: gradient of '{p}' is reduced {count} times")
            concats = sum(n.op_type == "AllConcat" for n in collective_nodes(r.step.graph))
            if concats != len(job.sparse):
                raise PostconditionError(f"rank {r.rank}: {concats} AllConcats for {len(job.sparse)} tables sent as rows")


def sent_to_reduction(graph: ir.Graph) -> Counter:
    """How many times each value is an input of a reducing collective in ``graph``."""
    return Counter(v.name for n in collective_nodes(graph) if n.op_type in REDUCING_OPS for v in n.inputs)
