"""graph-transpiler: rewrite a single-device ONNX training graph into data-parallel per-rank graphs.

    plan = transpile("model.onnx", "out/", Options(world_size=4, strategy="sharded"))

The output directory is the contract with ``runtime`` (docs/contracts.md).
"""

from __future__ import annotations

from pathlib import Path

from transpiler.errors import TranspileError, UnsupportedOpsError
from transpiler.load import Problem, load_problem, validate_freeze
from transpiler.optimizer import OptimizerConfig
from transpiler.passes import LR_INPUT, STEP_STATE, Job, Options, run_passes
from transpiler.plan import check_out_dir, write_out
from transpiler.progress import Progress, Quiet

__all__ = [
    "Job",
    "OptimizerConfig",
    "Options",
    "Problem",
    "TranspileError",
    "UnsupportedOpsError",
    "build",
    "load_problem",
    "transpile",
]


def build(model_path: str | Path, options: Options, *, loss: str | None = None, freeze: str | None = None,
          train: str | None = None, progress: Progress | None = None) -> Job:
    """Run every pass and return the Job (graphs in memory, nothing written).

    ``freeze``/``train``: regular expressions on initializer names, not trained / trained even where
    the default rules freeze them (transpiler/trainable.py). ``progress``: where each stage's time
    goes (transpiler/progress.py; default: nowhere)."""
    progress = progress or Quiet()
    options.validate()
    validate_freeze(freeze)
    validate_freeze(train, "--train")
    with progress.stage("load"):
        problem = load_problem(model_path, loss=loss, freeze=freeze, train=train)
    _check_reserved_names(problem)
    job = Job(problem=problem, options=options)
    run_passes(job, progress)
    return job


def transpile(
    model_path: str | Path,
    out_dir: str | Path,
    options: Options | None = None,
    *,
    loss: str | None = None,
    freeze: str | None = None,
    train: str | None = None,
    progress: Progress | None = None,
) -> dict:
    """Transpile ``model_path`` into ``out_dir``; returns the plan (also written as plan.json).
    ``progress``: see ``build`` (the ``transpile`` command passes one that prints)."""
    check_out_dir(out_dir)  # before minutes of work, not after
    progress = progress or Quiet()
    job = build(model_path, options or Options(), loss=loss, freeze=freeze, train=train, progress=progress)
    with progress.stage("write"):
        return write_out(job, out_dir)


def _check_reserved_names(problem: Problem) -> None:
    """The training graphs add an input for the learning rate and one for the step counter."""
    graph = problem.model.graph
    names = {v.name for v in graph.inputs} | {v.name for v in graph.outputs} | set(graph.initializers)
    names |= {out.name for node in graph for out in node.outputs}
    for reserved, what in ((LR_INPUT, "learning-rate input"), (STEP_STATE, "optimizer step counter")):
        if reserved in names:
            raise TranspileError(f"{problem.path}: the model has a value named '{reserved}', the name of the training "
                                 f"graph's {what}; rename it in the model")
