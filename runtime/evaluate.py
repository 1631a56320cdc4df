"""Evaluation during training (``transpile run --eval-data EVAL.npz``): the mean loss of the current
parameters over a held-out set, sharded over the ranks, the same on every backend.

What runs: OUT's evaluation graph (``plan.eval``, docs/contracts.md), the user's forward and loss in
PyTorch's ``model.eval()`` mode (BatchNormalization with the running statistics, Dropout off), with
no backward and no update. It is fed each rank's current parameters and buffers from its training
state, which holds every parameter on every strategy (``sharded`` and ``zero`` broadcast or gather
the updated values each step), so the evaluation sees exactly what ``--export`` would write.

Which rows (every row once): global evaluation batch k is rows ``[k*B, (k+1)*B)`` of EVAL.npz, in
file order, never shuffled; rank r takes the rows ``[k*B + r*B/N, k*B + (r+1)*B/N)`` of it that
exist. The last batch may be short: the ranks past its end take fewer rows or none. The graph's loss
is the mean over the rows fed, so each rank adds ``loss * rows`` (float64) and one host all-reduce
of (sum, rows) gives the mean over all rows: what one device computes on the whole set, for any N
(exactly so for losses that are a mean over rows; a loss averaged over another count, such as
non-ignored tokens, is weighted by rows here, like the training log).

BatchNorm running statistics are per rank without --sync-bn (each rank's shard moves its own);
evaluation uses rank 0's, broadcast before each evaluation (as DDP's ``broadcast_buffers`` makes
every rank's forward use rank 0's), which are also the ones --export writes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from contract.plan import EXPORTED_KINDS
from runtime.collectives import TensorSpec
from runtime.data import Dataset, check_ids, id_bounds
from runtime.errors import RunError
from runtime.executor import Program
from runtime.plan import Plan
from runtime.segments import cut_graph, load_graph
from runtime.trainer import Trainer


def eval_batch_size(batch: int, world_size: int, option: str = "--eval-batch") -> int:
    """Rows per rank of a full evaluation batch."""
    if batch < 1:
        raise RunError(f"{option} must be >= 1, got {batch}")
    if batch % world_size:
        raise RunError(f"{option} {batch} does not split into {world_size} equal shards; use a multiple of {world_size}")
    return batch // world_size


def _no_eval_graph(plan: Plan) -> RunError:
    return RunError(f"--eval-data: {plan.path} has no evaluation graph (OUT was written by an older transpiler); "
                    "transpile the model again")


def load_eval_data(plan: Plan, path) -> Dataset:
    """EVAL.npz checked as --data is (inputs, dtypes, shapes, id ranges), or a one-line RunError;
    an OUT without an evaluation graph is refused here too."""
    if plan.eval is None:
        raise _no_eval_graph(plan)
    dataset = Dataset.load(path, plan.data_inputs)
    check_ids(dataset, id_bounds(plan.model, plan.data_inputs))
    return dataset


def make_evaluator(trainer: Trainer, config) -> Evaluator | None:
    """The Evaluator a rank runs for ``config`` (a RunConfig), or None without --eval-data. Rank 0
    exports, so it alone keeps the best parameters for --export-best."""
    if config.eval_data is None:
        return None
    if trainer.plan.eval is None:
        raise _no_eval_graph(trainer.plan)
    # Checked in full (ids too, which reads the user's model) once, by 'transpile run' (load_eval_data).
    dataset = Dataset.load(config.eval_data, trainer.plan.data_inputs)
    return Evaluator(trainer, dataset, batch=config.eval_batch or config.batch,
                     keep_best=config.export_best and config.export is not None and trainer.comm.rank == 0)


class Evaluator:
    """One rank's evaluation: ``evaluate()`` is a collective (every rank calls it at the same steps)
    and returns the global mean eval loss. ``keep_best`` (the exporting rank, with --export-best)
    keeps a host copy of the parameters and buffers whenever the eval loss improves."""

    def __init__(self, trainer: Trainer, dataset: Dataset, *, batch: int, keep_best: bool = False):
        plan = trainer.plan
        if plan.eval is None:
            raise _no_eval_graph(plan)
        self.trainer, self.dataset, self.spec = trainer, dataset, plan.eval
        self.comm, self.backend = trainer.comm, trainer.backend
        self.per_rank = eval_batch_size(batch, self.comm.size)
        self.batch = batch
        self.keep_best = keep_best
        where = self.spec.path.name
        model = load_graph(self.spec.path)
        self._check_signature(model, plan, where)
        self.cut = cut_graph(model, self.comm.rank, where)
        if self.cut.collectives:
            raise RunError(f"{where}: holds collectives; an evaluation graph runs on each rank alone")
        # One program per shard size (a full shard, and the short one of a last partial batch):
        # the GPU specializes a session to its first call's shapes (runtime/gpu/session.py).
        self._programs: dict[int, Program] = {}
        kinds = {s.input: s.kind for s in trainer.state_entries}
        self.buffers = [name for name in self.spec.state if kinds[name] == "buffer"]
        self.history: list[tuple[int, float]] = []  # (step, eval loss) of every evaluation
        self.best: tuple[int, float] | None = None  # (step, eval loss) of the lowest finite one
        self.best_parameters: dict[str, np.ndarray] | None = None  # with keep_best: host copies at ``best``

    def _check_signature(self, model, plan: Plan, where: str) -> None:
        inputs = [i.name for i in model.graph.input]
        initializers = {t.name for t in model.graph.initializer}
        expected = [d.name for d in plan.data_inputs] + list(self.spec.state)
        fed = [name for name in inputs if name not in initializers]
        if sorted(fed) != sorted(expected):
            raise RunError(f"{where}: graph inputs do not match plan.json (not in the plan: "
                           f"{sorted(set(fed) - set(expected)) or 'none'}; missing from the graph: "
                           f"{sorted(set(expected) - set(fed)) or 'none'})")
        if self.spec.loss not in [o.name for o in model.graph.output]:
            raise RunError(f"{where}: has no output '{self.spec.loss}' (the eval loss named in plan.json)")
        kinds = {s.input: s.kind for s in self.trainer.state_entries}
        lacking = [name for name in self.spec.state if kinds.get(name) not in EXPORTED_KINDS]
        if lacking:
            raise RunError(f"{where}: reads {', '.join(lacking)}, which rank {self.comm.rank}'s state does not hold as a "
                           "parameter or buffer")

    def _program(self, rows: int) -> Program:
        program = self._programs.get(rows)
        if program is None:
            # The generic program (one run at a time, outputs allocated per call), on every backend:
            # the fed values change buffers every call, so nothing is bound or captured once.
            program = Program(self.cut, self.backend, self.comm)
            for _, runner in program.steps:
                if hasattr(runner, "capture_allowed"):
                    runner.capture_allowed = False  # GPU: no CUDA graph (its buffers would be frozen)
            self._programs[rows] = program
        return program

    def _state(self) -> dict[str, Any]:
        """The parameters and buffers to evaluate with: this rank's current ones, rank 0's buffers."""
        state = {name: self.trainer.state[name] for name in self.spec.state}
        if self.comm.size > 1 and self.buffers:
            by_dtype: dict[str, list[str]] = {}
            for name in self.buffers:  # one bucket per dtype: a bucket holds one dtype on NCCL
                by_dtype.setdefault(str(state[name].dtype), []).append(name)
            for names in by_dtype.values():
                specs = [TensorSpec(tuple(state[n].shape), np.dtype(str(state[n].dtype))) for n in names]
                self.comm.current = "Broadcast of rank 0's BatchNorm statistics for evaluation"
                values = self.comm.broadcast([state[n] for n in names] if self.comm.rank == 0 else None, 0, specs)
                self.comm.current = None
                state.update(zip(names, values))
        return state

    def shard_rows(self, k: int) -> tuple[int, int]:
        """This rank's rows ``[start, stop)`` of evaluation batch k (possibly empty)."""
        rows = self.dataset.rows
        start = min(k * self.batch + self.comm.rank * self.per_rank, rows)
        return start, min(start + self.per_rank, (k + 1) * self.batch, rows)

    def evaluate(self, step: int, progress: Callable[[], None] = lambda: None) -> float:
        """The mean loss over every row of the evaluation set, with the current parameters (the
        same value on every rank). ``progress()`` is called after each batch (the watchdog)."""
        state = self._state()
        total, count = None, 0  # the row-weighted loss sum, kept where the loss is (float64)
        for k in range(math.ceil(self.dataset.rows / self.batch)):
            start, stop = self.shard_rows(k)
            if stop > start:
                feeds = {name: self.backend.from_host(array)
                         for name, array in self.dataset.take(np.arange(start, stop)).items()}
                outputs = self._program(stop - start).run({**feeds, **state})
                # On the device: one transfer (and wait) per evaluation, not one per batch.
                weighted = outputs[self.spec.loss].astype(np.float64) * (stop - start)
                total = weighted if total is None else total + weighted
                count += stop - start
            progress()
        total = 0.0 if total is None else float(np.asarray(self.backend.to_host(total)))
        self.comm.current = "AllReduce of the eval loss"
        total, count = self.comm.allreduce_scalars([total, float(count)], "sum")
        self.comm.current = None
        loss = total / count
        self.history.append((step, loss))
        if math.isfinite(loss) and (self.best is None or loss < self.best[1]):
            self.best = (step, loss)
            if self.keep_best:
                self.best_parameters = self.trainer.parameters()
        return loss
