"""All ranks of OUT in one process: the check that N ranks compute what one device computes.

Each rank is a thread with its own Trainer; collectives go through a LocalGroup (NumPy), so no MPI
is needed and the tests run everywhere.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.accumulation import micro_batches
from runtime.collectives import LocalGroup
from runtime.config import RunConfig
from runtime.cores import allowed_cores, threads_per_rank
from runtime.data import Dataset, shard_size
from runtime.errors import PeerFailed, RunError
from runtime.evaluate import Evaluator, make_evaluator
from runtime.executor import CpuBackend
from runtime.loop import train
from runtime.plan import Plan, load_plan
from runtime.schedule import Schedule
from runtime.trainer import Trainer


@dataclass
class SimResult:
    losses: list[float]  # global mean loss per step (identical on every rank)
    states: list[dict[str, np.ndarray]]  # per rank: final state keyed by state input name
    parameters: list[dict[str, np.ndarray]]  # per rank: final parameters keyed by parameter name
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, global eval loss), with eval_data


def simulate(out_dir: str | Path, data: dict[str, np.ndarray], *, batch: int, steps: int, lr: float | None = None,
             shuffle: bool = False, seed: int = 0, single_device: bool = False,
             schedule: Schedule | None = None, eval_data: dict[str, np.ndarray] | None = None, eval_every: int = 0,
             eval_batch: int | None = None, grad_accumulation: int | None = None) -> SimResult:
    """Train all ranks of OUT as threads of this process (or the single-device graph on the full batch).
    ``grad_accumulation``: micro-batches per step, as ``transpile run --grad-accumulation`` (None: the plan's).

    Collectives go through a LocalGroup, so this checks "N ranks == 1 device" with no MPI. Each
    session gets one intra-op thread: the ranks already run in parallel.
    """
    plan = load_plan(out_dir)
    world_size = 1 if single_device else plan.world_size
    dataset = Dataset(data, plan.data_inputs, "<data>")
    accumulation = micro_batches(plan, grad_accumulation)
    shard_size(batch, world_size, accumulation)
    config = RunConfig(batch=batch, steps=steps, lr=plan.lr if lr is None else lr, shuffle=shuffle, seed=seed,
                       grad_accumulation=accumulation,
                       schedule=schedule or Schedule(), eval_every=eval_every)
    evaluation = None if eval_data is None else Dataset(eval_data, plan.data_inputs, "<eval data>")
    group = LocalGroup(world_size)
    trainers: list[Trainer | None] = [None] * world_size
    evaluators: list[Evaluator | None] = [None] * world_size

    def run_rank(r: int) -> list[float]:
        trainers[r] = Trainer(plan, group.communicator(r), rank=None if single_device else r, backend=CpuBackend(threads=1),
                              accumulation=accumulation)
        if evaluation is not None:
            evaluators[r] = Evaluator(trainers[r], evaluation, batch=eval_batch or batch)
        return train(trainers[r], dataset, config, evaluator=evaluators[r])

    losses = run_threads(group, run_rank)
    return SimResult(losses=losses, states=[t.state_dict() for t in trainers],
                     parameters=[t.parameters() for t in trainers],
                     eval_losses=evaluators[0].history if evaluators[0] is not None else [])


def run_threads(group: LocalGroup, run_rank: Callable[[int], list[float]]) -> list[float]:
    """``run_rank(r)`` for every rank of ``group``, each in a thread; rank 0's result. A failing
    rank aborts the group (its peers blocked in a collective stop instead of hanging) and its
    exception is raised here, in the caller's thread (a RunError prefixed with its rank)."""
    world_size = group.size
    results: list[list[float] | None] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def run(r: int) -> None:
        try:
            results[r] = run_rank(r)
        except PeerFailed as exc:  # every rank knows already: no abort (it could break a peer's last barrier)
            errors[r] = exc
        except BaseException as exc:  # re-raised below in the caller's thread
            errors[r] = exc
            group.abort()  # peers blocked in a collective raise BrokenBarrierError instead of hanging

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Report the failure that caused the abort, not the BrokenBarrierErrors it caused in the peers.
    failures = [(r, e) for r, e in enumerate(errors) if e is not None]
    # PeerFailed: a rank that learned through an agreement that another one failed (that one speaks).
    for r, exc in sorted(failures, key=lambda f: isinstance(f[1], (threading.BrokenBarrierError, PeerFailed))):
        if isinstance(exc, RunError):
            raise RunError(f"rank {r}: {exc}") from exc
        raise exc
    return results[0]


def run_in_process(plan: Plan, dataset: Dataset, config: RunConfig, *, log: Callable[[str], None] = print,
                   observe: Callable[[dict], None] | None = None) -> list[float]:
    """What ``transpile run`` does on the cpu backend, with every rank a thread of this process
    (the Python API's ``train``): ``config`` as ``resolve`` (runtime/cli.py) made it, so --export,
    --checkpoint, --resume, --metrics and --eval-data all work; ``observe`` gets rank 0's records
    and summary. Returns the global losses of the steps run."""
    if config.backend != "cpu":
        raise RunError(f"in-process ranks run on the cpu backend, not {config.backend} (start 'transpile run' for GPUs)")
    group = LocalGroup(plan.world_size)
    own = allowed_cores()
    threads = threads_per_rank(own, [own] * plan.world_size)  # the ranks, threads here, share these cores

    def run_rank(r: int) -> list[float]:
        trainer = Trainer(plan, group.communicator(r), rank=r, backend=CpuBackend(threads=threads),
                          accumulation=config.grad_accumulation)
        return train(trainer, dataset, config, log=log, evaluator=make_evaluator(trainer, config),
                     observe=observe if r == 0 else None)

    return run_threads(group, run_rank)
