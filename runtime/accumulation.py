"""Gradient accumulation as a run option (``transpile run --grad-accumulation K``, HF Trainer's
``gradient_accumulation_steps``): the graphs for K micro-batches per optimizer step, derived here
from a step graph transpiled without accumulation.

The transpiler writes the same two graphs itself for ``transpile --grad-accumulation K``
(transpiler/rank_step.py, rank_graphs.py). At run time they are derived from the step graph and
plan.json's ``gradients`` (each trained parameter's local gradient in the step graph, as the
backward gives it):

- the **accumulate graph** (micro-batches 1..K-1): the step graph cut down to what the loss, the
  gradients and the buffers' next values need (the forward and backward; no gradient collective,
  no update; a ``--sync-bn`` forward keeps its statistics AllReduce), with one float32
  accumulator input per gradient and its output ``accumulator + gradient``;
- the **accumulated step graph** (the last micro-batch): the step graph with, right after the node
  that computes each gradient, ``(accumulator + gradient) * (1/K)`` in float32 read in its place,
  so the collectives keep their order and the mean goes where the gradient went. A gradient the
  step graph holds in another dtype (the backward's own bf16/fp16 value sent by --grad-dtype) is
  cast to float32 first and the mean cast back, as the transpiler's graphs do.

The Trainer runs them as it runs the transpiler's (runtime/trainer.py): the accumulators are zeros
before a step's first micro-batch and are not state (checkpoints do not hold them). The default
path (K = 1) reads nothing of this: its step graph is the file as written.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import helper, numpy_helper

from contract.collectives import consumed
from contract.names import ACC, NEXT
from contract.plan import Accumulator, GraphFiles, Plan
from runtime.collectives import COLLECTIVE_DOMAIN
from runtime.errors import RunError
from runtime.graph_names import FreshNames

FLOAT = onnx.TensorProto.FLOAT


def micro_batches(plan: Plan, given: int | None) -> int:
    """Micro-batches per optimizer step for a run of ``plan``: ``given`` (--grad-accumulation, None
    where not given), else the K the plan was transpiled with. A plan transpiled with K > 1 runs
    that K only (its graphs hold it): another one is refused in one line."""
    transpiled = plan.grad_accumulation
    if given is None:
        return transpiled
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise RunError(f"--grad-accumulation must be an integer >= 1, got {given!r}")
    if transpiled > 1 and given != transpiled:
        raise RunError(f"--grad-accumulation {given}: {plan.out_dir} was transpiled with --grad-accumulation "
                       f"{transpiled}, which its graphs do; give {transpiled} or leave the option out (to choose K "
                       "at run time, transpile without --grad-accumulation)")
    if given > 1 and plan.sparse_gradients:
        raise RunError(f"--grad-accumulation {given}: {plan.path} sends the gradients of "
                       f"{', '.join(plan.sparse_gradients[:3])} as rows (--sparse-grads), which micro-batches cannot "
                       "add up at run time; transpile without --sparse-grads to accumulate")
    if given > 1 and transpiled == 1 and not plan.single.gradients:
        raise RunError(f"--grad-accumulation {given}: {plan.path} does not name the step graphs' gradients (written "
                       "by an older transpiler); transpile the model again, or with --grad-accumulation "
                       f"{given}")
    return given


def accumulation_graphs(step: onnx.ModelProto, plan: Plan, files: GraphFiles, k: int
                        ) -> tuple[onnx.ModelProto, onnx.ModelProto, tuple[Accumulator, ...]]:
    """(accumulated step graph, accumulate graph, their accumulators) for ``k`` micro-batches,
    from ``step`` (the file ``files.step``, transpiled without accumulation; not modified)."""
    where = files.step.name
    graph = step.graph
    shapes = {p.name: tuple(int(d) for d in p.shape) for p in plan.parameters}
    types = _types(step)
    if any(g.value not in types for g in files.gradients):
        try:  # a writer that left a gradient's type out: inferred (the graph itself is not changed)
            types.update(_types(onnx.shape_inference.infer_shapes(step, strict_mode=False)))
        except Exception:  # noqa: BLE001 - e.g. a model over 2 GB: float32 is then assumed
            pass
    names = FreshNames(step.graph)
    produced_at = {out: i for i, node in enumerate(graph.node) for out in node.output}
    known = set(produced_at) | {v.name for v in graph.input} | {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    captured = {name for node in graph.node if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                                   for a in node.attribute)
                for name in consumed(node)[len([n for n in node.input if n]):]}
    wraps = []
    for g in files.gradients:
        if g.value not in known:
            raise RunError(f"{where}: plan.json names '{g.value}' the gradient of '{g.param}', which the graph does "
                           "not compute")
        if g.value in outputs or g.value in captured:
            raise RunError(f"{where}: gradient '{g.value}' is a graph output or read inside a subgraph; "
                           "--grad-accumulation cannot wrap it at run time (transpile with --grad-accumulation K)")
        if g.param not in shapes:
            raise RunError(f"{where}: plan.json names a gradient of '{g.param}', which is not in its parameters")
        dtype = types.get(g.value, FLOAT)
        acc = names.fresh(g.value + ACC)
        wraps.append((g, dtype, acc, names.fresh(acc + NEXT)))
    accumulators = tuple(Accumulator(acc, acc_next, g.param, shapes[g.param], "float32")
                         for g, _, acc, acc_next in wraps)
    inverse = names.fresh("grad_accum.inverse_k")
    return (_step_graph(step, wraps, shapes, produced_at, inverse, k, names),
            _accumulate_graph(step, wraps, shapes, produced_at, plan, files, names),
            accumulators)


def _step_graph(step, wraps, shapes, produced_at, inverse: str, k: int, names) -> onnx.ModelProto:
    """The last micro-batch's step graph: each gradient replaced by (accumulator + gradient) / K."""
    model = copy.deepcopy(step)
    graph = model.graph
    after: dict[int, list[onnx.NodeProto]] = {}  # node index -> nodes inserted after it (-1: first)
    renamed = {}
    for g, dtype, acc, _ in wraps:
        shape = list(shapes[g.param])
        total, mean = names.fresh(g.value + ".sum"), names.fresh(g.value + ".mean_of_micro_batches")
        nodes = _accumulate(graph, g, dtype, acc, total, shape, names)
        nodes.append(helper.make_node("Mul", [total, inverse], [mean], name=names.fresh(f"grad_accum/{g.param}/mean")))
        infos = [(total, FLOAT), (mean, FLOAT)]
        if dtype != FLOAT:
            low = names.fresh(g.value + ".mean_of_micro_batches.sent")
            nodes.append(helper.make_node("Cast", [mean], [low], to=dtype, name=names.fresh(f"grad_accum/{g.param}/sent")))
            infos.append((low, dtype))
            mean = low
        graph.value_info.extend(helper.make_tensor_value_info(n, t, shape) for n, t in infos)
        after.setdefault(produced_at.get(g.value, -1), []).extend(nodes)
        renamed[g.value] = mean
    inserted = {id(n) for nodes in after.values() for n in nodes}
    ordered = _with_inserted(graph, after)
    for node in ordered:
        if id(node) in inserted:
            continue
        for j, name in enumerate(node.input):
            if name in renamed:
                node.input[j] = renamed[name]
    del graph.node[:]
    graph.node.extend(ordered)
    graph.initializer.append(numpy_helper.from_array(np.array(1.0 / k, dtype=np.float32), inverse))
    return model


