"""What the passes share: the user's options, and the ``Job`` each pass adds its findings to."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from contract.plan import Piece
from transpiler.bucketing import Bucket
from transpiler.errors import TranspileError
from transpiler.lazy_weights import inline_weights
from transpiler.load import Problem
from transpiler.names import ACC, AFTER_GRADIENTS, LR_INPUT, NEXT, STEP_STATE
from transpiler.optimizer import OptimizerConfig
from transpiler.placement import Placement
from transpiler.strategies import DEFAULT_STRATEGY, user_strategies

__all__ = ["ACC", "AFTER_GRADIENTS", "DTYPES", "GRAD_DTYPES", "GROWTH_TRACKER_STATE", "LOSS_SCALE_CURRENT",
           "LOSS_SCALE_KIND", "LOSS_SCALE_STATE", "LR_INPUT", "NEXT", "PRECISIONS", "SKIPPED_OUTPUT", "STEP_STATE", "Job",
           "LossScale", "Options", "RankGraphs", "StateEntry", "reduced_gradient_name"]

MAX_GRAD_ACCUMULATION = 1024
# --precision: the dtype the matrix products (and what follows them) compute in (docs/precision.md).
PRECISIONS = ("fp32", "bf16", "fp16")
# --grad-dtype: the dtype gradient buckets travel in through the collectives (DDP's compress hooks).
GRAD_DTYPES = ("fp32", "bf16", "fp16")
DTYPES = {"fp32": ir.DataType.FLOAT, "bf16": ir.DataType.BFLOAT16, "fp16": ir.DataType.FLOAT16}
# Values the fp16 step graphs add for loss scaling (plan.json's precision section names them).
LOSS_SCALE_STATE = "amp.loss_scale"  # state: the scale (0 before the first step, meaning init_scale)
GROWTH_TRACKER_STATE = "amp.growth_tracker"  # state: finite steps since the scale last changed
LOSS_SCALE_CURRENT = "amp.loss_scale.current"  # the scale this step multiplies the loss by
SKIPPED_OUTPUT = "amp.skipped"  # step graph output: 1.0 where the update was skipped, else 0.0
LOSS_SCALE_KIND = "loss_scale"  # the state kind of the two state values
MAX_WORLD_SIZE = 4096  # zero still builds and writes every rank's graphs: docs/scale.md says how far N goes


@dataclass(frozen=True)
class LossScale:
    """Dynamic loss scaling of --precision fp16, torch.amp.GradScaler's defaults and rule: the loss
    is multiplied by the scale before the backward, the gradients divided by it after the
    collectives; a step whose gradients are not all finite is skipped and the scale multiplied by
    ``backoff_factor``; after ``growth_interval`` consecutive finite steps it is multiplied by
    ``growth_factor`` (never to inf)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def validate(self) -> None:
        if not (0 < self.init_scale < float("inf")):
            raise TranspileError(f"loss scaling: init_scale must be positive and finite (got {self.init_scale})")
        if not (1 < self.growth_factor < float("inf")) or not (0 < self.backoff_factor < 1):
            raise TranspileError(f"loss scaling: growth_factor must be > 1 and backoff_factor in (0, 1) (got "
                                 f"{self.growth_factor}, {self.backoff_factor})")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) or self.growth_interval < 1:
            raise TranspileError(f"loss scaling: growth_interval must be a positive integer (got {self.growth_interval})")

    def to_json(self) -> dict:
        return {"init_scale": self.init_scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}


