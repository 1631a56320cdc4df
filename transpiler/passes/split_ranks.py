"""SplitRanksPass: the single-device graphs and one step, init (and accumulate) graph per rank."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from transpiler.collectives import check_same_sequence
from transpiler.job import Job
from transpiler.rank_graphs import build_rank
from transpiler.strategies import strategy_for


class SplitRanksPass(InPlacePass):
    """Per rank: parameters and optimizer state become state inputs, the strategy inserts its
    collectives and puts the optimizer updates where it decides, and an init graph Broadcasts the
    parameters from their roots (transpiler/rank_graphs.py).

    ``ensures``: every rank issues the same collectives in the same order (any strategy), and the
    strategy's own invariants (``Strategy.ensures``: each gradient reduced once, each parameter
    updated on as many ranks as the strategy says).
    """

    def __init__(self, job: Job):
        super().__init__()
        self.job = job

    def call(self, model: ir.Model) -> PassResult:
        job = self.job
        # Each graph gets its own copy of the forward + backward, made from one serialization.
        protos = {}
        for key, (variant, _) in job.variants.items():
            same = next((k for k in protos if job.variants[k][0] is variant), None)
            protos[key] = protos[same] if same is not None else ir.serde.serialize_model(variant)
        job.single = build_rank(job, None, protos)
        # Ranks the strategy keys alike get the same graph objects (built once, written once).
        strategy = strategy_for(job.options.strategy, job.options.world_size)
        built: dict = {}
        job.ranks = []
        for r in range(job.options.world_size):
            key = strategy.rank_key(job, r)
            if key not in built:
                job.note(f"rank {r + 1}/{job.options.world_size}")
                built[key] = build_rank(job, r, protos)
            job.ranks.append(dataclasses.replace(built[key], rank=r))
        return PassResult(model, modified=False)

    def ensures(self, model: ir.Model) -> None:
        job = self.job
        check_same_sequence([r.step.graph for r in job.ranks], "step")
        check_same_sequence([r.init.graph for r in job.ranks], "init")
        if job.options.grad_accumulation > 1:
            check_same_sequence([r.accum.graph for r in job.ranks], "accum")
        strategy_for(job.options.strategy, job.options.world_size).ensures(job)
