"""One rank's step graph: the forward + backward, then the strategy, wrapped once by gradient
accumulation (before it) and clipping (between its reduction and its update).

    step graph = forward/backward
                 -> mean of the micro-batches' gradients       (--grad-accumulation K > 1)
                 -> cast to the bucket dtype                   (--grad-dtype bf16|fp16, N > 1)
                 -> strategy.reduce, per bucket                (gradient collectives)
                 -> back to float32                            (--grad-dtype)
                 -> unscale, finite check                      (--precision fp16: loss scaling)
                 -> clip the gradients this rank holds         (--clip-grad-norm)
                 -> strategy.update, strategy.publish          (via transpiler.update; skipped
                                                                where a gradient is not finite)
                 -> the loss scale's update                    (--precision fp16)
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from transpiler.collectives import DOMAIN, VERSION, append_collective
from transpiler.graph_utils import number_collectives, remove_unused
from transpiler.job import (
    DTYPES,
    GROWTH_TRACKER_STATE,
    LOSS_SCALE_CURRENT,
    LOSS_SCALE_KIND,
    LOSS_SCALE_STATE,
    SKIPPED_OUTPUT,
    Job,
    StateEntry,
    reduced_gradient_name,
)
from transpiler.names import ACC, AFTER_GRADIENTS, GRAD_NORM_OUTPUT, LR_INPUT, NEXT, STEP_STATE
from transpiler.optimizer import Emitter, emit_clip, emit_squared_norm, emit_step_increment
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
        # Each local gradient as the backward gives it (plan.json's ``gradients``): the value a runtime
        # wraps to accumulate micro-batches itself. Where --grad-dtype sends the backward's own
        # low-precision value (its float32 cast then goes unused), that value.
        self.gradients: dict[str, ir.Value] = dict(self.grads)
        self.lr = ir.val(LR_INPUT, ir.DataType.FLOAT, [])
        self.step_counter: ir.Value | None = None
        self.state: list[StateEntry] = []
        self.outputs: list[ir.Value] = []
        self.updates: list[str] = []
        # --precision fp16: the bool scalar "every gradient is finite"; the updates keep the old
        # values where it is false (transpiler/update.py). None: no loss scaling.
        self.finite: ir.Value | None = None
        self._order = 0

    def add_state(self, value_in: ir.Value, value_out: ir.Value, kind: str, param: str | None) -> None:
        """``value_out`` (renamed ``value_in`` + NEXT) is the next step's ``value_in``."""
        value_out.name = value_in.name + NEXT
        shape = tuple(int(d) for d in value_in.shape.numpy())
        self.state.append(StateEntry(value_in.name, value_out.name, kind, param, shape, value_in.dtype))
        self.outputs.append(value_out)

    def unless_skipped(self, new: ir.Value, old: ir.Value) -> ir.Value:
        """``new`` where the step applies its update, ``old`` where fp16 loss scaling skips it
        (``self.finite`` false): GradScaler.step's skip. The result takes ``new``'s name, ``new``
        becomes NAME.unchecked."""
        name = new.name
        new.name = f"{name}.unchecked"
        node = ir.node("Where", [self.finite, new, old], name=f"{name}/kept_if_skipped")
        self.graph.append(node)
        kept = node.outputs[0]
        kept.name, kept.dtype, kept.shape = name, new.dtype, ir.Shape(new.shape) if new.shape is not None else None
        return kept

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

    scaling = job.options.loss_scaling
    step_in = None
    if step.config.uses_step():
        step_in = ir.val(STEP_STATE, ir.DataType.FLOAT, [])
        graph.inputs.append(step_in)
        step.step_counter = emit_step_increment(graph, step_in)
        if scaling is None:
            step.add_state(step_in, step.step_counter, "step", None)
        else:  # kept where the step is skipped: added once the finite flag exists
            step.step_counter.name = STEP_STATE + ".incremented"

    # --grad-dtype: the buckets travel in the low dtype where there are collectives (DDP's compress hook).
    wire = DTYPES[job.options.grad_dtype] if step.world > 1 and job.options.grad_dtype != "fp32" else None
    if wire is not None:
        _gradients_in(step, wire)
    held = []
    for bucket in job.buckets:
        # A table sent as rows (--sparse-grads) keeps float32 rows on the wire: its rows are few.
        rows = step.world > 1 and bucket.params[0] in job.sparse
        grads = strategy.reduce_rows(step, bucket) if rows else strategy.reduce(step, bucket)
        if grads is not None:
            held.append((bucket, grads if wire is None or rows else _received_as_float(step, grads, wire)))
    if scaling is not None:
        unscaled = iter(_unscale_and_check(step, [g for _, grads in held for g in grads]))
        held = [(bucket, [next(unscaled) for _ in grads]) for bucket, grads in held]
        if step_in is not None:
            step.add_state(step_in, step.unless_skipped(step.step_counter, step_in), "step", None)
    clipped = _clip(step, [grads for _, grads in held])
    if strategy.publish_after_all_updates:
        new_values = {bucket.id: strategy.update(step, bucket, grads) for (bucket, _), grads in zip(held, clipped)}
        for bucket in job.buckets:
            strategy.publish(step, bucket, new_values.get(bucket.id))
    else:
        for (bucket, _), grads in zip(held, clipped):
            strategy.publish(step, bucket, strategy.update(step, bucket, grads))

    if scaling is not None:
        _update_loss_scale(step)
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
    if step.finite is not None:
        # A skipped step (fp16 loss scaling) applies no gradient: it reports 0, not its non-finite
        # norm, which the runtime would stop at (the skip is reported by SKIPPED_OUTPUT).
        zero = Emitter(graph, prefix="grad_norm").constant32(0.0, "skipped")
        squared = Emitter(graph, prefix="grad_norm").op("Where", [step.finite, squared, zero], "if_applied",
                                                         squared.dtype, [])
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


