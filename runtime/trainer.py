"""The training loop of one rank, the in-process simulator of all ranks, and --export.

A Trainer owns one rank's state (parameters, optimizer state, step counter) between steps: the init
graph produces it (its Broadcasts make every replica start equal), each step feeds it back in and
replaces every state input by its matching output. Sessions are built once, in the constructor.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from runtime import checkpoint
from runtime.collectives import Communicator, LocalGroup
from runtime.data import Dataset, shard_size
from runtime.errors import RunError
from runtime.executor import Backend, CpuBackend
from runtime.plan import Plan, load_plan
from runtime.schedule import Schedule
from runtime.segments import cut_graph, load_graph

# Most steps whose losses wait on the device before being read (the GPU ring holds more).
FLUSH_EVERY = 1024

# State kinds whose values --export writes into the user's model, by initializer name.
EXPORTED_KINDS = ("param", "buffer")


@dataclass(frozen=True)
class RunConfig:
    batch: int  # global batch, over all ranks
    steps: int
    lr: float
    shuffle: bool = False
    seed: int = 0
    log_every: int = 0  # 0: silent
    export: Path | None = None
    checkpoint: Path | None = None  # written every checkpoint_every steps (0: at the end only)
    checkpoint_every: int = 0
    resume: Path | None = None  # a checkpoint to start from instead of the init graph
    timings: Path | None = None  # measured segment and collective times, for inspect --timings
    schedule: Schedule = Schedule()  # learning rate per step (lr is the schedule's peak)


class Trainer:
    """One rank (``rank=None``: the single-device graphs) of a plan, on a backend and a communicator."""

    def __init__(self, plan: Plan, comm: Communicator, *, rank: int | None, backend: Backend | None = None):
        self.plan = plan
        self.comm = comm
        self.backend = backend or CpuBackend()
        files = plan.graphs(rank)
        self.role = rank
        self.state_entries = files.state
        role = 0 if rank is None else rank
        split = self.backend.split_tail()
        step_model = load_graph(files.step)
        # Declared (dtype, shape) of every state input, to check state loaded from a checkpoint.
        self._state_types = {vi.name: (onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type),
                                       tuple(d.dim_value if d.HasField("dim_value") else None
                                             for d in vi.type.tensor_type.shape.dim))
                             for vi in step_model.graph.input if vi.type.HasField("tensor_type")}
        step_cut = cut_graph(step_model, role, files.step.name, split_tail=split,
                             native_domains=self.backend.native_domains)
        init_cut = cut_graph(load_graph(files.init), role, files.init.name)
        self._check_signature(step_cut.inputs, step_cut.outputs, init_cut.outputs, files.step.name, files.init.name)
        self.step_program = self.backend.make_program(step_cut, comm)
        self.init_program = self.backend.make_program(init_cut, comm)
        self.state: dict[str, object] = {}
        self._held: list = []  # losses of steps not yet read (on the device for the GPU backend)
        # --grad-accumulation K: the first K-1 micro-batches of a step run the accumulate graph.
        self.accumulation = plan.grad_accumulation
        self.accumulators = files.accumulators
        if self.accumulation > 1:
            if self.backend.name != "cpu":
                raise RunError(f"{plan.path}: transpiled with --grad-accumulation {self.accumulation}, which the "
                               f"{self.backend.name} backend does not run yet; use --backend cpu, or transpile without it")
            self.accum_program = self.backend.make_program(cut_graph(load_graph(files.accum), role, files.accum.name), comm)
            self._zeros = {a.input: self.backend.from_host(np.zeros(a.shape, a.dtype)) for a in self.accumulators}

    def _check_signature(self, step_inputs, step_outputs, init_outputs, step_file: str, init_file: str) -> None:
        plan = self.plan
        expected = [d.name for d in plan.data_inputs] + [plan.lr_input] + [s.input for s in self.state_entries]
        expected += [a.input for a in plan.graphs(self.role).accumulators]
        if sorted(step_inputs) != sorted(expected):
            extra = sorted(set(step_inputs) - set(expected))
            lacking = sorted(set(expected) - set(step_inputs))
            raise RunError(f"{step_file}: graph inputs do not match plan.json (not in the plan: {extra or 'none'}; "
                           f"missing from the graph: {lacking or 'none'})")
        needed = [plan.loss] + [s.output for s in self.state_entries]
        lacking = [name for name in needed if name not in step_outputs]
        if lacking:
            raise RunError(f"{step_file}: graph outputs lack {', '.join(lacking)} (named in plan.json)")
        lacking = [s.input for s in self.state_entries if s.input not in init_outputs]
        if lacking:
            raise RunError(f"{init_file}: graph outputs lack state value(s) {', '.join(lacking)}")

    def initialize(self) -> None:
        outputs = self.init_program.run({})
        self.state = {s.input: outputs[s.input] for s in self.state_entries}

    def load_state(self, arrays: dict[str, np.ndarray], where: str) -> None:
        """Start from saved state (a checkpoint) instead of the init graph."""
        expected = {s.input for s in self.state_entries}
        if set(arrays) != expected:
            raise RunError(f"{where}: holds state {sorted(set(arrays) ^ expected)} that this rank's graph does not match")
        for name, array in arrays.items():
            dtype, shape = self._state_types.get(name, (array.dtype, array.shape))
            if array.dtype != dtype or len(shape) != array.ndim or any(d is not None and d != n for d, n in zip(shape, array.shape)):
                raise RunError(f"{where}: '{name}' is {array.dtype} {list(array.shape)}, this rank's graph expects "
                               f"{dtype} {[d if d is not None else '?' for d in shape]}")
        self.state = {name: self.backend.from_host(array) for name, array in arrays.items()}

    def step(self, data: dict[str, np.ndarray], lr: float) -> float:
        """Run one training step on this rank's shard; returns the loss averaged over all ranks."""
        self.step_async(data, lr)
        return self.collect_losses()[-1]

    def step_async(self, data: dict[str, np.ndarray], lr: float) -> None:
        """Run one step; its loss is kept (on the device on GPU) until ``collect_losses``. With
        gradient accumulation, ``data`` (this rank's shard) is cut into K equal micro-batches: the
        accumulate graph adds the gradients of the first K-1, the step graph those of the last and
        updates with their mean."""
        if self.accumulation > 1:
            *firsts, data = self._micro_batches(data)
            accumulated = dict(self._zeros)
            for micro in firsts:
                feeds = {name: self.backend.feed(name, array) for name, array in micro.items()}
                outputs = self.accum_program.run({**feeds, **self.state, **accumulated})
                accumulated = {a.input: outputs[a.output] for a in self.accumulators}
                for s in self.state_entries:
                    if s.kind == "buffer":  # BatchNorm statistics move on with every micro-batch
                        self.state[s.input] = outputs[s.output]
                self._held.append(self.backend.hold_scalar(outputs[self.plan.loss]))
            self.state = {**self.state, **accumulated}
        feeds = {name: self.backend.feed(name, array) for name, array in data.items()}
        feeds[self.plan.lr_input] = self.backend.feed(self.plan.lr_input, np.array(lr, dtype=np.float32))
        feeds.update(self.state)
        outputs = self.step_program.run(feeds)
        self.state = {s.input: outputs[s.output] for s in self.state_entries}
        self._held.append(self.backend.hold_scalar(outputs[self.plan.loss]))

    def _micro_batches(self, data: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        k = self.accumulation
        parts: list[dict[str, np.ndarray]] = [{} for _ in range(k)]
        for spec in self.plan.data_inputs:
            array = data[spec.name]
            rows = array.shape[spec.batch_axis]
            if rows % k:
                raise RunError(f"a shard of {rows} rows does not split into --grad-accumulation {k} equal micro-batches")
            for part, piece in zip(parts, np.split(array, k, axis=spec.batch_axis)):
                part[spec.name] = piece
        return parts

    def collect_losses(self) -> list[float]:
        """The losses of the steps since the last call, each averaged over all ranks (every rank
        must call this at the same steps: it is a collective on the host)."""
        local = self.backend.scalars_to_host(self._held)
        self._held = []
        if self.accumulation > 1:  # one loss per micro-batch: a step's is their mean (equal sizes)
            k = self.accumulation
            local = [sum(local[i:i + k]) / k for i in range(0, len(local), k)]
        # The step graph's loss is the mean over this rank's shard; equal shards make the mean of
        # the ranks' means the mean over the global batch, i.e. what one device reports.
        return self.comm.allreduce_scalars(local, "mean") if local else []

    def state_dict(self) -> dict[str, np.ndarray]:
        """Host copies of the state, keyed by state input name."""
        return {name: np.array(self.backend.to_host(value), copy=True) for name, value in self.state.items()}

    def parameters(self) -> dict[str, np.ndarray]:
        """Trained values keyed by the user's initializer name (what --export writes back): the
        parameters and the buffers (state that is updated but not trained, e.g. BatchNorm's
        running statistics)."""
        return {s.param or s.input: np.array(self.backend.to_host(self.state[s.input]), copy=True)
                for s in self.state_entries if s.kind in EXPORTED_KINDS}


def train(trainer: Trainer, dataset: Dataset, config: RunConfig, *, rank: int, world_size: int,
          log: Callable[[str], None] = print) -> list[float]:
    """Initialize (or resume) and run up to step ``config.steps``; rank 0 logs and exports.
    Returns the global losses of the steps run."""
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
            if not hasattr(trainer.step_program, "record_timings"):
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
        _write_timings(config.timings, trainer.step_program.median_timings(), rank=rank, world_size=world_size,
                       comm=trainer.comm)
    if rank == 0 and config.export is not None:
        export_model(trainer.plan, trainer.parameters(), config.export)
    return losses


def _write_timings(path: Path, mine: dict, *, rank: int, world_size: int, comm: Communicator) -> None:
    """Every rank's medians into one JSON file (``{"ranks": [{"rank": r, "segments": ..., "collectives":
    ...}]}``), through per-rank files: the communicator moves arrays, not documents."""
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


def export_model(plan: Plan, parameters: dict[str, np.ndarray], path: str | Path) -> None:
    """Write the user's model with trained values in its initializers, atomically (temp file + rename)."""
    path = Path(path)
    model = load_graph(plan.model)
    by_name = {t.name: t for t in model.graph.initializer}
    missing = [name for name in parameters if name not in by_name]
    if missing:
        raise RunError(f"{plan.model}: has no initializer(s) {', '.join(missing)} to export trained values into")
    for name, value in parameters.items():
        old = by_name[name]
        if tuple(old.dims) != value.shape or onnx.helper.tensor_dtype_to_np_dtype(old.data_type) != value.dtype:
            raise RunError(f"{plan.model}: initializer '{name}' is {list(old.dims)} "
                           f"{onnx.helper.tensor_dtype_to_np_dtype(old.data_type)}, trained value is {list(value.shape)} {value.dtype}")
        old.CopyFrom(numpy_helper.from_array(value, name))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes it private; the export is an ordinary new file
        with os.fdopen(fd, "wb") as f:
            f.write(model.SerializeToString())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


@dataclass
class SimResult:
    losses: list[float]  # global mean loss per step (identical on every rank)
    states: list[dict[str, np.ndarray]]  # per rank: final state keyed by state input name
    parameters: list[dict[str, np.ndarray]]  # per rank: final parameters keyed by parameter name


def simulate(out_dir: str | Path, data: dict[str, np.ndarray], *, batch: int, steps: int, lr: float | None = None,
             shuffle: bool = False, seed: int = 0, single_device: bool = False,
             schedule: Schedule | None = None) -> SimResult:
    """Train all ranks of OUT as threads of this process (or the single-device graph on the full batch).

    Collectives go through a LocalGroup, so this checks "N ranks == 1 device" with no MPI. Each
    session gets one intra-op thread: the ranks already run in parallel.
    """
    plan = load_plan(out_dir)
    world_size = 1 if single_device else plan.world_size
    dataset = Dataset(data, plan.data_inputs, "<data>")
    shard_size(batch, world_size)
    config = RunConfig(batch=batch, steps=steps, lr=plan.lr if lr is None else lr, shuffle=shuffle, seed=seed,
                       schedule=schedule or Schedule())
    group = LocalGroup(world_size)
    losses: list[list[float] | None] = [None] * world_size
    trainers: list[Trainer | None] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def run_rank(r: int) -> None:
        try:
            trainers[r] = Trainer(plan, group.communicator(r), rank=None if single_device else r, backend=CpuBackend(threads=1))
            losses[r] = train(trainers[r], dataset, config, rank=r, world_size=world_size)
        except BaseException as exc:  # re-raised below in the caller's thread
            errors[r] = exc
            group.abort()  # peers blocked in a collective raise BrokenBarrierError instead of hanging

    threads = [threading.Thread(target=run_rank, args=(r,), name=f"rank{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Report the failure that caused the abort, not the BrokenBarrierErrors it caused in the peers.
    failures = [(r, e) for r, e in enumerate(errors) if e is not None]
    for r, exc in sorted(failures, key=lambda f: isinstance(f[1], threading.BrokenBarrierError)):
        if isinstance(exc, RunError):
            raise RunError(f"rank {r}: {exc}") from exc
        raise exc
    return SimResult(losses=losses[0], states=[t.state_dict() for t in trainers],
                     parameters=[t.parameters() for t in trainers])
