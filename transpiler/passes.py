"""The rewrite, as composable passes over one shared ``Job``.

    AutodiffPass     forward graph -> forward + backward (gradients as outputs)
    PlacementPass    root rank of every parameter (hash or balanced)
    BucketingPass    gradients grouped in backward order
    SplitRanksPass   per rank: parameters and optimizer state become state inputs, collectives
                     are inserted, the optimizer update is emitted where the strategy puts it,
                     and an initialization graph Broadcasts the parameters from their roots

Each pass is an onnx-ir pass (``call(model) -> PassResult``) so they compose in a PassManager and
a failure names the passes that ran before it. The per-rank models and the analyses are kept on
the Job, which is what ``transpiler.plan`` writes out. ``SplitRanksPass.ensures`` checks the
distributed invariants (identical collective order on every rank; in the sharded strategy every
gradient reduced once, every parameter updated on one rank and broadcast once).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError
from onnx_ir.tape import Tape

from contract.names import ACC, LR_INPUT, NEXT, STEP_STATE
from transpiler.autodiff import build_gradients
from transpiler.batchnorm import decompose_batchnorm
from transpiler.bucketing import Bucket, make_buckets
from transpiler.collectives import DOMAIN, VERSION, append_collective, check_same_sequence, collective_nodes
from transpiler.errors import TranspileError
from transpiler.load import Problem
from transpiler.optimizer import (
    OptimizerConfig,
    emit_clip,
    emit_squared_norm,
    emit_step_increment,
    emit_update,
)
from transpiler.placement import Placement, place

STRATEGIES = ("sharded", "allreduce", "zero")
AFTER_GRADIENTS = -2  # order of a collective that follows every gradient collective (the clip norm)
MAX_GRAD_ACCUMULATION = 1024
MAX_WORLD_SIZE = 4096  # OUT holds two ONNX files per rank; beyond this, transpiling is the bottleneck


@dataclass(frozen=True)
class Options:
    world_size: int = 1
    strategy: str = "sharded"
    placement: str = "hash"
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig("sgd"))
    bucket_mb: float = 25.0
    sync_bn: bool = False  # BatchNormalization statistics all-reduced across ranks
    # Update each bucket of several parameters as one flat vector (fewer, larger ops: for GPUs,
    # where ~25 small kernels per parameter cost launches; on CPU the copies make it slower).
    flat_update: bool = False
    # Micro-batches per optimizer step: K-1 accumulate-graph runs, then the step graph, whose
    # gradients are the mean over the K micro-batches (DDP's no_sync, Horovod's backward_passes_per_step).
    grad_accumulation: int = 1

    def validate(self) -> None:
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise TranspileError(f"--gpus must be in [1, {MAX_WORLD_SIZE}] (got {self.world_size})")
        if self.strategy not in STRATEGIES:
            raise TranspileError(f"--strategy '{self.strategy}' is not one of: {', '.join(STRATEGIES)}")
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
    # Forward + backward with gradient (and buffer-update) outputs: "single" for the single-device
    # graphs, "ranks" for the rank graphs (they differ when --sync-bn puts collectives in the forward).
    fwd_bwd: dict[str, onnx.ModelProto] = field(default_factory=dict)


def reduced_gradient_name(job: Job, param: str) -> str:
    """The value a gradient collective sends for ``param``: its gradient, or with
    --grad-accumulation the mean of the micro-batches' gradients."""
    grad = job.grad_names[param]
    return grad + ".mean_of_micro_batches" if job.options.grad_accumulation > 1 else grad


def _nbytes(value: ir.Value) -> int:
    return int(np.prod(value.shape.numpy(), dtype=np.int64)) * value.dtype.bitwidth // 8