# ---------------------------------------------------------------------------------------------
# Mixed precision (docs/precision.md): the gradient dtype on the wire, fp16's loss scaling


def _gradients_in(step: RankStep, dtype: ir.DataType) -> None:
    """Every gradient the collectives send, in ``dtype``, under the name the strategy's checks know
    (``reduced_gradient_name``; the float32 one becomes NAME.fp32). A float32 gradient that is a
    cast of a ``dtype`` value (the backward's matrix product, cast back by the Cast rule) is sent
    as that value: the round trip is exact."""
    graph = step.graph
    for param, grad in list(step.grads.items()):
        if param in step.job.sparse:  # sent as float32 rows (transpiler/sparse_grads.py)
            continue
        name = reduced_gradient_name(step.job, param)
        producer = grad.producer()
        source = producer.inputs[0] if producer is not None and producer.op_type == "Cast" else None
        grad.name = name + ".fp32"
        if source is not None and source.dtype == dtype:
            low = source
            if step.gradients.get(param) is grad:  # the float32 cast goes unused: name the value sent
                step.gradients[param] = source
        else:
            node = ir.node("Cast", [grad], {"to": dtype}, name=f"grad_dtype/{param}")
            low = node.outputs[0]
            low.dtype, low.shape = dtype, ir.Shape(grad.shape) if grad.shape is not None else None
            if producer is None:
                graph.insert_before(next(iter(graph)), node)
            else:
                graph.insert_after(producer, node)  # where the gradient is: its bucket's order stays
        low.name = name
        step.grads[param] = low


def _received_as_float(step: RankStep, grads: list[ir.Value], dtype: ir.DataType) -> list[ir.Value]:
    """A bucket's reduced gradients (the strategy types its outputs like the parameters: they are
    ``dtype`` here), cast to float32 for the update."""
    emitter = Emitter(step.graph, prefix="grad_dtype")
    out = []
    for grad in grads:
        grad.dtype = dtype
        out.append(emitter.op("Cast", [grad], f"{grad.name}/fp32", ir.DataType.FLOAT, grad.shape,
                              {"to": ir.DataType.FLOAT}, output_name=grad.name + ".fp32"))
    return out


def _named(graph: ir.Graph, name: str) -> ir.Value:
    return next(out for node in graph for out in node.outputs if out.name == name)


