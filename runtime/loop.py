"""The training loop of one rank: data shard per step, progress and metrics (rank 0: runtime/progress.py),
checkpoints, timings, --export."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from runtime import checkpoint, reshard
from runtime.collectives import Communicator
from runtime.config import RunConfig
from runtime.data import Dataset
from runtime.errors import AgreedError, PeerFailed, RunError, os_error_text
from runtime.evaluate import Evaluator
from runtime.export import export_model
from runtime.progress import Report, make_report, run_info
from runtime.trainer import Trainer

# Most steps whose losses wait on the device before being read (the GPU ring holds more).
FLUSH_EVERY = 1024


def train(trainer: Trainer, dataset: Dataset, config: RunConfig, *, log: Callable[[str], None] = print,
          progress: Callable[[int, str], None] = lambda step, phase: None,
          evaluator: Evaluator | None = None, observe: Callable[[dict], None] | None = None) -> list[float]:
    """Initialize (or resume) and run up to step ``config.steps``; rank 0 reports and exports.
    Returns the global losses of the steps run. The rank and world size are the communicator's.
    ``progress(steps done, phase)`` tells a watchdog (runtime/guard.py) that the loop moves on;
    ``log`` takes rank 0's plain lines (runtime/progress.py). ``evaluator`` (--eval-data) runs every
    ``config.eval_every`` steps and after the last one; its loss goes into that step's record.
    ``observe`` (rank 0) gets each record and the summary as --metrics writes them (runtime/progress.py)."""
    if config.grad_accumulation is not None and config.grad_accumulation != trainer.accumulation:
        raise RunError(f"internal error: the run has --grad-accumulation {config.grad_accumulation}, its Trainer "
                       f"{trainer.accumulation} (pass accumulation=config.grad_accumulation to Trainer)")
    start, samples = 0, 0
    progress(0, "init")
    if config.resume is not None:
        # Each rank reads its state; one that cannot (damaged, from another step) must not leave
        # the others waiting in the first step's collectives for a launcher to kill them: every
        # rank agrees on the outcome first, then all stop with the failing rank's line.
        error = None
        try:
            meta = checkpoint.read_meta(config.resume)
            state, where = _resumed_state(trainer, config.resume, meta)
            # A checkpoint this runtime writes is finite (checked before every save); one that is
            # not (an older version's, a damaged one) is refused here rather than resumed and later
            # called the last good checkpoint.
            bad = _first_non_finite(state)
            if bad is not None:
                raise RunError(f"--resume {where}: '{bad}' holds non-finite values; this "
                               "checkpoint cannot be resumed (resume from an earlier one)")
            trainer.load_state(state, where)
            start, samples = meta.step, checkpoint.samples_done(meta)
        except RunError as exc:
            error = str(exc)
        checkpoint.agree(trainer.comm, error)
    else:
        trainer.initialize()
    report = make_report(trainer, dataset, config, log, observe, resumed_at=start if config.resume is not None else None)
    try:
        return _train(trainer, dataset, config, start, samples, report, progress, evaluator)
    finally:
        report.close()


def _resumed_state(trainer: Trainer, directory: Path, meta: checkpoint.Meta) -> tuple[dict[str, np.ndarray], str]:
    """This rank's state from a checkpoint, and the path to name in errors: its own rank file as
    is when this plan wrote it (bit for bit the state it saved), else cut from the checkpoint's
    whole tensors by name (another world size or strategy: runtime/reshard.py)."""
    rank = trainer.comm.rank
    if checkpoint.same_plan(meta, trainer.plan):
        return checkpoint.load(directory, rank, meta.step), str(directory / checkpoint.rank_file(rank))
    with reshard.Tensors(directory, meta) as tensors:
        return reshard.rank_state(trainer.plan.graphs(trainer.role).state, tensors.read), str(directory)


def _train(trainer: Trainer, dataset: Dataset, config: RunConfig, start: int, samples: int, report: Report,
           progress: Callable[[int, str], None], evaluator: Evaluator | None) -> list[float]:
    """Steps ``start``..``config.steps``; step ``start`` reads the data stream from position
    ``samples`` (the samples the resumed run had read), each step ``config.batch`` further."""
    rank, world_size = trainer.comm.rank, trainer.comm.size
    losses: list[float] = []
    skipped: list[bool] = []  # --precision fp16: each step's, as the losses
    last_checkpoint = config.resume
    # Each record reports averages over the steps since the previous one: a single step's time
    # and loss are too noisy to read (one batch; a rank descheduled for a moment).
    since, window_start = 0, time.perf_counter()
    lr_at = config.schedule.function(config.lr, config.steps)
    report.start(run_info(trainer, dataset, config, start))
    began = time.perf_counter()
    for step in range(start, config.steps):
        lr = lr_at(step)
        data = dataset.shard_at(samples + (step - start) * config.batch, batch=config.batch, rank=rank,
                                world_size=world_size, shuffle=config.shuffle, seed=config.seed)
        trainer.step_async(data, lr)
        done = step + 1
        progress(done, "step")
        if config.timings is not None and step == start:
            # Timed from the second step on: the first one pays for first-touch allocations.
            if not trainer.backend.records_timings:
                raise RunError(f"--timings: the {trainer.backend.name} backend does not record timings (the cpu backend does)")
            trainer.step_program.record_timings()
        log_now = config.log_every and (done == start + 1 or done % config.log_every == 0 or done == config.steps)
        save_now = config.checkpoint is not None and (
            done == config.steps or (config.checkpoint_every and done % config.checkpoint_every == 0))
        # Losses are read at log and checkpoint steps only (the GPU keeps them on the device until
        # then), and at least every FLUSH_EVERY steps; every rank takes the same decision, so the
        # host reductions match. Each batch read is checked for non-finite losses (no extra sync).
        if log_now or save_now or done == config.steps or done - start - len(losses) >= FLUSH_EVERY:
            first = start + len(losses) + 1
            new = trainer.collect_losses()
            losses.extend(new)
            skipped.extend(trainer.skipped)
            _check_losses(new, first, rank, last_checkpoint, trainer)
            _check_grad_norms(trainer.grad_norms, first, rank, last_checkpoint, trainer)
        report.advance(done)  # (a silent Report on the other ranks)
        evaluated = {}  # this step's global eval loss, where it evaluates: in its record
        if evaluator is not None and (done == config.steps or (config.eval_every and done % config.eval_every == 0)):
            loss, seconds = _evaluate(evaluator, done, progress)
            window_start += seconds  # ms/step and samples/s are the training steps' own
            evaluated = {"eval_loss": loss}
            if rank == 0 and not log_now:  # its own record (with --log-every 0: to --metrics only)
                report.log(done, **evaluated)
        if rank == 0 and log_now:
            now = time.perf_counter()
            window = losses[since:]
            step_s = (now - window_start) / len(window)
            report.log(done, loss=losses[-1], mean_loss=sum(window) / len(window), learning_rate=lr,
                       samples_per_second=round(config.batch / step_s, 1), step_time_ms=round(step_s * 1e3, 4),
                       **({"grad_norm": trainer.grad_norms[-1]} if trainer.grad_norms else {}),
                       **({"loss_scale": trainer.loss_scale, "skipped_steps": sum(skipped[since:])}
                          if trainer.loss_scale is not None else {}), **evaluated)
            since, window_start = len(losses), now
        if save_now:
            progress(done, "checkpoint")
            state = trainer.state_dict()
            _check_state(state, done, trainer.comm, last_checkpoint)
            meta = _meta(trainer, config, done, samples + (done - start) * config.batch)
            last_checkpoint = checkpoint.save(config.checkpoint, state, meta, rank=rank, comm=trainer.comm,
                                              keep=config.keep_checkpoints)
            progress(done, "step")
    if evaluator is not None and start == config.steps:  # resumed at the end: only evaluates and exports
        loss, _ = _evaluate(evaluator, start, progress)
        if rank == 0:
            report.log(start, eval_loss=loss)
    progress(config.steps, "finishing")
    runtime = time.perf_counter() - began
    if config.timings is not None:
        _write_timings(config.timings, trainer.step_program.median_timings(), trainer.comm)
    best = evaluator.best if config.export_best and evaluator is not None else None
    if config.export is not None:
        if best is not None:
            # --export-best: rank 0 kept host copies at the best evaluation (Evaluator.keep_best).
            parameters = evaluator.best_parameters if rank == 0 else {}
            _check_state(parameters, best[0], trainer.comm, last_checkpoint)
        else:
            if config.export_best and rank == 0:
                print("transpile: warning: --export-best: no evaluation gave a finite eval loss; exporting the final "
                      "parameters", file=sys.stderr, flush=True)
            parameters = trainer.parameters()
            if not (config.checkpoint is not None and start < config.steps):  # else checked just before the save
                _check_state(parameters, config.steps, trainer.comm, last_checkpoint)
        error = None
        if rank == 0:
            try:
                export_model(trainer.plan, parameters, config.export, config.outputs)
            except RunError as exc:
                error = str(exc)
        # Every rank waits for the export's outcome, so that on failure the final state is kept.
        if trainer.comm.allreduce_scalars([1.0 if error else 0.0], "sum")[0]:
            if config.checkpoint is None and start < config.steps:  # the final state is in no checkpoint
                last_checkpoint = _rescue(trainer, config, error, samples + (config.steps - start) * config.batch)
            if rank != 0:
                raise PeerFailed("--export failed")
            raise AgreedError(f"{error}; the trained state is in {last_checkpoint}: export it later with 'transpile export "
                              f"{config.out} --checkpoint {last_checkpoint} -o FILE'")
    if rank == 0:
        run = config.steps - start
        report.finish(steps=config.steps, steps_run=run, samples=run * config.batch, runtime_s=round(runtime, 6),
                      samples_per_second=round(run * config.batch / runtime, 1) if runtime > 0 else None,
                      step_time_ms=round(runtime * 1e3 / run, 4) if run else None,
                      final_loss=losses[-1] if losses else None,
                      **({"skipped_steps": sum(skipped), "loss_scale": trainer.loss_scale}
                         if trainer.loss_scale is not None else {}),
                      mean_loss=sum(losses) / len(losses) if losses else None,
                      epoch=round((samples + run * config.batch) / dataset.rows, 4),  # a resume may have changed the batch
                      export=config.export, checkpoint=last_checkpoint if last_checkpoint != config.resume else None,
                      metrics=config.metrics,
                      **({"eval_loss": evaluator.history[-1][1], "eval_step": evaluator.history[-1][0]}
                         if evaluator is not None and evaluator.history else {}),
                      **({"best_eval_loss": best[1], "best_eval_step": best[0]} if best is not None else {}))
    return losses


def _evaluate(evaluator: Evaluator, step: int, progress: Callable[[int, str], None]) -> tuple[float, float]:
    """One evaluation (a collective: every rank, same steps): the global eval loss and its seconds."""
    progress(step, "eval")
    started = time.perf_counter()
    loss = evaluator.evaluate(step, lambda: progress(step, "eval"))
    progress(step, "step")
    return loss, time.perf_counter() - started


def _meta(trainer: Trainer, config: RunConfig, step: int, samples: int) -> checkpoint.Meta:
    """What a checkpoint of this run at ``step`` records besides the state: ``samples`` is the
    data position reached; the state's index by name lets another plan resume it (runtime/reshard.py)."""
    tensors, unmapped = reshard.tensor_index(trainer.plan, trainer.role)
    return checkpoint.Meta(step=step, plan_sha256=checkpoint.plan_hash(trainer.plan), world_size=trainer.comm.size,
                           batch=config.batch, shuffle=config.shuffle, seed=config.seed, lr=config.lr,
                           schedule=dataclasses.asdict(config.schedule), steps=config.steps, samples=samples,
                           tensors=tensors, model=reshard.model_summary(trainer.plan, unmapped))


