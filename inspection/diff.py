"""``transpile inspect OUT --diff``: what the rewrite changed against the user's model.

Every node of a rank's step graph falls in exactly one class:

- ``forward``: a node of the user's model, kept (matched by node name, else by op type and first output);
- ``collective``: a node of the ``graph_transpiler`` domain;
- ``backward``: any other node that a parameter gradient depends on (the gradients are the values
  ``grad.<parameter>`` and what the gradient collectives read);
- ``optimizer``: the rest: the update formulas, the step counter, buffer updates.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx

from contract.collectives import DOMAIN
from inspection.model import attr, load_model, op_name

KINDS = ("forward", "backward", "optimizer", "collective")
_GRADIENT_COLLECTIVES = ("Reduce", "AllReduce", "ReduceScatter")


def node_key(node: onnx.NodeProto) -> str:
    """How a node is named across the report: its first output (unique in SSA), else its name."""
    first = next((o for o in node.output if o), None)
    return first if first is not None else node.name


def classify(model: onnx.ModelProto, user: onnx.ModelProto | None, params: list[str]) -> dict[str, str]:
    """Class of every node of ``model`` (a step graph), keyed by ``node_key``."""
    user_names = {n.name for n in user.graph.node if n.name} if user is not None else set()
    user_outputs = {(n.op_type, n.output[0]) for n in user.graph.node if n.output} if user is not None else set()
    nodes = list(model.graph.node)
    kind: dict[str, str] = {}
    for n in nodes:
        if n.domain == DOMAIN:
            kind[node_key(n)] = "collective"
        elif (n.name and n.name in user_names) or (n.output and (n.op_type, n.output[0]) in user_outputs):
            kind[node_key(n)] = "forward"

    producer = {o: n for n in nodes for o in n.output if o}
    grads = {f"grad.{p}" for p in params}
    for n in nodes:
        if n.domain == DOMAIN and n.op_type in _GRADIENT_COLLECTIVES and (attr(n, "phase") or "step") == "step":
            grads.update(i for i in n.input if i)
    stack = [producer[g] for g in grads if g in producer]
    while stack:
        n = stack.pop()
        key = node_key(n)
        if key in kind:
            continue  # forward nodes stop the walk: they are the user's, not the backward's
        kind[key] = "backward"
        stack.extend(producer[i] for i in n.input if i in producer)
    for n in nodes:
        kind.setdefault(node_key(n), "optimizer")
    return kind


def diff_report(out: Path, plan: dict, ranks: list[int], load=load_model) -> dict:
    """``load``: how a graph file is read (the report passes its cache: each file is read once)."""
    user_path = out / plan["source_model"]["file"]
    user = load(user_path) if user_path.is_file() else None
    user_ops = Counter(op_name(n) for n in user.graph.node) if user is not None else Counter()
    params = [p["name"] for p in plan["parameters"]]
    user_inputs = {i.name for i in user.graph.input} if user is not None else set()
    user_inputs |= {t.name for t in user.graph.initializer} if user is not None else set()
    user_outputs = {o.name for o in user.graph.output} if user is not None else set()
    result = {"user_model": plan["source_model"]["file"], "user_ops": dict(user_ops.most_common()),
              "user_nodes": sum(user_ops.values()), "ranks": []}
    for r in ranks:
        entry = plan["graphs"]["ranks"][r]
        model = load(out / entry["step"])
        kind = classify(model, user, params)
        per_op: dict[str, Counter] = {}
        for n in model.graph.node:
            per_op.setdefault(op_name(n), Counter())[kind[node_key(n)]] += 1
        kept = Counter()
        for op, c in per_op.items():
            kept[op] = c["forward"]
        table = []
        for op in sorted(set(per_op) | set(user_ops), key=lambda o: (-sum(per_op.get(o, Counter()).values()), o)):
            c = per_op.get(op, Counter())
            table.append({"op": op, "user": user_ops.get(op, 0), **{k: c[k] for k in KINDS},
                          "removed": max(0, user_ops.get(op, 0) - c["forward"])})
        totals = Counter(kind.values())
        result["ranks"].append({
            "rank": r,
            "file": entry["step"],
            "nodes": len(model.graph.node),
            "totals": {k: totals[k] for k in KINDS},
            "forward_removed": sum(row["removed"] for row in table),
            "ops": table,
            "inputs_added": [i.name for i in model.graph.input if i.name not in user_inputs],
            "initializers_now_inputs": [i.name for i in model.graph.input
                                        if user is not None and i.name in {t.name for t in user.graph.initializer}],
            "outputs_added": [o.name for o in model.graph.output if o.name not in user_outputs],
        })
    return result
