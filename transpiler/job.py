"""What the passes share: the user's options, and the ``Job`` each pass adds its findings to."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from transpiler.bucketing import Bucket
from transpiler.errors import TranspileError
from transpiler.lazy_weights import inline_weights
from transpiler.load import Problem
from transpiler.names import ACC, AFTER_GRADIENTS, LR_INPUT, NEXT, STEP_STATE
from transpiler.optimizer import OptimizerConfig
from transpiler.placement import Placement
from transpiler.strategies import DEFAULT_STRATEGY, user_strategies

__all__ = ["ACC", "AFTER_GRADIENTS", "LR_INPUT", "NEXT", "STEP_STATE", "Job", "Options", "RankGraphs", "StateEntry",
           "reduced_gradient_name"]

MAX_GRAD_ACCUMULATION = 1024
MAX_WORLD_SIZE = 4096  # zero still builds and writes every rank's graphs: docs/scale.md says how far N goes


@dataclass(frozen=True)
class Options:
    world_size: int = 1
    strategy: str = DEFAULT_STRATEGY
    placement: str = "hash"
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig("sgd"))
    bucket_mb: float = 25.0
    sync_bn: bool = False  # BatchNormalization statistics all-reduced across ranks
    # Update each bucket of several parameters as one flat vector (fewer, larger ops: for GPUs,
    # where ~25 small kernels per parameter cost launches; on CPU the copies make it slower).
    # Micro-batches per optimizer step: K-1 accumulate-graph runs, then the step graph, whose
    # gradients are the mean over the K micro-batches (DDP's no_sync, Horovod's backward_passes_per_step).
    grad_accumulation: int = 1

    def validate(self) -> None:
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise TranspileError(f"--gpus must be in [1, {MAX_WORLD_SIZE}] (got {self.world_size})")
        if self.strategy not in user_strategies():
            raise TranspileError(f"--strategy '{self.strategy}' is not one of: {', '.join(user_strategies())}")
        if isinstance(self.grad_accumulation, bool) or not isinstance(self.grad_accumulation, int) or not (
                1 <= self.grad_accumulation <= MAX_GRAD_ACCUMULATION):
            raise TranspileError(f"--grad-accumulation must be an integer in [1, {MAX_GRAD_ACCUMULATION}] "
                                 f"(got {self.grad_accumulation})")
        if not 0 < self.bucket_mb < float("inf"):
            raise TranspileError(f"--bucket-mb must be a positive finite number (got {self.bucket_mb})")
        self.optimizer.validate()


@dataclass
class StateEntry:
    input: str
    output: str
    kind: str  # "param" | "buffer" | "optimizer" | "step"
    param: str | None  # the parameter or buffer it belongs to (None: the step counter, zero's slices)
    shape: tuple[int, ...] = ()
    dtype: ir.DataType = ir.DataType.FLOAT

    @property
    def bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.bitwidth // 8

    def to_json(self) -> dict:
        return {"input": self.input, "output": self.output, "kind": self.kind, "param": self.param}


@dataclass
class RankGraphs:
    rank: int | None  # None: the single-device graphs
    step: ir.Model
    init: ir.Model
    state: list[StateEntry]
    updates: list[str]  # parameters whose optimizer update runs here
    # --grad-accumulation K > 1: the graph run on the first K-1 micro-batches, and its accumulators
    # (kind "accum": fed zeros before the first micro-batch, never saved).
    accum: ir.Model | None = None
    accumulators: list[StateEntry] = field(default_factory=list)


@dataclass
class Job:
    problem: Problem
    options: Options
    sizes: dict[str, int] = field(default_factory=dict)  # parameter -> bytes
    grad_order: list[str] = field(default_factory=list)  # parameters, in backward order
    grad_names: dict[str, str] = field(default_factory=dict)  # parameter -> gradient value name
    placement: Placement | None = None
    buckets: list[Bucket] = field(default_factory=list)
    single: RankGraphs | None = None
    ranks: list[RankGraphs] = field(default_factory=list)
    # The forward with BatchNormalization decomposed, per variant: "single" for the single-device
    # graphs, "ranks" for the rank graphs (they differ when --sync-bn puts collectives in the
    # forward), each with its BatchNorm buffers. BatchNormPass sets it; AutodiffPass appends the
    # backward to these models in place, so afterwards they are the forward + backward.
    variants: dict[str, tuple[ir.Model, list]] = field(default_factory=dict)
    # How far the running pass is, for the progress display (transpiler/progress.py); no output by default.
    note: Callable[[str], None] = field(default=lambda detail: None, repr=False, compare=False)

    @property
    def fwd_bwd(self) -> dict[str, onnx.ModelProto]:
        """Forward + backward with gradient (and buffer-update) outputs, per variant, serialized
        (for running it outside the transpiler; the passes use ``variants``)."""
        return {key: inline_weights(ir.serde.serialize_model(model))
                for key, (model, _) in self.variants.items()}


def reduced_gradient_name(job: Job, param: str) -> str:
    """The value a gradient collective sends for ``param``: its gradient, or with
    --grad-accumulation the mean of the micro-batches' gradients."""
    grad = job.grad_names[param]
    return grad + ".mean_of_micro_batches" if job.options.grad_accumulation > 1 else grad
