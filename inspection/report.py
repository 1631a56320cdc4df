"""``transpile inspect OUT``: what the rewrite produced, per rank, read back from OUT.

The report is one JSON-able dict (schema: docs/inspect.md) built from OUT's graphs and plan.json;
the text tables (inspection/render.py), the pictures (inspection/draw.py) and ``--json`` all show
that same dict, so they cannot disagree. The facts about collectives (tensors, bytes, root, bucket,
order) are read from the rank graphs themselves, not copied from the plan, so a test can check the
two against each other. Traffic and cost models: inspection/costs.py.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

from contract.collectives import DOMAIN
from inspection.costs import (
    COLLECTIVE_LATENCY_S,
    COMPUTE_FLOPS_PER_S,
    LINK_BYTES_PER_S,
    NODE_OVERHEAD_S,
    TRAFFIC_MODEL,
    cut_segments,
    graph_collectives,
)
from inspection.diff import diff_report
from inspection.errors import InspectError
from inspection.model import Types, load_model, model_summary, op_name
from inspection.outdir import check_ranks, load_plan

REPORT_FORMAT = "graph-transpiler/inspect"
REPORT_VERSION = 1
DEFAULT_ROWS_PER_RANK = 32


def _rank_report(out: Path, plan: dict, r: int, rows: int, with_segments: bool, load=load_model) -> dict:
    world = plan["world_size"]
    entry = plan["graphs"]["ranks"][r]
    model = load(out / entry["step"])
    step = graph_collectives(model, r, world, plan["collectives"]["step"])
    init_model = load(out / entry["init"])
    init = graph_collectives(init_model, r, world, plan["collectives"]["init"])
    report = {
        "rank": r,
        "step_file": entry["step"],
        "init_file": entry["init"],
        "nodes": len(model.graph.node),
        "ops": dict(Counter(op_name(n) for n in model.graph.node if n.domain != DOMAIN).most_common()),
        "collectives": step,
        "init_collectives": init,
        "sent_bytes_per_step": sum(c["sent_bytes"] for c in step),
        "recv_bytes_per_step": sum(c["recv_bytes"] for c in step),
        "root_of_buckets": sorted({c["bucket"] for c in step if c["is_root"]}),
        "updates": list(entry["updates"]),
        "optimizer_state_bytes": entry["optimizer_state_bytes"],
        "state_bytes": {},
    }
    # Bytes this rank keeps per state kind (param, buffer, optimizer, step), from the graph's types.
    types = Types(model.graph)
    kinds: Counter = Counter()
    for s in entry["state"]:
        kinds[s["kind"]] += types.nbytes(s["input"]) or 0
    report["state_bytes"] = dict(kinds)
    if with_segments:
        report["segments"] = cut_segments(model, r, str(out / entry["step"]), rows)
    return report


def _trainable(plan: dict) -> dict:
    """Every float initializer with its decision and reason (plan's optional "trainable" section); a
    plan written before it names the trained and frozen tensors only, without reasons."""
    section = plan.get("trainable")
    if section is not None:
        return {"recorded": True, "summary": section["summary"], "warnings": list(section["warnings"]),
                "initializers": [{"name": e["name"], "shape": e.get("shape"), "status": e["status"],
                                  "reason": e.get("reason"), "why": e.get("why")} for e in section["initializers"]]}
    entries = [{"name": p["name"], "shape": p["shape"], "status": "trained", "reason": None, "why": None}
               for p in plan["parameters"]]
    entries += [{"name": n, "shape": None, "status": "frozen", "reason": None, "why": "not recorded (older plan)"}
                for n in plan["frozen"]]
    return {"recorded": False, "summary": "", "warnings": [], "initializers": entries}


def build_report(path: Path, ranks: list[int] | None = None, *, rows_per_rank: int = DEFAULT_ROWS_PER_RANK,
                 segments: bool = True, diff: bool = False) -> dict:
    """The whole inspection of OUT (or of a plain model.onnx) as one JSON-able dict."""
    report: dict = {"format": REPORT_FORMAT, "format_version": REPORT_VERSION, "source": str(path)}
    if path.is_file():
        if ranks:
            raise InspectError(f"{path}: --rank needs an OUT directory written by 'transpile', not a model file")
        model = load_model(path)
        report["kind"] = "model"
        report["model"] = model_summary(model, path.name)
        colls = graph_collectives(model, 0, 1, None)
        if colls:
            report["model"]["collectives"] = colls
        return report
    plan = load_plan(path)
    world = plan["world_size"]
    selected = check_ranks(ranks, world)
    report["kind"] = "out"
    # Ranks may share a graph file (docs/contracts.md), and the diff reads the source and the rank
    # graphs again: each file is read once.
    load = functools.lru_cache(maxsize=None)(load_model)
    src = path / plan["source_model"]["file"]
    report["model"] = model_summary(load(src), src.name) if src.is_file() else None
    params = plan["parameters"]
    report["plan"] = {
        "world_size": world, "strategy": plan["strategy"], "optimizer": plan["optimizer"]["name"],
        "max_grad_norm": plan["optimizer"].get("max_grad_norm"),
        "grad_accumulation": plan.get("grad_accumulation", 1),
        "loss": plan["loss"], "lr_input": plan["lr_input"], "bucket_mb": plan.get("bucket_mb"),
        "first_bucket_mb": plan.get("first_bucket_mb"),
        "parameters": len(params), "parameter_bytes": sum(p["bytes"] for p in params),
        "frozen": list(plan["frozen"]),
    }
    report["trainable"] = _trainable(plan)
    place = plan["placement"]
    methods = {place["method"]: place, **place.get("other_methods", {})}
    report["placement"] = {
        "method": place["method"],
        "methods": {m: {"bytes_per_rank": info["bytes_per_rank"], "params_per_rank": info.get("params_per_rank"),
                        "imbalance": info["imbalance"]} for m, info in methods.items()},
        "parameters": [{"name": p["name"], "shape": p["shape"], "dtype": p["dtype"], "bytes": p["bytes"],
                        "root": p["root"], "bucket": p["bucket"]} for p in params],
    }
    report["buckets"] = [{"id": b["id"], "root": b["root"], "bytes": b["bytes"], "params": b["params"]}
                         for b in plan["buckets"]]
    report["traffic_model"] = {
        "name": TRAFFIC_MODEL,
        "AllReduce": "every rank sends and receives 2(N-1)/N * B",
        "Reduce": "chain root+1 -> ... -> root: every rank but the root sends B, every rank but root+1 receives B",
        "Broadcast": "chain root -> ... -> root-1: every rank but root-1 sends B, every rank but the root receives B",
    }
    report["cost_model"] = {
        "source": "estimate", "rows_per_rank": rows_per_rank, "compute_flops_per_s": COMPUTE_FLOPS_PER_S,
        "node_overhead_s": NODE_OVERHEAD_S, "link_bytes_per_s": LINK_BYTES_PER_S,
        "collective_latency_s": COLLECTIVE_LATENCY_S,
    }
    report["ranks"] = [_rank_report(path, plan, r, rows_per_rank, segments, load) for r in selected]
    if diff:
        report["diff"] = diff_report(path, plan, selected, load)
    return report
