"""The Trainer: one rank's graphs, sessions and state between steps.

A Trainer owns one rank's state (parameters, optimizer state, step counter) between steps: the init
graph produces it (its Broadcasts make every replica start equal), each step feeds it back in and
replaces every state input by its matching output. Sessions are built once, in the constructor.
Where this rank stands in the world (its rank, the world size) is the communicator's: ``comm.rank``
and ``comm.size`` are the one source the loop (runtime/loop.py) reads them from.
"""

from __future__ import annotations

import numpy as np
import onnx

from contract.plan import EXPORTED_KINDS
from runtime.accumulation import accumulation_graphs, micro_batches
from runtime.collectives import Communicator
from runtime.data import shard_size
from runtime.errors import RunError
from runtime.executor import Backend, CpuBackend
from runtime.plan import Plan
from runtime.segments import cut_graph, load_graph


class Trainer:
    """One rank (``rank=None``: the single-device graphs) of a plan, on a backend and a communicator."""

    def __init__(self, plan: Plan, comm: Communicator, *, rank: int | None, backend: Backend | None = None,
                 accumulation: int | None = None):
        """``accumulation``: micro-batches per optimizer step (``--grad-accumulation K``; None: the
        plan's). Where the plan was transpiled without it and K > 1, the graphs for K micro-batches
        are derived from its step graph here (runtime/accumulation.py)."""
        self.plan = plan
        self.comm = comm
        self.backend = backend or CpuBackend()
        files = plan.graphs(rank)
        self.role = rank
        self.state_entries = files.state
        role = 0 if rank is None else rank
        split = self.backend.split_tail()
        # --grad-accumulation K: the first K-1 micro-batches of a step run the accumulate graph, the
        # last one the step graph, which sends the mean of the K micro-batches' gradients.
        self.accumulation = micro_batches(plan, accumulation)
        if self.accumulation > 1 and not self.backend.runs_grad_accumulation:
            given = "run with" if plan.grad_accumulation == 1 else "transpiled with"
            raise RunError(f"{plan.path}: {given} --grad-accumulation {self.accumulation}, which the "
                           f"{self.backend.name} backend does not run yet; use --backend cpu, or "
                           + ("run without it" if plan.grad_accumulation == 1 else "transpile without it"))
        step_model = load_graph(files.step)
        accum_model, accum_where = None, None
        self.accumulators = files.accumulators
        if self.accumulation > 1 and plan.grad_accumulation == 1:  # a run option: derived from the step graph
            step_model, accum_model, self.accumulators = accumulation_graphs(step_model, plan, files, self.accumulation)
            accum_where = f"{files.step.name} (micro-batches 1..{self.accumulation - 1} of a step)"
        elif self.accumulation > 1:  # transpiled with it: the accumulate graph is a file of OUT
            accum_model, accum_where = load_graph(files.accum), files.accum.name
        step_model = self.backend.prepare_step_graph(step_model)
        # Declared (dtype, shape) of every state input, to check state loaded from a checkpoint.
        self._state_types = {vi.name: (onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type),
                                       tuple(d.dim_value if d.HasField("dim_value") else None
                                             for d in vi.type.tensor_type.shape.dim))
                             for vi in step_model.graph.input if vi.type.HasField("tensor_type")}
        step_cut = cut_graph(step_model, role, files.step.name, split_tail=split,
                             native_domains=self.backend.native_domains,
                             late_domains=self.backend.late_native_domains,
                             collectives_inside=self.backend.collectives_inside and comm.size > 1)
        init_cut = cut_graph(load_graph(files.init), role, files.init.name)
        self._check_signature(step_cut.inputs, step_cut.outputs, init_cut.outputs, files.step.name, files.init.name)
        self.step_program = self.backend.make_program(step_cut, comm,
                                                      carried={s.output: s.input for s in self.state_entries})
        self.init_program = self.backend.make_program(init_cut, comm)
        self.state: dict[str, object] = {}
        self._held: list = []  # losses of steps not yet read (on the device for the GPU backend)
        # --clip-grad-norm plans: each step's global squared gradient norm, held like the loss and
        # read with it (``grad_norms``: the norms of the steps of the last collect_losses).
        self._held_norms: list = []
        self.grad_norms: list[float] = []
        # --precision fp16 plans: whether each step was skipped (its gradients overflowed), held like
        # the loss (``skipped``: the steps of the last collect_losses), and the loss scale after the
        # last of them (``loss_scale``); both the same on every rank (decided in the graph).
        if plan.precision is not None and plan.precision.grad_dtype != "fp32" and not self.backend.sends_low_precision:
            raise RunError(f"{plan.path}: transpiled with --grad-dtype {plan.precision.grad_dtype}, whose collectives the "
                           f"{self.backend.name} backend does not run yet; transpile without it (gradients are sent as "
                           "fp32), or use --backend cpu")
        scaling = plan.precision.loss_scaling if plan.precision is not None else None
        self._skipped_output = scaling.skipped_output if scaling is not None else None
        self._scale_state = scaling.scale_state if scaling is not None else None
        self._held_skipped: list = []
        self.skipped: list[bool] = []
        self.loss_scale: float | None = None
        if accum_model is not None:
            self.accum_program = self.backend.make_program(cut_graph(accum_model, role, accum_where), comm,
                                                           calls_per_step=self.accumulation - 1)
            self._zeros = {a.input: self.backend.from_host(np.zeros(a.shape, a.dtype)) for a in self.accumulators}

    def _check_signature(self, step_inputs, step_outputs, init_outputs, step_file: str, init_file: str) -> None:
        plan = self.plan
        expected = [d.name for d in plan.data_inputs] + [plan.lr_input] + [s.input for s in self.state_entries]
        expected += [a.input for a in self.accumulators]
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
        if self.init_program is None:
            raise RunError(f"{self.plan.path}: the init graph already ran; a Trainer initializes once")
        outputs = self.init_program.run({})
        self.state = {s.input: outputs[s.input] for s in self.state_entries}
        # The init graph runs once: drop its program, so that its sessions (and, on the GPU, their
        # memory arena, about the size of the state) go as soon as the first steps replace the state.
        self.init_program = None

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
        if self.plan.grad_norm and self.plan.grad_norm in outputs:
            self._held_norms.append(self.backend.hold_scalar(outputs[self.plan.grad_norm]))
        if self._skipped_output is not None and self._skipped_output in outputs:
            self._held_skipped.append(self.backend.hold_scalar(outputs[self._skipped_output]))

    def _micro_batches(self, data: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        k = self.accumulation
        parts: list[dict[str, np.ndarray]] = [{} for _ in range(k)]
        for spec in self.plan.data_inputs:
            array = data[spec.name]
            world = self.comm.size  # equal shards: this one is 1/world of the global batch
            shard_size(array.shape[spec.batch_axis] * world, world, k)
            for part, piece in zip(parts, np.split(array, k, axis=spec.batch_axis)):
                part[spec.name] = piece
        return parts

    def collect_losses(self) -> list[float]:
        """The losses of the steps since the last call, each averaged over all ranks (every rank
        must call this at the same steps: it is a collective on the host)."""
        # Losses, norms, skips and the loss scale come to the host in one transfer (one device
        # sync on GPU), at log and checkpoint steps only.
        scale = ([self.backend.hold_scalar(self.state[self._scale_state])]
                 if self._scale_state is not None and self._scale_state in self.state else [])
        groups = (self._held, self._held_norms, self._held_skipped, scale)
        values = self.backend.scalars_to_host([h for group in groups for h in group])
        cuts = np.cumsum([0] + [len(group) for group in groups])
        local, norms, skipped, scales = (values[a:b] for a, b in zip(cuts[:-1], cuts[1:]))
        self._held, self._held_norms, self._held_skipped = [], [], []
        # Every rank holds the same global norm (all-reduced in the graph where ranks hold parts).
        self.grad_norms = [float(np.sqrt(v)) for v in norms]
        self.skipped = [bool(v) for v in skipped]
        if scales:
            self.loss_scale = float(scales[0])
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