def _unscale_and_check(step: RankStep, grads: list[ir.Value]) -> list[ir.Value]:
    """GradScaler.unscale_: the gradients this rank holds times 1/scale, and ``step.finite``: whether
    every gradient of every rank is finite (the ranks that hold parts sum their flags, 0 or NaN,
    with one scalar AllReduce, so every rank decides the same)."""
    graph = step.graph
    e = Emitter(graph, prefix="amp")
    scale = _named(graph, LOSS_SCALE_CURRENT)
    inverse = e.op("Div", [e.constant32(1.0, "one"), scale], "inv_scale", ir.DataType.FLOAT, [])
    zero = e.constant32(0.0, "zero")
    unscaled, flags = [], []
    for i, grad in enumerate(grads):
        value = e.op("Mul", [grad, inverse], f"unscale{i}", grad.dtype, grad.shape, output_name=f"{grad.name}.unscaled")
        unscaled.append(value)
        # 0 where every element is finite, NaN where one is not (inf * 0 and NaN * 0 are NaN).
        zeros = e.op("Mul", [value, zero], f"nonfinite{i}/times_zero", grad.dtype, grad.shape)
        flags.append(e.op("ReduceSum", [zeros], f"nonfinite{i}", ir.DataType.FLOAT, [], {"keepdims": 0}))
    total = flags[0] if len(flags) == 1 else e.op("Sum", flags, "nonfinite", ir.DataType.FLOAT, []) if flags else zero
    if step.strategy.holds_part_of_gradients:
        total = append_collective(graph, "AllReduce", [total], like=[total], output_names=["amp.nonfinite.global"],
                                  order=AFTER_GRADIENTS, bucket=-1, phase="step", reduction="sum")[0]
    step.finite = e.op("Equal", [total, zero], "all_finite", ir.DataType.BOOL, [])
    return unscaled


def _update_loss_scale(step: RankStep) -> None:
    """GradScaler.update (torch's _amp_update_scale_): a skipped step multiplies the scale by the
    backoff factor and zeroes the tracker; a finite one counts, and the growth_interval-th in a
    row multiplies the scale by the growth factor (unless that overflows) and zeroes the tracker.
    The factors apply in float64, rounded to float32 once, as torch's kernel does."""
    graph, scaling = step.graph, step.job.options.loss_scaling
    f32, f64, b = ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.BOOL
    e = Emitter(graph, prefix="amp")
    inputs = {v.name: v for v in graph.inputs}
    scale_in = inputs[LOSS_SCALE_STATE]
    tracker_in = ir.val(GROWTH_TRACKER_STATE, f32, ir.Shape([]))
    graph.inputs.append(tracker_in)
    scale = _named(graph, LOSS_SCALE_CURRENT)

    def times(factor: float, what: str) -> ir.Value:
        wide = e.op("Cast", [scale], f"{what}/f64", f64, [], {"to": f64})
        product = e.op("Mul", [wide, e.constant(factor, f64, f"{what}_factor")], f"{what}/f64_product", f64, [])
        return e.op("Cast", [product], what, f32, [], {"to": f32})

    counted = e.op("Add", [tracker_in, e.constant32(1.0, "one")], "growth_tracker_counted", f32, [])
    reached = e.op("Equal", [counted, e.constant32(float(scaling.growth_interval), "growth_interval")],
                   "growth_interval_reached", b, [])
    grown = times(scaling.growth_factor, "grown")
    grows = e.op("And", [reached, e.op("Not", [e.op("IsInf", [grown], "grown_is_inf", b, [])], "grown_finite", b, [])],
                 "grows", b, [])
    kept = e.op("Where", [grows, grown, scale], "scale_if_finite", f32, [])
    scale_next = e.op("Where", [step.finite, kept, times(scaling.backoff_factor, "backed_off")], "scale_next", f32, [])
    zero = e.constant32(0.0, "zero")
    tracker_kept = e.op("Where", [reached, zero, counted], "tracker_if_finite", f32, [])
    tracker_next = e.op("Where", [step.finite, tracker_kept, zero], "tracker_next", f32, [])
    step.add_state(scale_in, scale_next, LOSS_SCALE_KIND, None)
    step.add_state(tracker_in, tracker_next, LOSS_SCALE_KIND, None)
    skipped = e.op("Cast", [e.op("Not", [step.finite], "skipped_bool", b, [])], "skipped", f32, [],
                   {"to": f32}, output_name=SKIPPED_OUTPUT)
    step.outputs.append(skipped)