class AutodiffPass(InPlacePass):
    """Append the backward; the gradients of the trainable parameters become graph outputs."""

    def __init__(self, job: Job):
        super().__init__()
        self.job = job

    def call(self, model: ir.Model) -> PassResult:
        job = self.job
        world = job.options.world_size
        variants = [("single", 1)]
        if job.options.sync_bn and world > 1:
            variants.append(("ranks", world))
        source = ir.serde.serialize_model(model)
        for key, variant_world in variants:
            variant, buffers = decompose_batchnorm(ir.serde.deserialize_model(source), world_size=variant_world)
            self._differentiate(variant, buffers)
            job.fwd_bwd[key] = ir.serde.serialize_model(variant)
        job.fwd_bwd.setdefault("ranks", job.fwd_bwd["single"])
        return PassResult(model, modified=True)

    def _differentiate(self, model: ir.Model, buffers: list) -> None:
        graph = model.graph
        problem = self.job.problem
        loss = next(v for v in graph.outputs if v.name == problem.loss)
        wrt = [graph.initializers[p] for p in problem.params]
        grads = build_gradients(graph, loss, wrt)
        self.job.grad_order = [v.name for v in grads.order]
        self.job.sizes = {v.name: _nbytes(v) for v in wrt}
        for value in wrt:
            grad = grads.grads[value]
            self.job.grad_names[value.name] = grad.name
            graph.outputs.append(grad)
        for buffer in buffers:
            buffer.update.name = buffer.name + NEXT
            graph.outputs.append(buffer.update)

    def ensures(self, model: ir.Model) -> None:
        if sorted(self.job.grad_order) != sorted(self.job.problem.params):
            raise PostconditionError("the backward order must list every trainable parameter exactly once")


class PlacementPass(InPlacePass):
    """Give every parameter a root rank. Changes no graph."""

    def __init__(self, job: Job):
        super().__init__()
        self.job = job

    def call(self, model: ir.Model) -> PassResult:
        self.job.placement = place(self.job.sizes, self.job.options.world_size, self.job.options.placement)
        return PassResult(model, modified=False)


class BucketingPass(InPlacePass):
    """Group gradients into buckets, in backward order. Changes no graph."""

    def __init__(self, job: Job):
        super().__init__()
        self.job = job

    def call(self, model: ir.Model) -> PassResult:
        opts = self.job.options
        self.job.buckets = make_buckets(
            self.job.grad_order,
            self.job.sizes,
            self.job.placement.roots,
            int(opts.bucket_mb * 2**20),
            # A sharded bucket goes to one root; an all-reduced one may mix roots.
            group_by_root=opts.strategy == "sharded" and opts.world_size > 1,
        )
        return PassResult(model, modified=False)


class SplitRanksPass(InPlacePass):
    """Build the single-device graphs and one step graph and init graph per rank."""

    def __init__(self, job: Job):
        super().__init__()
        self.job = job

    def call(self, model: ir.Model) -> PassResult:
        job = self.job
        job.single = _RankBuilder(job, None).build()
        job.ranks = [_RankBuilder(job, r).build() for r in range(job.options.world_size)]
        return PassResult(model, modified=False)

    def ensures(self, model: ir.Model) -> None:
        job = self.job
        check_same_sequence([r.step.graph for r in job.ranks], "step")
        check_same_sequence([r.init.graph for r in job.ranks], "init")
        if job.options.grad_accumulation > 1:
            check_same_sequence([r.accum.graph for r in job.ranks], "accum")
        if job.options.world_size == 1:
            return
        updates = Counter(p for r in job.ranks for p in r.updates)
        if job.options.strategy == "zero":
            # Each parameter's elements are updated by the ranks whose slices cover them.
            wrong = [p for p in job.problem.params if not 1 <= updates[p] <= job.options.world_size]
        else:
            expected = 1 if job.options.strategy == "sharded" else job.options.world_size
            wrong = [p for p in job.problem.params if updates[p] != expected]
        if wrong:
            raise PostconditionError(f"parameters updated on the wrong number of ranks: {wrong}")
        for r in job.ranks:
            grads_sent = Counter(
                v.name for n in collective_nodes(r.step.graph) if n.op_type in ("AllReduce", "Reduce", "ReduceScatter")
                for v in n.inputs
            )
            bcast = Counter(
                v.name for n in collective_nodes(r.step.graph) if n.op_type == "Broadcast" for v in n.outputs
            )
            for p in job.problem.params:
                sent = grads_sent[reduced_gradient_name(job, p)]
                if sent != 1:
                    raise PostconditionError(f"rank {r.rank}: gradient of '{p}' is reduced {sent} times")
                if job.options.strategy == "sharded" and bcast[p + NEXT] != 1:
                    raise PostconditionError(f"rank {r.rank}: '{p}' is broadcast {bcast[p + NEXT]} times per step")