@dataclass(frozen=True)
class Options:
    world_size: int = 1
    strategy: str = DEFAULT_STRATEGY
    placement: str = "balanced"
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig("sgd"))
    bucket_mb: float | None = None  # the bucket cap, MiB; None: bucketing.auto_cap_mb of the model's size
    first_bucket_mb: float | None = None  # the first bucket's cap (DDP's is 1 MiB); None: bucket_mb
    sync_bn: bool = False  # BatchNormalization statistics all-reduced across ranks
    # Update each bucket of several parameters as one flat vector (fewer, larger ops: for GPUs,
    # where ~25 small kernels per parameter cost launches; on CPU the copies make it slower).
    # Micro-batches per optimizer step: K-1 accumulate-graph runs, then the step graph, whose
    # gradients are the mean over the K micro-batches (DDP's no_sync, Horovod's backward_passes_per_step).
    grad_accumulation: int = 1
    # --sparse-grads: a table whose gradient is a scatter of the batch's rows sends the rows
    # (AllConcat), not the dense table (transpiler/sparse_grads.py).
    sparse_grads: bool = False
    # Mixed precision (docs/precision.md): the compute dtype of the matrix products, the dtype of the
    # gradient collectives, and fp16's dynamic loss scaling. fp32/fp32 leaves every graph as it was.
    precision: str = "fp32"
    grad_dtype: str = "fp32"
    loss_scale: LossScale = field(default_factory=LossScale)

    def validate(self) -> None:
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise TranspileError(f"--gpus must be in [1, {MAX_WORLD_SIZE}] (got {self.world_size})")
        if self.strategy not in user_strategies():
            raise TranspileError(f"--strategy '{self.strategy}' is not one of: {', '.join(user_strategies())}")
        if isinstance(self.grad_accumulation, bool) or not isinstance(self.grad_accumulation, int) or not (
                1 <= self.grad_accumulation <= MAX_GRAD_ACCUMULATION):
            raise TranspileError(f"--grad-accumulation must be an integer in [1, {MAX_GRAD_ACCUMULATION}] "
                                 f"(got {self.grad_accumulation})")
        if self.sparse_grads and self.strategy == "zero":
            # Its ReduceScatter slices cut across a table's rows. (Under allreduce every rank
            # scatter-adds the gathered rows itself: the runtimes sum a row's adds in index order,
            # the same on every rank; runtime/gpu/scatter_add.py.)
            raise TranspileError("--sparse-grads: not with --strategy zero (its slices cut across the table's rows); "
                                 "use allreduce or sharded")
        if self.sparse_grads and self.grad_accumulation > 1:
            raise TranspileError("--sparse-grads: not with --grad-accumulation (the mean of the micro-batches' "
                                 "gradients is a dense table)")
        if self.bucket_mb is not None and not 0 < self.bucket_mb < float("inf"):
            raise TranspileError(f"--bucket-mb must be a positive finite number (got {self.bucket_mb})")
        if self.first_bucket_mb is not None and not 0 < self.first_bucket_mb < float("inf"):
            raise TranspileError(f"--first-bucket-mb must be a positive finite number (got {self.first_bucket_mb})")
        if self.precision not in PRECISIONS:
            raise TranspileError(f"--precision '{self.precision}' is not one of: {', '.join(PRECISIONS)}")
        if self.grad_dtype not in GRAD_DTYPES:
            raise TranspileError(f"--grad-dtype '{self.grad_dtype}' is not one of: {', '.join(GRAD_DTYPES)}")
        self.loss_scale.validate()
        self.optimizer.validate()

    @property
    def loss_scaling(self) -> LossScale | None:
        """The loss scaling the step graphs do: fp16's (bf16 has fp32's exponent range and needs none)."""
        return self.loss_scale if self.precision == "fp16" else None


@dataclass
class StateEntry:
    input: str
    output: str
    kind: str  # "param" | "buffer" | "optimizer" | "step" | "loss_scale"
    param: str | None  # the parameter or buffer it belongs to (None: the step counter, zero's slices)
    shape: tuple[int, ...] = ()
    dtype: ir.DataType = ir.DataType.FLOAT
    # zero's slices: which elements of which single-device state this flat value holds
    # (contract.plan.Piece; None: it is the whole state named ``input``).
    pieces: list[Piece] | None = None

    @property
    def bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.bitwidth // 8

    def to_json(self) -> dict:
        entry = {"input": self.input, "output": self.output, "kind": self.kind, "param": self.param,
                 "shape": [int(d) for d in self.shape], "dtype": self.dtype.numpy().name}
        if self.pieces is not None:
            entry["pieces"] = [{"of": p.of, "start": p.start, "stop": p.stop, "at": p.at} for p in self.pieces]
        return entry


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
    # Parameter -> the step graph's value holding its local gradient as the backward gives it, before
    # any accumulation, cast or collective (plan.json's ``gradients``: a runtime that accumulates
    # micro-batches itself, ``transpile run --grad-accumulation K``, wraps these).
    gradients: dict[str, str] = field(default_factory=dict)


@dataclass
class Job:
    problem: Problem
    options: Options
    sizes: dict[str, int] = field(default_factory=dict)  # parameter -> bytes
    grad_order: list[str] = field(default_factory=list)  # parameters, in backward order
    grad_names: dict[str, str] = field(default_factory=dict)  # parameter -> gradient value name
    placement: Placement | None = None
    buckets: list[Bucket] = field(default_factory=list)
    sparse: list[str] = field(default_factory=list)  # parameters whose gradient goes as rows (--sparse-grads)
    bucket_mb: float | None = None  # the cap the buckets were made with (BucketingPass): --bucket-mb or the automatic one
    single: RankGraphs | None = None
    ranks: list[RankGraphs] = field(default_factory=list)
    # The forward with BatchNormalization decomposed, per variant: "single" for the single-device
    # graphs, "ranks" for the rank graphs (they differ when --sync-bn puts collectives in the
    # forward), each with its BatchNorm buffers. BatchNormPass sets it; AutodiffPass appends the
    # backward to these models in place, so afterwards they are the forward + backward.
    variants: dict[str, tuple[ir.Model, list]] = field(default_factory=dict)
    # --precision fp16: the output the backward differentiates (the loss times the loss scale, made by
    # PrecisionPass); None: the loss itself.
    differentiated: str | None = None
    # What PrecisionPass did (ops per precision, casts, opset), for plan.json's precision section.
    precision_report: dict = field(default_factory=dict)
    # How far the running pass is, for the progress display (transpiler/progress.py); no output by default.
    note: Callable[[str], None] = field(default=lambda detail: None, repr=False, compare=False)

    def distinct_variants(self) -> Iterator[tuple[str, ir.Model, list]]:
        """(key, model, buffers) of each variant model once: "single", then "ranks" where it is
        another model (--sync-bn on several ranks); the passes that rewrite the forwards walk these."""
        seen: set[int] = set()
        for key in ("single", "ranks"):
            model, buffers = self.variants[key]
            if id(model) not in seen:
                seen.add(id(model))
                yield key, model, buffers

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