RESCUE_PREFIX = "transpile-rescue-"
_PATH_BYTES = 4096  # the longest rescue path rank 0 can hand to the others


def _rescue(trainer: Trainer, config: RunConfig, error: str | None, samples: int) -> Path:
    """--export failed and no checkpoint holds the final state: save one into a new directory of
    the temporary directory (another file system than the export's, as a rule), for 'transpile
    export'. Rank 0 creates it with mkdtemp: an unpredictable name, created exclusively (never an
    existing path, never through a symlink someone planted), mode 0700, owned by this user; the
    other ranks learn its path from rank 0. Pruning (keep 1) stays inside this new store."""
    comm = trainer.comm
    store, failure = None, None
    if comm.rank == 0:
        try:
            store = Path(tempfile.mkdtemp(prefix=RESCUE_PREFIX))
        except OSError as exc:
            failure = f"cannot create a directory in {tempfile.gettempdir()}: {os_error_text(exc)}"
    store = _share_path(comm, store)
    if store is None:
        if comm.rank != 0:
            raise PeerFailed("--export failed")
        raise AgreedError(f"{error or f'--export {config.export} failed'}; saving the final state failed too "
                          f"({failure or 'its path is too long'}); the trained state is lost")
    meta = _meta(trainer, config, config.steps, samples)
    try:
        return checkpoint.save(store, trainer.state_dict(), meta, rank=comm.rank, comm=comm, keep=1)
    except PeerFailed:
        raise
    except RunError as exc:  # this rank is the one that reports the save's failure
        raise AgreedError(f"{error or f'--export {config.export} failed'}; saving the final state to {store} failed "
                          f"too ({exc}); the trained state is lost") from None


