"""The collective ops of the rank graphs: domain, ops, attributes (docs/contracts.md), and the rule
that cuts a rank graph into compute segments at them.

Data and functions over names and onnx protos only (no onnx-ir, no onnxruntime), so the writer
(transpiler), the executor (runtime) and the reader (inspection) can share it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

DOMAIN = "graph_transpiler"
VERSION = 1
OPS = ("AllReduce", "Reduce", "Broadcast", "ReduceScatter", "AllGather", "AllConcat")
# Ops whose inputs are the bucket's full tensors (the others hold them as outputs).
SENDS_BUCKET = frozenset({"AllReduce", "Reduce", "ReduceScatter"})
PHASES = ("init", "step")
REDUCTIONS = ("sum", "mean")
# Attributes: every op has order, bucket, phase; root on Reduce/Broadcast; reduction on the reducing ops.
ATTRIBUTES = {
    "AllReduce": ("order", "bucket", "phase", "reduction"),
    "Reduce": ("order", "bucket", "phase", "root", "reduction"),
    "Broadcast": ("order", "bucket", "phase", "root"),
    "ReduceScatter": ("order", "bucket", "phase", "reduction"),
    "AllGather": ("order", "bucket", "phase"),
    "AllConcat": ("order", "bucket", "phase"),
}
# Ops whose output's first dimension is N times the input's and may stay symbolic in the graph (the
# rows of a sparse gradient: the per-rank batch is known only when a run starts); every other
# collective output has a complete static type.
SHAPED_BY_INPUT = frozenset({"AllConcat"})
NO_BUCKET = -1  # ``bucket`` of a collective that moves no parameter gradient (init broadcasts, sync-bn, clip norm)


class CutError(ValueError):
    """The collectives' ``order`` attributes contradict the data flow (one line)."""


def place_alap(n_nodes: int, edges: Iterable[tuple[int, int]], orders: Mapping[int, int],
               names: Sequence[str]) -> tuple[dict[int, int], dict[int, int]]:
    """The ALAP cut rule (runtime/segments.py explains it; this is its pure part, used by the
    runtime's cut and by ``inspection/``).

    ``edges`` are (producer, consumer) node indices, ``orders`` the collective nodes' ``order`` by
    node index, ``names`` the nodes' names for errors. Returns, for every compute node, its segment
    ``min(order of the collectives downstream)`` (K if none) and 1 + the order of the latest
    collective upstream (0 if none).
    """
    succ: dict[int, list[int]] = {i: [] for i in range(n_nodes)}
    pred: dict[int, list[int]] = {i: [] for i in range(n_nodes)}
    for a, b in edges:
        succ[a].append(b)
        pred[b].append(a)
    k_count = len(orders)
    latest = {i: k_count for i in range(n_nodes) if i not in orders}
    earliest = dict.fromkeys(latest, 0)
    for c, order in orders.items():
        for a in _reach(c, pred):
            if a in orders:
                if orders[a] >= order:
                    raise CutError(f"collective '{names[c]}' (order {order}) reads the output of collective "
                                   f"'{names[a]}' (order {orders[a]}); orders contradict the data flow")
            else:
                latest[a] = min(latest[a], order)
        for d in _reach(c, succ):
            if d not in orders:
                earliest[d] = max(earliest[d], order + 1)
    for i, k in latest.items():
        if earliest[i] > k:
            raise CutError(f"node '{names[i]}' reads collective order {earliest[i] - 1} but feeds collective "
                           f"order {k}; orders contradict the data flow")
    return latest, earliest


def _reach(start: int, step: Mapping[int, list[int]]) -> set[int]:
    seen: set[int] = set()
    todo = list(step[start])
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo.extend(step[i])
    return seen


def consumed(node: onnx.NodeProto) -> list[str]:
    """Values the node reads, including outer-scope values its subgraphs (If/Loop/Scan bodies)
    capture: the edges of the data flow that ``place_alap`` cuts."""
    names = [name for name in node.input if name]
    for attr in node.attribute:
        subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for sub in subs:
            defined = {i.name for i in sub.input} | {t.name for t in sub.initializer}
            captured: list[str] = []
            for inner in sub.node:
                captured += [name for name in consumed(inner) if name not in defined]
                defined.update(inner.output)
            captured += [o.name for o in sub.output if o.name not in defined]
            names += captured
    return names


# Constant attributes that hold one tensor's value (sparse and string forms stay nodes).
_CONSTANT_FORMS = {"value": lambda a: a.t, "value_float": lambda a: np.array(a.f, np.float32),
                   "value_floats": lambda a: np.array(a.floats, np.float32), "value_int": lambda a: np.array(a.i, np.int64),
                   "value_ints": lambda a: np.array(a.ints, np.int64)}


def constants_as_initializers(graph: onnx.GraphProto) -> None:
    """Turn ``graph``'s Constant nodes into initializers, in place: the first step of the cut
    (runtime/segments.py, and inspect, which must cut alike). A Constant node would live in one
    segment, and its value would reach the other segments that read it as a run-time input: there
    onnxruntime cannot fold it, so e.g. a reduction's axes stop being constant (cuDNN's slow
    reduce-tensor path, and the GPU lowering cannot split it: ResNet-18's backward on 2 GPUs ran 90
    of them under --strategy allreduce). An initializer is copied into every segment that reads it.
    In place because the runtime's graph holds the weights: a copy of it would copy them too."""
    taken = {t.name for t in graph.initializer} | {i.name for i in graph.input}
    kept, found = [], []
    for node in graph.node:
        attr = node.attribute[0] if len(node.attribute) == 1 else None
        if (node.op_type == "Constant" and node.domain in ("", "ai.onnx") and attr is not None
                and attr.name in _CONSTANT_FORMS and node.output[0] not in taken):
            value = _CONSTANT_FORMS[attr.name](attr)
            tensor = onnx.TensorProto()
            tensor.CopyFrom(value if isinstance(value, onnx.TensorProto) else numpy_helper.from_array(value))
            tensor.name = node.output[0]
            found.append(tensor)
        else:
            kept.append(node)
    if found:
        held = onnx.GraphProto()
        held.node.extend(kept)  # copies of the nodes (small), taken before the list is cleared
        del graph.node[:]
        graph.node.extend(held.node)
        graph.initializer.extend(found)