def _accumulate(graph: onnx.GraphProto, g, dtype: int, acc: str, out: str, shape: list[int], names) -> list[onnx.NodeProto]:
    """``out = acc + gradient`` in float32 (a --grad-dtype gradient widened first), with the
    accumulator declared as a graph input: the nodes both derived graphs insert after the gradient."""
    value, nodes = g.value, []
    if dtype != FLOAT:
        value = names.fresh(g.value + ".fp32")
        nodes.append(helper.make_node("Cast", [g.value], [value], to=FLOAT, name=names.fresh(f"grad_accum/{g.param}/fp32")))
        graph.value_info.append(helper.make_tensor_value_info(value, FLOAT, shape))
    nodes.append(helper.make_node("Add", [acc, value], [out], name=names.fresh(f"grad_accum/{g.param}/add")))
    graph.input.append(helper.make_tensor_value_info(acc, FLOAT, shape))
    return nodes


def _with_inserted(graph: onnx.GraphProto, after: dict[int, list[onnx.NodeProto]]) -> list[onnx.NodeProto]:
    """The graph's nodes with ``after[i]`` right after node i (``after[-1]`` first): a topological
    order, each inserted node following the node that computes its gradient."""
    ordered = list(after.get(-1, []))
    for i, node in enumerate(graph.node):
        ordered.append(node)
        ordered.extend(after.get(i, []))
    return ordered


