"""A rank's graphs: the step graph (transpiler/rank_step.py), the init graph, and with
--grad-accumulation the accumulate graph. Rank None: the single-device graphs."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.tape import Tape

from transpiler.collectives import DOMAIN, VERSION, append_collective
from transpiler.errors import TranspileError
from transpiler.graph_utils import number_collectives, register_constant, remove_unused
from transpiler.job import Job, RankGraphs, StateEntry
from transpiler.names import NEXT
from transpiler.rank_step import accumulator, build_step, forward_backward
from transpiler.strategies import Strategy, strategy_for


def build_rank(job: Job, rank: int | None, protos: dict[str, onnx.ModelProto]) -> RankGraphs:
    """``protos``: the forward + backward per variant ("single", "ranks"), copied for each graph."""
    world = 1 if rank is None else job.options.world_size
    strategy = strategy_for(job.options.strategy, world)
    step = build_step(job, rank, strategy, protos)
    init = _init_graph(job, rank, world, strategy, step.state)
    graphs = RankGraphs(rank, step.model, init, step.state, step.updates, gradients=_gradient_names(step))
    if job.options.grad_accumulation > 1:
        graphs.accum, graphs.accumulators = _accum_graph(job, rank, protos)
    return graphs


def _gradient_names(step) -> dict[str, str]:
    """Parameter -> the name of its local gradient in the finished step graph (plan.json's
    ``gradients``), each checked to be computed there."""
    graph = step.graph
    computed = {out.name for node in graph for out in node.outputs} | {v.name for v in graph.inputs} | set(graph.initializers)
    # A table sent as rows (--sparse-grads) has no dense local gradient in the graph: not named.
    names = {param: value.name for param, value in step.gradients.items() if param not in step.job.sparse}
    lost = [f"{p} ({v})" for p, v in names.items() if v not in computed]
    if lost:
        raise TranspileError(f"internal error: the step graph no longer computes the gradient of {', '.join(lost)}")
    return names


def _accum_graph(job: Job, rank: int | None, protos) -> tuple[ir.Model, list[StateEntry]]:
    """The graph of the first K-1 micro-batches: forward and backward, every gradient added to its
    accumulator, buffers (BatchNorm statistics) updated as the step graph updates them. No
    optimizer, no gradient collective (a --sync-bn forward keeps its statistics AllReduce)."""
    problem = job.problem
    model, values, params = forward_backward(job, rank, "train_accum" if rank is None else "rank_accum", protos)
    graph = model.graph
    tape = Tape(graph)
    outputs, accumulators = [values[problem.loss]], []
    for name in problem.params:
        grad = values[job.grad_names[name]]
        acc = accumulator(graph, params[name], grad)
        total = tape.op("Add", [acc, grad])
        total.name, total.dtype, total.shape = acc.name + NEXT, grad.dtype, ir.Shape(params[name].shape)
        outputs.append(total)
        accumulators.append(StateEntry(acc.name, total.name, "accum", name,
                                       tuple(int(d) for d in params[name].shape.numpy()), grad.dtype))
    outputs += [values[b + NEXT] for b in problem.buffers]
    graph.outputs.clear()
    graph.outputs.extend(outputs)
    remove_unused(graph)
    number_collectives(graph)
    return model, accumulators


def _init_graph(job: Job, rank: int | None, world: int, strategy: Strategy, state: list[StateEntry]) -> ir.Model:
    """No inputs; outputs named like the step graph's state inputs, holding their initial values.

    The state the strategy names (``broadcast_at_init``: at least every parameter, whose initial
    value is stored on its root alone, so the rank files together hold each weight once) is
    Broadcast from its parameter's root, one Broadcast per root. The rest starts as zeros on every
    rank (optimizer state, accumulators), equal without a collective.
    """
    problem = job.problem
    roots = strategy.init_roots(job)
    graph = ir.Graph(
        [], [], nodes=[], opset_imports={"": problem.opset, DOMAIN: VERSION},
        name="train_init" if rank is None else "rank_init",  # the same on every rank: ranks may share a file
    )
    source = problem.model.graph.initializers

    def initial(entry: StateEntry) -> ir.Value:
        if entry.kind in ("param", "buffer"):
            tensor = source[entry.param].const_value
            name = f"{entry.input}.init"
            if isinstance(tensor, ir.ExternalTensor):  # a reference to the weight's bytes, not a copy
                tensor = ir.ExternalTensor(tensor.location, tensor.offset, tensor.length, tensor.dtype,
                                           shape=tensor.shape, name=name, base_dir=tensor.base_dir)
            else:
                tensor = ir.tensor(tensor.numpy(), name=name)
            value = ir.val(name, tensor.dtype, tensor.shape, const_value=tensor)
            graph.register_initializer(value)
            return value
        shape, dtype = list(entry.shape), entry.dtype
        zero = ir.tensor(np.zeros((1,), dtype=dtype.numpy()))
        dims = ir.tensor(np.array(shape, dtype=np.int64), name=f"{entry.input}.shape")
        node = ir.node("ConstantOfShape", [register_constant(graph, dims)], {"value": zero},
                       name=f"init/zeros/{entry.input}")
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

    broadcast = strategy.broadcast_at_init(state)
    local = [e for e in state if e not in broadcast]
    order = 0
    for root in range(world):
        group = [e for e in broadcast if roots[e.param] == root]
        if not group:
            continue
        like = [ir.val(e.input, e.dtype, list(e.shape)) for e in group]
        outs = append_collective(
            graph, "Broadcast", [initial(e) for e in group] if root == rank else [],
            like=like, output_names=[e.input for e in group],
            order=order, bucket=-1, phase="init", root=root,
        )
        order += 1
        graph.outputs.extend(outs)
    for entry in local:
        named_output(initial(entry), entry.input)
    return ir.Model(graph, ir_version=problem.model.ir_version)