def _share_path(comm: Communicator, path: Path | None) -> Path | None:
    """Rank 0's ``path`` on every rank (None on every rank when rank 0 has none), through the one
    host reduction every backend has: rank 0 contributes the path's bytes, the others zeros."""
    values = [0.0] * (1 + _PATH_BYTES)
    if comm.rank == 0 and path is not None:
        data = os.fsencode(str(path))
        if len(data) <= _PATH_BYTES:
            values[0] = float(len(data))
            values[1:1 + len(data)] = [float(b) for b in data]
    shared = comm.allreduce_scalars(values, "sum")
    length = int(shared[0])
    if length == 0:
        return None
    return Path(os.fsdecode(bytes(int(v) for v in shared[1:1 + length])))


def _where(last_checkpoint) -> str:
    return (f"{last_checkpoint} is the last good checkpoint" if last_checkpoint is not None
            else "no checkpoint was written")


def _skipped(trainer: Trainer, i: int) -> bool:
    """Whether fp16 loss scaling skipped step ``i`` of the last collect_losses (its gradients
    overflowed): it changed nothing, and its non-finite loss or norm is the scaler's business, as
    with torch's GradScaler."""
    return i < len(trainer.skipped) and trainer.skipped[i]


def _check_grad_norms(norms: list[float], first: int, rank: int, last_checkpoint, trainer: Trainer) -> None:
    """Stop at the first step whose global gradient norm (--clip-grad-norm) is not finite, even if
    its loss was: clipping by a non-finite norm makes every parameter non-finite."""
    for i, value in enumerate(norms):
        if not math.isfinite(value) and not _skipped(trainer, i):
            if rank != 0:
                raise PeerFailed("non-finite gradient norm")
            raise AgreedError(f"step {first + i}: the gradient norm is {value} (non-finite); training stopped, no "
                              f"checkpoint or export was written from this state; {_where(last_checkpoint)}")


