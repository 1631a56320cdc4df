"""The rewrite, as composable passes over one shared ``Job``; ``PIPELINE`` is the whole of it.

    BatchNormPass    BatchNormalization decomposed (--sync-bn: a second variant for the ranks)
    PrecisionPass    --precision bf16|fp16: the forward in mixed precision, casts once per value
                     (fp16: the loss times the loss scale); nothing for fp32
    AttentionPass    --precision bf16|fp16: each attention pattern as one fused node; nothing for fp32
    AutodiffPass     forward -> forward + backward (gradients as outputs)
    PlacementPass    root rank of every parameter (hash or balanced)
    BucketingPass    gradients grouped in backward order, as the strategy needs
    SplitRanksPass   per rank: state inputs, the strategy's collectives and updates, init graphs

Each pass is an onnx-ir pass (``call(model) -> PassResult``, one per module) so they compose in a
PassManager, a failure names the passes that ran before it, and ``requires``/``ensures`` check the
invariants around each. The model is handed from pass to pass; what is not a graph (placement,
buckets, the per-rank models) is kept on the Job, which is what ``transpiler.plan`` writes out.
"""

from __future__ import annotations

import re

import onnx_ir as ir

from transpiler.errors import TranspileError
from transpiler.job import (
    LR_INPUT,
    NEXT,
    STEP_STATE,
    Job,
    Options,
    RankGraphs,
    StateEntry,
    reduced_gradient_name,
)
from transpiler.passes.attention import AttentionPass
from transpiler.passes.autodiff import AutodiffPass
from transpiler.passes.batchnorm import BatchNormPass
from transpiler.passes.bucketing import BucketingPass
from transpiler.passes.placement import PlacementPass
from transpiler.passes.precision import PrecisionPass
from transpiler.passes.split_ranks import SplitRanksPass
from transpiler.progress import Progress, Quiet
from transpiler.strategies import STRATEGIES

__all__ = [
    "LR_INPUT", "NEXT", "PIPELINE", "STEP_STATE", "STRATEGIES", "AttentionPass", "AutodiffPass", "BatchNormPass", "BucketingPass",
    "Job", "Options", "PlacementPass", "PrecisionPass", "RankGraphs", "SplitRanksPass", "StateEntry", "reduced_gradient_name",
    "run_passes",
]

PIPELINE = [BatchNormPass, PrecisionPass, AttentionPass, AutodiffPass, PlacementPass, BucketingPass, SplitRanksPass]


def run_passes(job: Job, progress: Progress | None = None) -> None:
    """Run ``PIPELINE`` on the job's model, each pass timed as a stage of ``progress``."""
    progress = progress or Quiet()
    model = job.problem.model
    for make in PIPELINE:
        with progress.stage(_label(make)) as note:
            job.note = note
            try:
                model = ir.passes.PassManager([make(job)], steps=1)(model).model
            except ir.passes.PassError as exc:
                # Surface the user-facing error from inside the pass chain unchanged.
                cause = exc
                while cause is not None and not isinstance(cause, TranspileError):
                    cause = cause.__cause__
                if cause is not None:
                    raise cause from None
                raise


def _label(make: type) -> str:
    """"SplitRanksPass" -> "split ranks"."""
    name = make.__name__.removesuffix("Pass")
    return re.sub(r"(?<=[a-z])(?=[A-Z])", " ", name).lower()