def _accumulate_graph(step, wraps, shapes, produced_at, plan: Plan, files: GraphFiles, names) -> onnx.ModelProto:
    """Micro-batches 1..K-1: the loss, each accumulator + gradient, the buffers' next values; the
    rest of the step graph (collectives of the gradients, the update) cut away."""
    model = copy.deepcopy(step)
    graph = model.graph
    graph.name = graph.name + "_accum"
    after: dict[int, list[onnx.NodeProto]] = {}
    outputs = [plan.loss]
    for g, dtype, acc, acc_next in wraps:
        nodes = _accumulate(graph, g, dtype, acc, acc_next, list(shapes[g.param]), names)
        after.setdefault(produced_at.get(g.value, -1), []).extend(nodes)
        outputs.append(acc_next)
    outputs += [s.output for s in files.state if s.kind == "buffer"]
    ordered = _with_inserted(graph, after)
    types = {o.name: o for o in graph.output}
    acc_types = {acc_next: helper.make_tensor_value_info(acc_next, FLOAT, list(shapes[g.param]))
                 for g, _, _, acc_next in wraps}
    missing = [name for name in outputs if name not in types and name not in acc_types]
    if missing:
        raise RunError(f"{files.step.name}: graph outputs lack {', '.join(missing)} (named in plan.json)")
    del graph.output[:]
    graph.output.extend(acc_types.get(name) or types[name] for name in outputs)
    # Keep what the outputs need, in graph order (a topological order).
    needed = set(outputs)
    kept = []
    for node in reversed(ordered):
        if any(out in needed for out in node.output):
            kept.append(node)
            needed.update(consumed(node))
    kept.reverse()
    # The collectives left (a --sync-bn forward's) are numbered 0..m-1 in their order.
    collectives = sorted((n for n in kept if n.domain == COLLECTIVE_DOMAIN), key=_order)
    for number, node in enumerate(collectives):
        next(a for a in node.attribute if a.name == "order").i = number
    del graph.node[:]
    graph.node.extend(kept)
    present = {out for node in kept for out in node.output}
    _keep(graph.input, needed)
    _keep(graph.initializer, needed)
    _keep(graph.value_info, present)
    return model


def _keep(entries, names: set[str]) -> None:
    """Of a graph's repeated field (inputs, initializers, value_info), the entries named in ``names``."""
    kept = [e for e in entries if e.name in names]
    del entries[:]
    entries.extend(kept)


def _order(node: onnx.NodeProto) -> int:
    return next(a.i for a in node.attribute if a.name == "order")


def _types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of each top-level value the graph declares (value_info, inputs, outputs,
    initializers); the transpiler writes them for every value (shape inference before the check)."""
    graph = model.graph
    types = {t.name: t.data_type for t in graph.initializer}
    for vi in [*graph.value_info, *graph.input, *graph.output]:
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    return types