def _check_losses(new: list[float], first: int, rank: int, last_checkpoint, trainer: Trainer) -> None:
    """Stop at the first non-finite loss (every rank holds the same global losses, so all stop)."""
    for i, value in enumerate(new):
        if not math.isfinite(value) and not _skipped(trainer, i):
            if rank != 0:
                raise PeerFailed("non-finite loss")
            # Stopping anyway: naming the first non-finite tensor of rank 0's state (which holds every
            # parameter) costs one copy to the host, once.
            bad = _first_non_finite(trainer.state_dict())
            tensor = f"; '{bad}' is non-finite now" if bad else ""
            raise AgreedError(f"step {first + i}: the loss is {value} (non-finite){tensor}; training stopped, no "
                              f"checkpoint or export was written from this state; {_where(last_checkpoint)}")


def _first_non_finite(state: dict[str, np.ndarray]) -> str | None:
    return next((name for name, a in state.items() if a.dtype.kind in "fc" and a.size and not np.isfinite(a).all()), None)


def _check_state(state: dict[str, np.ndarray], step: int, comm: Communicator, last_checkpoint) -> None:
    """Before a checkpoint or an export: every rank checks the state it holds (already on the host)
    and the ranks agree; the lowest rank holding a non-finite tensor names it."""
    bad = _first_non_finite(state)
    flags = [0.0] * comm.size
    flags[comm.rank] = 1.0 if bad else 0.0
    flags = comm.allreduce_scalars(flags, "sum")
    if not any(flags):
        return
    first = next(r for r, f in enumerate(flags) if f)
    if comm.rank != first:
        raise PeerFailed("non-finite state")
    raise AgreedError(f"step {step}: '{bad}' holds non-finite values (the losses so far were finite); training "
                   f"stopped, no checkpoint or export was written from this state; {_where(last_checkpoint)}")


def _write_timings(path: Path, mine: dict, comm: Communicator) -> None:
    """Every rank's medians into one JSON file (``{"ranks": [{"rank": r, "segments": ..., "collectives":
    ...}]}``), through per-rank files: the communicator moves arrays, not documents."""
    rank, world_size = comm.rank, comm.size
    part = path.with_name(f"{path.name}.rank{rank}")
    parts = [path.with_name(f"{path.name}.rank{r}") for r in range(world_size)]
    tmp = path.with_name(path.name + ".tmp")
    error = None
    try:
        part.write_text(json.dumps({"rank": rank, **mine}))
    except OSError as exc:
        error = f"--timings {exc.filename or part}: {os_error_text(exc)}"
    try:
        checkpoint.agree(comm, error)  # also the barrier: every part is on disk
        error = None
        if rank == 0:
            try:
                tmp.write_text(json.dumps({"ranks": [json.loads(p.read_text()) for p in parts]}, indent=1) + "\n")
                os.replace(tmp, path)
            except OSError as exc:
                error = f"--timings {exc.filename or path}: {os_error_text(exc)}"
        checkpoint.agree(comm, error)
    finally:
        for p in (part, tmp) if rank else (part, tmp, *parts):
            with contextlib.suppress(OSError):
                p.unlink()