class _RankBuilder:
    """Builds one rank's step and init graphs (rank None: the single-device ones)."""

    def __init__(self, job: Job, rank: int | None):
        self.job = job
        self.rank = rank
        self.world = 1 if rank is None else job.options.world_size
        self.strategy = job.options.strategy if self.world > 1 else "local"
        self.config = job.options.optimizer
        self.roots = job.placement.roots

    def build(self) -> RankGraphs:
        step, state, updates = self._step_graph()
        init = self._init_graph(state)
        graphs = RankGraphs(self.rank, step, init, state, updates)
        if self.job.options.grad_accumulation > 1:
            graphs.accum, graphs.accumulators = self._accum_graph()
        return graphs

    def _forward_backward(self, name: str) -> tuple[ir.Model, dict[str, ir.Value], dict[str, ir.Value]]:
        """The forward + backward graph of this rank with the parameters and buffers turned from
        initializers into inputs (the runtime owns them as state); returns the model, its outputs
        by name, and the parameter inputs by name."""
        job = self.job
        model = ir.serde.deserialize_model(job.fwd_bwd["single" if self.rank is None else "ranks"])
        graph = model.graph
        graph.opset_imports[DOMAIN] = VERSION
        graph.name = name
        values = {v.name: v for v in graph.outputs}
        params = {}
        for param in job.problem.params:
            value = graph.initializers.pop(param)
            value.const_value = None
            graph.inputs.append(value)
            params[param] = value
        for buffer in job.problem.buffers:
            value = graph.initializers.pop(buffer)
            value.const_value = None
            graph.inputs.append(value)
        return model, values, params

    def _accumulator(self, graph: ir.Graph, param: ir.Value, grad: ir.Value) -> ir.Value:
        acc = ir.val(grad.name + ACC, grad.dtype, ir.Shape(param.shape))
        graph.inputs.append(acc)
        return acc

    def _accum_graph(self) -> tuple[ir.Model, list[StateEntry]]:
        """The graph of the first K-1 micro-batches: forward and backward, every gradient added to its
        accumulator, buffers (BatchNorm statistics) updated as the step graph updates them. No
        optimizer, no gradient collective (a --sync-bn forward keeps its statistics AllReduce)."""
        job, problem = self.job, self.job.problem
        model, values, params = self._forward_backward("train_accum" if self.rank is None else f"rank{self.rank}_accum")
        graph = model.graph
        tape = Tape(graph)
        outputs, accumulators = [values[problem.loss]], []
        for name in problem.params:
            grad = values[job.grad_names[name]]
            acc = self._accumulator(graph, params[name], grad)
            total = tape.op("Add", [acc, grad])
            total.name, total.dtype, total.shape = acc.name + NEXT, grad.dtype, ir.Shape(params[name].shape)
            outputs.append(total)
            accumulators.append(StateEntry(acc.name, total.name, "accum", name,
                                           tuple(int(d) for d in params[name].shape.numpy()), grad.dtype))
        outputs += [values[b + NEXT] for b in problem.buffers]
        graph.outputs.clear()
        graph.outputs.extend(outputs)
        _remove_unused(graph)
        _number_collectives(graph)
        return model, accumulators

    def _mean_of_micro_batches(self, graph: ir.Graph, params: dict[str, ir.Value], grads: dict[str, ir.Value]) -> None:
        """--grad-accumulation K: each gradient becomes (accumulator + gradient) / K, right after the
        node that computes it, so the gradient collectives keep their backward order."""
        k = self.job.options.grad_accumulation
        first = next(iter(graph))
        inverse = ir.node("Constant", [], {"value": ir.tensor(np.array(1.0 / k, dtype=np.float32))}, name="grad_accum/inverse_k")
        inverse.outputs[0].name = "grad_accum.inverse_k"
        inverse.outputs[0].dtype, inverse.outputs[0].shape = ir.DataType.FLOAT, ir.Shape([])
        graph.insert_before(first, inverse)
        for name, grad in list(grads.items()):
            acc = self._accumulator(graph, params[name], grad)
            shape = ir.Shape(params[name].shape)
            add = ir.node("Add", [acc, grad], name=f"grad_accum/{name}/add")
            mul = ir.node("Mul", [add.outputs[0], inverse.outputs[0]], name=f"grad_accum/{name}/mean")
            for node, suffix in ((add, ".sum"), (mul, ".mean_of_micro_batches")):
                node.outputs[0].name, node.outputs[0].dtype, node.outputs[0].shape = grad.name + suffix, grad.dtype, shape
            producer = grad.producer()
            if producer is None:
                graph.insert_before(first, [add, mul])
            else:
                graph.insert_after(producer, [add, mul])
            grads[name] = mul.outputs[0]

    # -- the step graph ------------------------------------------------------------------------

    def _step_graph(self) -> tuple[ir.Model, list[StateEntry], list[str]]:
        job, problem = self.job, self.job.problem
        model, values, params = self._forward_backward("train_step" if self.rank is None else f"rank{self.rank}_step")
        graph = model.graph
        loss = values[problem.loss]
        grads = {p: values[job.grad_names[p]] for p in problem.params}
        if job.options.grad_accumulation > 1:
            self._mean_of_micro_batches(graph, params, grads)
        lr = ir.val(LR_INPUT, ir.DataType.FLOAT, [])
        graph.inputs.append(lr)
        graph.outputs.clear()
        graph.outputs.append(loss)

        state: list[StateEntry] = []
        outputs: list[ir.Value] = []

        def add_state(value_in: ir.Value, value_out: ir.Value, kind: str, param: str | None) -> None:
            value_out.name = value_in.name + NEXT
            shape = tuple(int(d) for d in value_in.shape.numpy())
            state.append(StateEntry(value_in.name, value_out.name, kind, param, shape, value_in.dtype))
            outputs.append(value_out)

        # Running statistics: every rank updates its own (from its shard, or from the synchronized
        # statistics with --sync-bn).
        inputs = {v.name: v for v in graph.inputs}
        for name in problem.buffers:
            add_state(inputs[name], values[name + NEXT], "buffer", name)

        step = None
        if self.config.uses_step():
            step_in = ir.val(STEP_STATE, ir.DataType.FLOAT, [])
            graph.inputs.append(step_in)
            step = emit_step_increment(graph, step_in)
            add_state(step_in, step, "step", None)

        updates: list[str] = []

        def update(name: str, grad: ir.Value, param: ir.Value | None = None) -> ir.Value:
            """Emit the optimizer update of the parameter ``name``, or of ``param`` (a zero slice
            named ``name``, whose state belongs to no single parameter)."""
            owner = name if param is None else None
            param = params[name] if param is None else param
            slots = {}
            for slot in self.config.slots():
                slots[slot] = ir.val(f"{name}.{slot}", param.dtype, ir.Shape(param.shape))
                graph.inputs.append(slots[slot])
            new_param, new_slots = emit_update(
                graph, self.config, param=param, grad=grad, lr=lr, step=step, state=slots, name=name
            )
            for slot, value in slots.items():
                add_state(value, new_slots[slot], "optimizer", owner)
            return new_param

        def update_bucket(bucket: Bucket, bucket_grads: list[ir.Value]) -> list[ir.Value]:
            """The new values of a bucket's parameters. With --flat-update a bucket of several
            parameters is updated as one flat vector (its optimizer state too): the optimizers are
            elementwise, so the numbers are those of per-parameter updates, in a few large ops
            instead of ~25 small ones per parameter (kernel launches dominate small updates on a
            GPU; on CPU the concatenation copies cost more than they save)."""
            names = bucket.params
            updates.extend(names)
            if not job.options.flat_update or len(names) == 1 or len({params[n].dtype for n in names}) != 1:
                return [update(n, g) for n, g in zip(names, bucket_grads)]
            tape = Tape(graph)
            sizes = [int(np.prod(params[n].shape.numpy(), dtype=np.int64)) for n in names]
            flat_param = _flatten(tape, [params[n] for n in names], sum(sizes))
            flat_grad = _flatten(tape, bucket_grads, sum(sizes))
            new_flat = update(f"bucket{bucket.id}", flat_grad, param=flat_param)
            parts = tape.op_multi_out("Split", [new_flat, _int64(tape, sizes)], {"axis": 0}, num_outputs=len(names))
            new_values = []
            for name, part in zip(names, parts):
                shape = [int(d) for d in params[name].shape.numpy()]
                value = tape.op("Reshape", [part, _int64(tape, shape)])
                value.dtype, value.shape = params[name].dtype, ir.Shape(shape)
                new_values.append(value)
            return new_values

        order = 0
        buckets = job.buckets
        if self.strategy == "local":
            clipped = self._clip(graph, [[grads[p] for p in bucket.params] for bucket in buckets])
            for bucket, bucket_grads in zip(buckets, clipped):
                for name, value in zip(bucket.params, update_bucket(bucket, bucket_grads)):
                    add_state(params[name], value, "param", name)
        elif self.strategy == "zero":
            slices = [self._zero_scatter(graph, bucket, params, grads) for bucket in buckets]
            clipped = self._clip(graph, [[grad_slice] for grad_slice in slices])
            for bucket, (grad_slice,) in zip(buckets, clipped):
                self._zero_update(graph, bucket, params, grad_slice, update, add_state, updates)
        elif self.strategy == "allreduce":
            reduced = []
            for bucket in buckets:
                reduced.append(append_collective(
                    graph, "AllReduce", [grads[p] for p in bucket.params],
                    like=[params[p] for p in bucket.params],
                    output_names=[f"{job.grad_names[p]}.mean" for p in bucket.params],
                    order=order, bucket=bucket.id, phase="step", reduction="mean",
                ))
                order += 1
            for bucket, bucket_grads in zip(buckets, self._clip(graph, reduced)):
                for name, value in zip(bucket.params, update_bucket(bucket, bucket_grads)):
                    add_state(params[name], value, "param", name)
        else:
            # Sharded: all Reduces in backward order first (each can start as soon as its bucket's
            # gradients exist), then the Broadcasts of the updated values, in the same bucket order.
            owned, reduced = [], []
            for bucket in buckets:
                root = bucket.root == self.rank
                bucket_grads = append_collective(
                    graph, "Reduce", [grads[p] for p in bucket.params],
                    like=[params[p] for p in bucket.params],
                    output_names=[f"{job.grad_names[p]}.mean" for p in bucket.params] if root else None,
                    order=order, bucket=bucket.id, phase="step", root=bucket.root, reduction="mean",
                )
                order += 1
                if root:
                    owned.append(bucket)
                    reduced.append(bucket_grads)
            updated: dict[str, ir.Value] = {}
            for bucket, bucket_grads in zip(owned, self._clip(graph, reduced)):
                for name, value in zip(bucket.params, update_bucket(bucket, bucket_grads)):
                    value.name = f"{name}.updated"
                    updated[name] = value
            for bucket in buckets:
                root = bucket.root == self.rank
                new_values = append_collective(
                    graph, "Broadcast", [updated[p] for p in bucket.params] if root else [],
                    like=[params[p] for p in bucket.params],
                    output_names=[p + NEXT for p in bucket.params],
                    order=order, bucket=bucket.id, phase="step", root=bucket.root,
                )
                order += 1
                for name, value in zip(bucket.params, new_values):
                    state.append(StateEntry(name, value.name, "param", name, tuple(value.shape.numpy()), value.dtype))
                    outputs.append(value)

        graph.outputs.extend(outputs)
        _remove_unused(graph)
        _number_collectives(graph)
        return model, state, updates

    def _clip(self, graph: ir.Graph, grads: list[list[ir.Value]]) -> list[list[ir.Value]]:
        """--clip-grad-norm: the reduced gradients this rank holds (per bucket), scaled by
        clip_grad_norm_'s coefficient. The global norm needs every gradient: in the sharded and zero
        strategies a rank holds only some (its buckets, its slices), so the squared norms of the parts
        are summed over the ranks by one scalar AllReduce, after the gradient collectives."""
        if self.config.max_grad_norm is None:
            return grads
        squared = emit_squared_norm(graph, [g for bucket_grads in grads for g in bucket_grads])
        if self.strategy in ("sharded", "zero"):
            squared = append_collective(
                graph, "AllReduce", [squared], like=[squared], output_names=["grad_norm.squared.sum"],
                order=AFTER_GRADIENTS, bucket=-1, phase="step", reduction="sum",
            )[0]
        flat = iter(emit_clip(graph, self.config, squared, [g for bucket_grads in grads for g in bucket_grads]))
        return [[next(flat) for _ in bucket_grads] for bucket_grads in grads]

    def _zero_layout(self, bucket, params) -> tuple[list[int], int, int, ir.DataType]:
        """(element count of each parameter, bucket total, slice length S, dtype) of a zero bucket."""
        names = bucket.params
        dtypes = {params[p].dtype for p in names}
        if len(dtypes) != 1:
            raise TranspileError(f"--strategy zero: bucket {bucket.id} mixes dtypes {sorted(map(str, dtypes))}")
        sizes = [int(np.prod(params[p].shape.numpy(), dtype=np.int64)) for p in names]
        total = sum(sizes)
        return sizes, total, -(-total // self.world), params[names[0]].dtype

    def _zero_scatter(self, graph, bucket, params, grads) -> ir.Value:
        """ReduceScatter the bucket's gradients; returns this rank's [S] slice of their mean.

        The flat layout (contracts.md): parameters flattened and concatenated in bucket order,
        zero-padded to N*S elements; rank r owns [r*S, (r+1)*S). Padding stays zero: its gradient
        is zero, so is its update.
        """
        _, _, per_rank, dtype = self._zero_layout(bucket, params)
        return append_collective(
            graph, "ReduceScatter", [grads[p] for p in bucket.params],
            like=[ir.val("", dtype, [per_rank])], output_names=[f"bucket{bucket.id}.grad.slice"],
            order=0, bucket=bucket.id, phase="step", reduction="mean",
        )[0]

    def _zero_update(self, graph, bucket, params, grad_slice, update, add_state, updates) -> None:
        """Update this rank's 1/N slice of the bucket, AllGather the values. The optimizer state of
        a bucket is one [S] vector per slot, on this rank only."""
        names = bucket.params
        sizes, total, per_rank, dtype = self._zero_layout(bucket, params)
        start = self.rank * per_rank
        tape = Tape(graph)

        def const(array: np.ndarray) -> ir.Value:
            return tape.op("Constant", [], {"value": ir.tensor(array)})

        flat = _flatten(tape, [params[p] for p in names], total)
        if per_rank * self.world > total:
            flat = tape.op("Pad", [flat, const(np.array([0, per_rank * self.world - total], np.int64))])
        param_slice = tape.op("Slice", [flat, const(np.array([start], np.int64)),
                                        const(np.array([start + per_rank], np.int64))])
        param_slice.dtype, param_slice.shape = dtype, ir.Shape([per_rank])
        new_slice = update(f"bucket{bucket.id}.slice", grad_slice, param=param_slice)
        gathered = append_collective(
            graph, "AllGather", [new_slice], like=[params[p] for p in names],
            output_names=[p + NEXT for p in names], order=0, bucket=bucket.id, phase="step",
        )
        offset = 0
        for name, size, value in zip(names, sizes, gathered):
            add_state(params[name], value, "param", name)
            if offset < start + per_rank and offset + size > start:
                updates.append(name)  # part of this parameter's elements are updated here
            offset += size

    # -- the init graph ------------------------------------------------------------------------

    def _init_graph(self, state: list[StateEntry]) -> ir.Model:
        """No inputs; outputs named like the step graph's state inputs, holding their initial values.

        Every parameter is Broadcast from its root, where alone its initial value is stored (so the
        rank files together hold each weight once). Optimizer state starts as zeros: in the sharded
        strategy it exists only on the root and needs no collective; in the all-reduce strategy it
        is broadcast with its parameter, so replicas also agree when the state is not zeros.
        """
        problem = self.job.problem
        graph = ir.Graph(
            [], [], nodes=[], opset_imports={"": problem.opset, DOMAIN: VERSION},
            name="train_init" if self.rank is None else f"rank{self.rank}_init",
        )
        source = problem.model.graph.initializers

        def initial(entry: StateEntry) -> ir.Value:
            if entry.kind in ("param", "buffer"):
                array = source[entry.param].const_value.numpy()
                value = ir.val(f"{entry.input}.init", ir.DataType.from_numpy(array.dtype), array.shape,
                               const_value=ir.tensor(array, name=f"{entry.input}.init"))
                graph.register_initializer(value)
                return value
            shape, dtype = list(entry.shape), entry.dtype
            zero = ir.tensor(np.zeros((1,), dtype=dtype.numpy()))
            dims = ir.tensor(np.array(shape, dtype=np.int64), name=f"{entry.input}.shape")
            node = ir.node("ConstantOfShape", [_const(graph, dims)], {"value": zero}, name=f"init/zeros/{entry.input}")
            graph.append(node)
            out = node.outputs[0]
            out.dtype, out.shape = dtype, ir.Shape(shape)
            return out

        def named_output(value: ir.Value, name: str) -> None:
            node = ir.node("Identity", [value], name=f"init/{name}")
            graph.append(node)
            out = node.outputs[0]
            out.name, out.dtype, out.shape = name, value.dtype, ir.Shape(value.shape)
            graph.outputs.append(out)

        broadcast = [e for e in state if e.kind == "param"]
        if self.strategy == "allreduce":
            # A parameter's own optimizer state goes with it; a bucket's flat state (no single
            # parameter, hence no root) starts as zeros on every rank, equal without a collective.
            broadcast += [e for e in state if e.kind == "optimizer" and e.param is not None]
        local = [e for e in state if e not in broadcast]

        if self.strategy == "local":
            for entry in state:
                named_output(initial(entry), entry.input)
            return ir.Model(graph, ir_version=problem.model.ir_version)

        order = 0
        for root in range(self.world):
            group = [e for e in broadcast if self.roots[e.param] == root]
            if not group:
                continue
            like = [ir.val(e.input, e.dtype, list(e.shape)) for e in group]
            outs = append_collective(
                graph, "Broadcast", [initial(e) for e in group] if root == self.rank else [],
                like=like, output_names=[e.input for e in group],
                order=order, bucket=-1, phase="init", root=root,
            )
            order += 1
            graph.outputs.extend(outs)
        for entry in local:
            named_output(initial(entry), entry.input)
        return ir.Model(graph, ir_version=problem.model.ir_version)


def _int64(tape: Tape, values: list[int]) -> ir.Value:
    return tape.op("Constant", [], {"value": ir.tensor(np.array(values, dtype=np.int64))})


def _flatten(tape: Tape, values: list[ir.Value], total: int) -> ir.Value:
    """The values flattened and concatenated, in order (a bucket's flat layout)."""
    flat = tape.op("Concat", [tape.op("Reshape", [v, _int64(tape, [-1])]) for v in values], {"axis": 0})
    flat.dtype, flat.shape = values[0].dtype, ir.Shape([total])
    return flat


def _number_collectives(graph: ir.Graph) -> None:
    """Give every collective its ``order``: the sequence every rank issues them in.

    The key must be the same on every rank although the graphs differ (a non-root Broadcast has no
    inputs, only roots run updates). It is built from the forward/backward, which every rank shares
    node for node:
    - a collective inside the forward/backward (--sync-bn statistics; created with order -1) is
      keyed by its own position;
    - a gradient collective (appended afterwards, in the strategy's sequence) by the position of
      the last of its input gradients, so a bucket's collective comes as early as its gradients
      allow and never waits behind a later part of the backward;
    - the sum of the ranks' squared gradient norms (--clip-grad-norm; created with order
      AFTER_GRADIENTS) after every gradient collective, since it reads all their results;
    - collectives that follow optimizer updates (Broadcast, AllGather) come last, in their appended
      sequence.
    The result is a topological order of the collectives, so issuing them in it cannot deadlock.
    """
    nodes = list(graph)
    position = {out: i for i, node in enumerate(nodes) for out in node.outputs}
    ranked = []
    for sequence, node in enumerate(n for n in nodes if n.domain == DOMAIN):
        if node.attributes["order"].as_int() == AFTER_GRADIENTS:
            key = (len(nodes), -1)
        elif node.attributes["order"].as_int() < 0:
            key = (nodes.index(node), sequence)
        elif node.op_type in ("Broadcast", "AllGather"):
            key = (len(nodes), sequence)
        else:
            key = (max((position.get(v, -1) for v in node.inputs if v is not None), default=-1), sequence)
        ranked.append((key, node))
    for order, (_, node) in enumerate(sorted(ranked, key=lambda item: item[0])):
        node.attributes["order"] = ir.AttrInt64("order", order)


def _const(graph: ir.Graph, tensor: ir.TensorProtocol) -> ir.Value:
    value = ir.val(tensor.name, tensor.dtype, tensor.shape, const_value=tensor)
    graph.register_initializer(value)
    return value


def _remove_unused(graph: ir.Graph) -> None:
    """Drop nodes whose outputs nothing uses (e.g. gradients of a frozen branch)."""
    live = set(graph.outputs)
    keep = []
    for node in reversed(list(graph)):
        if node.domain == DOMAIN or any(out in live for out in node.outputs):
            keep.append(node)
            live.update(v for v in node.inputs if v is not None)
    dead = [n for n in graph if n not in keep]
    if dead:
        graph.remove(dead, safe=False)
    for name in [n for n, v in graph.initializers.items() if v not in live]:
        graph.initializers.pop(name)


def run_passes(job: Job) -> None:
    manager = ir.passes.PassManager(
        [AutodiffPass(job), PlacementPass(job), BucketingPass(job), SplitRanksPass(job)], steps=1
    )
    try:
        manager(job.problem.model)
    except ir.passes.PassError as exc:
        # Surface the user-facing error from inside the pass chain unchanged.
        cause = exc
        while cause is not None and not isinstance(cause, TranspileError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise
