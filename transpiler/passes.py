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

from transpiler.autodiff import build_gradients
from transpiler.bucketing import Bucket, make_buckets
from transpiler.collectives import DOMAIN, VERSION, append_collective, check_same_sequence, collective_nodes
from transpiler.errors import TranspileError
from transpiler.load import Problem
from transpiler.optimizer import OptimizerConfig, emit_step_increment, emit_update
from transpiler.placement import Placement, place

STRATEGIES = ("sharded", "allreduce")
LR_INPUT = "lr"
STEP_STATE = "optimizer.step"
NEXT = ".next"  # suffix of a state input's updated output


@dataclass(frozen=True)
class Options:
    world_size: int = 1
    strategy: str = "sharded"
    placement: str = "hash"
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig("sgd"))
    bucket_mb: float = 25.0
    sync_bn: bool = False  # BatchNormalization statistics all-reduced across ranks

    def validate(self) -> None:
        if self.world_size < 1:
            raise TranspileError(f"--gpus must be at least 1 (got {self.world_size})")
        if self.strategy not in STRATEGIES:
            raise TranspileError(f"--strategy '{self.strategy}' is not one of: {', '.join(STRATEGIES)}")
        if not self.bucket_mb > 0:
            raise TranspileError(f"--bucket-mb must be positive (got {self.bucket_mb})")
        self.optimizer.validate()


@dataclass
class StateEntry:
    input: str
    output: str
    kind: str  # "param" | "optimizer" | "step"
    param: str | None

    def to_json(self) -> dict:
        return {"input": self.input, "output": self.output, "kind": self.kind, "param": self.param}


@dataclass
class RankGraphs:
    rank: int | None  # None: the single-device graphs
    step: ir.Model
    init: ir.Model
    state: list[StateEntry]
    updates: list[str]  # parameters whose optimizer update runs here


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
    fwd_bwd: onnx.ModelProto | None = None


def _nbytes(value: ir.Value) -> int:
    return int(np.prod(value.shape.numpy(), dtype=np.int64)) * value.dtype.bitwidth // 8


class AutodiffPass(InPlacePass):
    """Append the backward; the gradients of the trainable parameters become graph outputs."""

    def __init__(self, job: Job):
        super().__init__()
        self.job = job

    def call(self, model: ir.Model) -> PassResult:
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
        self.job.fwd_bwd = ir.serde.serialize_model(model)
        return PassResult(model, modified=True)

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
        if job.options.world_size == 1:
            return
        updates = Counter(p for r in job.ranks for p in r.updates)
        expected = 1 if job.options.strategy == "sharded" else job.options.world_size
        wrong = [p for p in job.problem.params if updates[p] != expected]
        if wrong:
            raise PostconditionError(f"parameters updated on the wrong number of ranks: {wrong}")
        for r in job.ranks:
            grads_sent = Counter(
                v.name for n in collective_nodes(r.step.graph) if n.op_type != "Broadcast" for v in n.inputs
            )
            bcast = Counter(
                v.name for n in collective_nodes(r.step.graph) if n.op_type == "Broadcast" for v in n.outputs
            )
            for p in job.problem.params:
                if grads_sent[job.grad_names[p]] != 1:
                    raise PostconditionError(f"rank {r.rank}: gradient of '{p}' is reduced {grads_sent[job.grad_names[p]]} times")
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

    def _owns(self, param: str) -> bool:
        """Does this rank run the parameter's optimizer update (and keep its optimizer state)?"""
        return self.strategy != "sharded" or self.roots[param] == self.rank

    def build(self) -> RankGraphs:
        step, state, updates = self._step_graph()
        init = self._init_graph(state)
        return RankGraphs(self.rank, step, init, state, updates)

    # -- the step graph ------------------------------------------------------------------------

    def _step_graph(self) -> tuple[ir.Model, list[StateEntry], list[str]]:
        job, problem = self.job, self.job.problem
        model = ir.serde.deserialize_model(job.fwd_bwd)
        graph = model.graph
        graph.opset_imports[DOMAIN] = VERSION
        graph.name = "train_step" if self.rank is None else f"rank{self.rank}_step"
        values = {v.name: v for v in graph.outputs}
        loss = values[problem.loss]
        grads = {p: values[job.grad_names[p]] for p in problem.params}

        # Parameters stop being constants: the runtime owns them as state.
        params = {}
        for name in problem.params:
            value = graph.initializers.pop(name)
            value.const_value = None
            graph.inputs.append(value)
            params[name] = value
        lr = ir.val(LR_INPUT, ir.DataType.FLOAT, [])
        graph.inputs.append(lr)
        graph.outputs.clear()
        graph.outputs.append(loss)

        state: list[StateEntry] = []
        outputs: list[ir.Value] = []

        def add_state(value_in: ir.Value, value_out: ir.Value, kind: str, param: str | None) -> None:
            value_out.name = value_in.name + NEXT
            state.append(StateEntry(value_in.name, value_out.name, kind, param))
            outputs.append(value_out)

        step = None
        if self.config.uses_step():
            step_in = ir.val(STEP_STATE, ir.DataType.FLOAT, [])
            graph.inputs.append(step_in)
            step = emit_step_increment(graph, step_in)
            add_state(step_in, step, "step", None)

        updates: list[str] = []

        def update(name: str, grad: ir.Value) -> ir.Value:
            param = params[name]
            slots = {}
            for slot in self.config.slots():
                slots[slot] = ir.val(f"{name}.{slot}", param.dtype, ir.Shape(param.shape))
                graph.inputs.append(slots[slot])
            new_param, new_slots = emit_update(
                graph, self.config, param=param, grad=grad, lr=lr, step=step, state=slots, name=name
            )
            for slot, value in slots.items():
                add_state(value, new_slots[slot], "optimizer", name)
            updates.append(name)
            return new_param

        order = 0
        buckets = job.buckets
        if self.strategy == "local":
            for bucket in buckets:
                for name in bucket.params:
                    add_state(params[name], update(name, grads[name]), "param", name)
        elif self.strategy == "allreduce":
            for bucket in buckets:
                reduced = append_collective(
                    graph, "AllReduce", [grads[p] for p in bucket.params],
                    like=[params[p] for p in bucket.params],
                    output_names=[f"{job.grad_names[p]}.mean" for p in bucket.params],
                    order=order, bucket=bucket.id, phase="step", reduction="mean",
                )
                order += 1
                for name, grad in zip(bucket.params, reduced):
                    add_state(params[name], update(name, grad), "param", name)
        else:
            # Sharded: all Reduces in backward order first (each can start as soon as its bucket's
            # gradients exist), then the Broadcasts of the updated values, in the same bucket order.
            updated: dict[str, ir.Value] = {}
            for bucket in buckets:
                root = bucket.root == self.rank
                reduced = append_collective(
                    graph, "Reduce", [grads[p] for p in bucket.params],
                    like=[params[p] for p in bucket.params],
                    output_names=[f"{job.grad_names[p]}.mean" for p in bucket.params] if root else None,
                    order=order, bucket=bucket.id, phase="step", root=bucket.root, reduction="mean",
                )
                order += 1
                for name, grad in zip(bucket.params, reduced):
                    updated[name] = update(name, grad)
                    updated[name].name = f"{name}.updated"
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
                    state.append(StateEntry(name, value.name, "param", name))
                    outputs.append(value)

        graph.outputs.extend(outputs)
        _remove_unused(graph)
        return model, state, updates

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
        slot_entries: dict[str, list[StateEntry]] = {}
        for entry in state:
            if entry.kind == "optimizer":
                slot_entries.setdefault(entry.param, []).append(entry)

        def initial(entry: StateEntry) -> ir.Value:
            if entry.kind == "param":
                array = source[entry.param].const_value.numpy()
                value = ir.val(f"{entry.input}.init", ir.DataType.from_numpy(array.dtype), array.shape,
                               const_value=ir.tensor(array, name=f"{entry.input}.init"))
                graph.register_initializer(value)
                return value
            like = source[entry.param] if entry.param else None
            shape = list(like.shape.numpy()) if like is not None else []
            dtype = like.dtype if like is not None else ir.DataType.FLOAT
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
            broadcast += [e for e in state if e.kind == "optimizer"]
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
            like = [source[e.param] for e in group]
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
