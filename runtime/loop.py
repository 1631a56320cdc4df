"""The training loop of one rank: data shard per step, logging, checkpoints, timings, --export."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from runtime import checkpoint
from runtime.collectives import Communicator
from runtime.config import RunConfig
from runtime.data import Dataset
from runtime.errors import RunError
from runtime.export import export_model
from runtime.trainer import Trainer

# Most steps whose losses wait on the device before being read (the GPU ring holds more).
FLUSH_EVERY = 1024


def train(trainer: Trainer, dataset: Dataset, config: RunConfig, *, log: Callable[[str], None] = print) -> list[float]:
    """Initialize (or resume) and run up to step ``config.steps``; rank 0 logs and exports.
    Returns the global losses of the steps run. The rank and world size are the communicator's."""
    rank, world_size = trainer.comm.rank, trainer.comm.size
    start = 0
    if config.resume is not None:
        meta = checkpoint.read_meta(config.resume, trainer.plan, batch=config.batch, shuffle=config.shuffle,
                                    seed=config.seed)
        trainer.load_state(checkpoint.load(config.resume, rank), f"{config.resume}/rank{rank}.npz")
        start = meta.step
    else:
        trainer.initialize()
    losses: list[float] = []
    # The log line reports averages over the steps since the previous line: a single step's time
    # and loss are too noisy to read (one batch; a rank descheduled for a moment).
    since, window_start = 0, time.perf_counter()
    lr_at = config.schedule.function(config.lr, config.steps)
    for step in range(start, config.steps):
        lr = lr_at(step)
        data = dataset.shard(step, batch=config.batch, rank=rank, world_size=world_size,
                             shuffle=config.shuffle, seed=config.seed)
        trainer.step_async(data, lr)
        done = step + 1
        if config.timings is not None and step == start:
            # Timed from the second step on: the first one pays for first-touch allocations.
            if not trainer.backend.records_timings:
                raise RunError(f"--timings: the {trainer.backend.name} backend does not record timings (the cpu backend does)")
            trainer.step_program.record_timings()
        log_now = config.log_every and (done == start + 1 or done % config.log_every == 0 or done == config.steps)
        # Losses are read at log steps only (the GPU keeps them on the device until then), and at
        # least every FLUSH_EVERY steps; every rank takes the same decision, so the host reductions match.
        if log_now or done == config.steps or done - start - len(losses) >= FLUSH_EVERY:
            losses.extend(trainer.collect_losses())
        if rank == 0 and log_now:
            loss = losses[-1]
            now = time.perf_counter()
            window = losses[since:]
            epoch = done * config.batch / dataset.rows
            log(f"step {done}/{config.steps}  epoch {epoch:.2f}  loss {loss:.6f}  "
                f"mean loss {sum(window) / len(window):.6f}  lr {lr:g}  "
                f"{(now - window_start) * 1e3 / len(window):.2f} ms/step")
            since, window_start = len(losses), now
        if config.checkpoint is not None and (done == config.steps or (config.checkpoint_every and done % config.checkpoint_every == 0)):
            meta = checkpoint.Meta(step=done, plan_sha256=checkpoint.plan_hash(trainer.plan), world_size=world_size,
                                   batch=config.batch, shuffle=config.shuffle, seed=config.seed)
            checkpoint.save(config.checkpoint, trainer.state_dict(), meta, rank=rank, comm=trainer.comm)
    if config.timings is not None:
        _write_timings(config.timings, trainer.step_program.median_timings(), trainer.comm)
    if rank == 0 and config.export is not None:
        export_model(trainer.plan, trainer.parameters(), config.export)
    return losses


def _write_timings(path: Path, mine: dict, comm: Communicator) -> None:
    """Every rank's medians into one JSON file (``{"ranks": [{"rank": r, "segments": ..., "collectives":
    ...}]}``), through per-rank files: the communicator moves arrays, not documents."""
    rank, world_size = comm.rank, comm.size
    part = path.with_name(f"{path.name}.rank{rank}")
    part.write_text(json.dumps({"rank": rank, **mine}))
    comm.barrier()
    if rank == 0:
        parts = [path.with_name(f"{path.name}.rank{r}") for r in range(world_size)]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"ranks": [json.loads(p.read_text()) for p in parts]}, indent=1) + "\n")
        os.replace(tmp, path)
        for p in parts:
            p.unlink()
