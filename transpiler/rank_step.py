"""One rank's step graph: the forward + backward, then the strategy, wrapped once by gradient
accumulation (before it) and clipping (between its reduction and its update).

    step graph = forward/backward
                 -> mean of the micro-batches' gradients       (--grad-accumulation K > 1)
                 -> strategy.reduce, per bucket                (gradient collectives)
                 -> clip the gradients this rank holds         (--clip-grad-norm)
                 -> strategy.update, strategy.publish          (via transpiler.update)
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from transpiler.collectives import DOMAIN, VERSION, append_collective
from transpiler.graph_utils import number_collectives, remove_unused
from transpiler.job import Job, StateEntry
from transpiler.names import ACC, AFTER_GRADIENTS, GRAD_NORM_OUTPUT, LR_INPUT, NEXT, STEP_STATE
from transpiler.optimizer import emit_clip, emit_squared_norm, emit_step_increment
from transpiler.strategies import Strategy


class RankStep:
    """A rank's step graph while it is built: what the strategy and the wrappers emit into.

    ``params``/``grads``: the parameter inputs and their (local) gradients by parameter name;
    ``state``/``outputs``: the state entries and graph outputs so far; ``updates``: the parameters
    whose optimizer update runs here.
    """

    def __init__(self, job: Job, rank: int | None, strategy: Strategy, model: ir.Model,
                 values: dict[str, ir.Value], params: dict[str, ir.Value]):
        self.job = job
        self.rank = rank
        self.world = 1 if rank is None else job.options.world_size
        self.strategy = strategy
        self.config = job.options.optimizer
        self.model = model
        self.graph = model.graph
        self.values = values
        self.params = params
        self.grads = {p: values[job.grad_names[p]] for p in job.problem.params}
        self.lr = ir.val(LR_INPUT, ir.DataType.FLOAT, [])
        self.step_counter: ir.Value | None = None
        self.state: list[StateEntry] = []
        self.outputs: list[ir.Value] = []
        self.updates: list[str] = []
        self._order = 0

    def add_state(self, value_in: ir.Value, value_out: ir.Value, kind: str, param: str | None) -> None:
        """``value_out`` (renamed ``value_in`` + NEXT) is the next step's ``value_in``."""
        value_out.name = value_in.name + NEXT
        shape = tuple(int(d) for d in value_in.shape.numpy())
        self.state.append(StateEntry(value_in.name, value_out.name, kind, param, shape, value_in.dtype))
        self.outputs.append(value_out)

    def next_order(self) -> int:
        """A provisional collective order (``number_collectives`` gives the final one)."""
        order = self._order
        self._order += 1
        return order


def forward_backward(job: Job, rank: int | None, name: str, protos: dict[str, onnx.ModelProto]
                     ) -> tuple[ir.Model, dict[str, ir.Value], dict[str, ir.Value]]:
    """A fresh copy of the forward + backward for this rank, parameters and buffers turned from
    initializers into inputs (the runtime owns them as state); returns the model, its outputs by
    name, and the parameter inputs by name."""
    model = ir.serde.deserialize_model(protos["single" if rank is None else "ranks"])
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


def accumulator(graph: ir.Graph, param: ir.Value, grad: ir.Value) -> ir.Value:
    acc = ir.val(grad.name + ACC, grad.dtype, ir.Shape(param.shape))
    graph.inputs.append(acc)
    return acc


def build_step(job: Job, rank: int | None, strategy: Strategy, protos: dict[str, onnx.ModelProto]) -> RankStep:
    problem = job.problem
    model, values, params = forward_backward(job, rank, "train_step" if rank is None else "rank_step", protos)
    step = RankStep(job, rank, strategy, model, values, params)
    graph = step.graph
    if job.options.grad_accumulation > 1:
        _mean_of_micro_batches(step)
    graph.inputs.append(step.lr)
    graph.outputs.clear()
    graph.outputs.append(values[problem.loss])

    # Running statistics: every rank updates its own (from its shard, or from the synchronized
    # statistics with --sync-bn).
    inputs = {v.name: v for v in graph.inputs}
    for name in problem.buffers:
        step.add_state(inputs[name], values[name + NEXT], "buffer", name)

    if step.config.uses_step():
        step_in = ir.val(STEP_STATE, ir.DataType.FLOAT, [])
        graph.inputs.append(step_in)
        step.step_counter = emit_step_increment(graph, step_in)
        step.add_state(step_in, step.step_counter, "step", None)

    held = []
    for bucket in job.buckets:
        grads = strategy.reduce(step, bucket)
        if grads is not None:
            held.append((bucket, grads))
    clipped = _clip(step, [grads for _, grads in held])
    if strategy.publish_after_all_updates:
        new_values = {bucket.id: strategy.update(step, bucket, grads) for (bucket, _), grads in zip(held, clipped)}
        for bucket in job.buckets:
            strategy.publish(step, bucket, new_values.get(bucket.id))
    else:
        for (bucket, _), grads in zip(held, clipped):
            strategy.publish(step, bucket, strategy.update(step, bucket, grads))

    graph.outputs.extend(step.outputs)
    remove_unused(graph)
    number_collectives(graph)
    return step


def _clip(step: RankStep, grads: list[list[ir.Value]]) -> list[list[ir.Value]]:
    """--clip-grad-norm: the reduced gradients this rank holds (per bucket), scaled by
    clip_grad_norm_'s coefficient. The global norm needs every gradient: where a rank holds only
    some (``strategy.holds_part_of_gradients``: its buckets, its slices), the squared norms of the
    parts are summed over the ranks by one scalar AllReduce, after the gradient collectives."""
    if step.config.max_grad_norm is None:
        return grads
    graph = step.graph
    squared = emit_squared_norm(graph, [g for bucket_grads in grads for g in bucket_grads])
    if step.strategy.holds_part_of_gradients:
        squared = append_collective(
            graph, "AllReduce", [squared], like=[squared], output_names=["grad_norm.squared.sum"],
            order=AFTER_GRADIENTS, bucket=-1, phase="step", reduction="sum",
        )[0]
    # The global squared norm also leaves the graph (contract GRAD_NORM_OUTPUT): the runtime stops a
    # run at the step where it is not finite, like a non-finite loss.
    norm_out = ir.node("Identity", [squared], num_outputs=1).outputs[0]
    graph.append(norm_out.producer())
    norm_out.name, norm_out.dtype, norm_out.shape = GRAD_NORM_OUTPUT, squared.dtype, squared.shape
    graph.outputs.append(norm_out)
    flat = iter(emit_clip(graph, step.config, squared, [g for bucket_grads in grads for g in bucket_grads]))
    return [[next(flat) for _ in bucket_grads] for bucket_grads in grads]


def _mean_of_micro_batches(step: RankStep) -> None:
    """--grad-accumulation K: each gradient becomes (accumulator + gradient) / K, right after the
    node that computes it, so the gradient collectives keep their backward order."""
    graph, params, grads = step.graph, step.params, step.grads
    k = step.job.options.grad_accumulation
    first = next(iter(graph))
    inverse = ir.node("Constant", [], {"value": ir.tensor(np.array(1.0 / k, dtype=np.float32))}, name="grad_accum/inverse_k")
    inverse.outputs[0].name = "grad_accum.inverse_k"
    inverse.outputs[0].dtype, inverse.outputs[0].shape = ir.DataType.FLOAT, ir.Shape([])
    graph.insert_before(first, inverse)
    for name, grad in list(grads.items()):
        acc = accumulator(graph, params[name], grad)
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
