"""``transpile inspect OUT``: what the rewrite produced, per rank, read back from OUT.

The report is one JSON-able dict (schema: docs/inspect.md) built from OUT's graphs and plan.json;
the text tables (transpiler/inspect_render.py), the pictures (transpiler/inspect_draw.py) and
``--json`` all show that same dict, so they cannot disagree. The facts about collectives (tensors,
bytes, root, bucket, order) are read from the rank graphs themselves, not copied from the plan, so a
test can check the two against each other.

Traffic model (bytes each rank sends and receives per step; docs/inspect.md): the bandwidth-optimal
ring algorithms NCCL uses. With N ranks and a bucket of B bytes:

- AllReduce (ring: reduce-scatter then all-gather): every rank sends and receives 2(N-1)/N * B.
- Reduce (pipelined chain root+1 -> root+2 -> ... -> root): every rank but the root sends B; every
  rank but the chain's head (root+1) receives B.
- Broadcast (pipelined chain root -> root+1 -> ... -> root-1): every rank but the chain's tail
  (root-1) sends B; every rank but the root receives B.
- N = 1: nothing moves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

import onnx
from onnx import helper

from transpiler.collectives import DOMAIN
from transpiler.errors import TranspileError
from transpiler.plan import FORMAT, FORMAT_VERSION

REPORT_FORMAT = "graph-transpiler/inspect"
REPORT_VERSION = 1
TRAFFIC_MODEL = "ring"
# Cost model of the schedule (no measured times on CPU): nominal device and link speeds. They only
# set the relative lengths of the boxes in the timeline; --timings replaces them with measurements.
COMPUTE_FLOPS_PER_S = 1e12
NODE_OVERHEAD_S = 5e-6
LINK_BYTES_PER_S = 10e9
COLLECTIVE_LATENCY_S = 10e-6
DEFAULT_ROWS_PER_RANK = 32


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# ---------------------------------------------------------------- loading


def load_plan(out: Path) -> dict:
    path = out / "plan.json"
    if not out.is_dir():
        raise TranspileError(f"{out}: not a directory written by 'transpile' (no such directory)")
    if not path.is_file():
        raise TranspileError(f"{out}: no plan.json here; is it the -o directory of 'transpile'?")
    try:
        plan = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TranspileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(plan, dict) or plan.get("format") != FORMAT:
        found = plan.get("format") if isinstance(plan, dict) else type(plan).__name__
        raise TranspileError(f"{path}: not a graph-transpiler plan (format {found!r})")
    _check_plan_fields(plan, path)
    return plan


# What inspect and view read from plan.json, with the JSON types it must have.
_PLAN_FIELDS = {"format_version": int, "world_size": int, "strategy": str, "optimizer": dict, "loss": str,
                "lr_input": str, "parameters": list, "frozen": list, "placement": dict, "buckets": list,
                "graphs": dict, "collectives": dict, "source_model": dict}


def _check_plan_fields(plan: dict, path: Path) -> None:
    """One-line errors for a damaged or hand-edited plan.json, before anything indexes into it."""
    for key, kind in _PLAN_FIELDS.items():
        if key not in plan:
            raise TranspileError(f"{path}: field '{key}' is missing")
        if type(plan[key]) is not kind:
            raise TranspileError(f"{path}: field '{key}' is {type(plan[key]).__name__}, expected {kind.__name__}")
    if plan["format_version"] != FORMAT_VERSION:
        raise TranspileError(f"{path}: format_version {plan['format_version']} is not supported (this version reads "
                             f"{FORMAT_VERSION}); transpile the model again")
    ranks = plan["graphs"].get("ranks")
    if not isinstance(ranks, list) or plan["world_size"] < 1 or len(ranks) != plan["world_size"]:
        count = len(ranks) if isinstance(ranks, list) else "no"
        raise TranspileError(f"{path}: world_size {plan['world_size']} but {count} rank graph entries")


def load_model(path: Path) -> onnx.ModelProto:
    """An ONNX model with inferred types (for byte counts); a clear one-line error otherwise."""
    if not path.is_file():
        raise TranspileError(f"{path}: no such file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # DecodeError, OSError, ...: the message is protobuf's, often multi-line
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TranspileError(f"{path}: not an ONNX model ({first})") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise TranspileError(f"{path}: not an ONNX model (no graph in it)")
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        return model


def _type_of(t: onnx.TypeProto, rows: int | None) -> tuple[str, list]:
    if t.WhichOneof("value") != "tensor_type":
        return (t.WhichOneof("value") or "?", [])
    tt = t.tensor_type
    dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type).name if tt.elem_type else "?"
    shape: list = []
    if tt.HasField("shape"):
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                shape.append(d.dim_value)
            elif rows is not None:
                shape.append(rows)
            else:
                shape.append(d.dim_param or "?")
    return dtype, shape


class Types:
    """dtype and shape of every value of a graph whose type is known (inputs, outputs, value_info,
    initializers); symbolic dims become ``rows`` when given (for cost estimates)."""

    def __init__(self, graph: onnx.GraphProto, rows: int | None = None):
        self.info: dict[str, tuple[str, list]] = {}
        for t in graph.initializer:
            self.info[t.name] = (helper.tensor_dtype_to_np_dtype(t.data_type).name, list(t.dims))
        for vi in [*graph.value_info, *graph.input, *graph.output]:
            if vi.type.WhichOneof("value") is not None:
                self.info[vi.name] = _type_of(vi.type, rows)

    def shape(self, name: str) -> list | None:
        return self.info.get(name, (None, None))[1]

    def numel(self, name: str) -> int | None:
        shape = self.shape(name)
        if shape is None or any(not isinstance(d, int) for d in shape):
            return None
        n = 1
        for d in shape:
            n *= d
        return n

    def nbytes(self, name: str) -> int | None:
        n = self.numel(name)
        dtype = self.info.get(name, ("?",))[0]
        try:
            import numpy as np

            return None if n is None else n * np.dtype(dtype).itemsize
        except TypeError:
            return None


def model_summary(model: onnx.ModelProto, file: str) -> dict:
    graph = model.graph
    types = Types(graph)
    inits = {t.name for t in graph.initializer}
    n_elems = sum(types.numel(t.name) or 0 for t in graph.initializer)
    n_bytes = sum(types.nbytes(t.name) or 0 for t in graph.initializer)

    def io(vi):
        dtype, shape = _type_of(vi.type, None)
        return {"name": vi.name, "dtype": dtype, "shape": shape}

    ops = Counter(_op_name(n) for n in graph.node)
    return {
        "file": file,
        "opset": next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None),
        "inputs": [io(vi) for vi in graph.input if vi.name not in inits],
        "outputs": [io(vi) for vi in graph.output],
        "initializers": {"count": len(graph.initializer), "elements": n_elems, "bytes": n_bytes},
        "nodes": len(graph.node),
        "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def _op_name(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


# ---------------------------------------------------------------- collectives and traffic


def traffic(op: str, nbytes: int, root: int | None, rank: int, world: int) -> tuple[int, int]:
    """(sent, received) bytes of ``rank`` for one collective under the ring model (module docstring)."""
    if world <= 1:
        return 0, 0
    if op == "AllReduce":
        v = 2 * (world - 1) * nbytes // world
        return v, v
    if op == "Reduce":
        head = (root + 1) % world
        return (0 if rank == root else nbytes), (0 if rank == head else nbytes)
    if op == "Broadcast":
        tail = (root - 1) % world
        return (0 if rank == tail else nbytes), (0 if rank == root else nbytes)
    # ReduceScatter / AllGather (zero strategy, docs/contracts.md): ring, (N-1)/N of the full buffer.
    v = (world - 1) * nbytes // world
    return v, v


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            value = helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default


def graph_collectives(model: onnx.ModelProto, rank: int, world: int, plan_seq: list[dict] | None) -> list[dict]:
    """The collective nodes of a rank graph in execution order, with what this rank moves."""
    types = Types(model.graph)
    nodes = sorted((n for n in model.graph.node if n.domain == DOMAIN), key=lambda n: _attr(n, "order", 0))
    out = []
    for node in nodes:
        order = _attr(node, "order")
        root = _attr(node, "root")
        # The tensors moved are the same on every rank; a rank holds one side of the wire
        # (a non-root Reduce has no outputs, a non-root Broadcast no inputs).
        names = list(node.output) if node.output else list(node.input)
        if node.op_type == "ReduceScatter":  # the full bucket goes in, a 1/N slice comes out
            names = list(node.input)
        sides = [n for n in names if n]
        params = None
        if plan_seq is not None and order is not None and order < len(plan_seq):
            params = plan_seq[order]["params"]
        tensors = []
        for i, name in enumerate(sides):
            dtype, shape = types.info.get(name, ("?", None))
            tensors.append({"name": name, "param": params[i] if params and i < len(params) else None,
                            "dtype": dtype, "shape": shape, "bytes": types.nbytes(name)})
        nbytes = sum(t["bytes"] or 0 for t in tensors)
        sent, recv = traffic(node.op_type, nbytes, root, rank, world)
        out.append({
            "order": order, "op": node.op_type, "name": node.name, "phase": _attr(node, "phase"),
            "bucket": _attr(node, "bucket"), "root": root, "reduction": _attr(node, "reduction"),
            "is_root": root == rank if root is not None else None,
            "inputs": [n for n in node.input if n], "outputs": [n for n in node.output if n],
            "tensors": tensors, "bytes": nbytes, "sent_bytes": sent, "recv_bytes": recv,
        })
    return out


# ---------------------------------------------------------------- segments and costs


def node_flops(node: onnx.NodeProto, types: Types) -> int:
    """A rough FLOP count: 2*M*N*K for MatMul/Gemm/Conv, one per output element otherwise."""
    if node.op_type in ("Constant", "Shape", "Size", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"):
        return 0
    out = sum(types.numel(o) or 0 for o in node.output if o)
    if node.op_type == "MatMul" and node.input:
        a = types.shape(node.input[0])
        k = a[-1] if a and isinstance(a[-1], int) else 1
        return 2 * out * k
    if node.op_type == "Gemm" and node.input:
        a = types.shape(node.input[0])
        trans_a = _attr(node, "transA", 0)
        k = a[0 if trans_a else -1] if a and len(a) == 2 and isinstance(a[0 if trans_a else -1], int) else 1
        return 2 * out * k
    if node.op_type in ("Conv", "ConvTranspose") and len(node.input) > 1:
        w = types.shape(node.input[1]) or []
        k = 1
        for d in w[1:]:
            k *= d if isinstance(d, int) else 1
        return 2 * out * k
    return out


def compute_seconds(flops: int, n_nodes: int) -> float:
    return flops / COMPUTE_FLOPS_PER_S + n_nodes * NODE_OVERHEAD_S


def collective_seconds(sent: int, recv: int) -> float:
    return COLLECTIVE_LATENCY_S + max(sent, recv) / LINK_BYTES_PER_S


def cut_segments(model: onnx.ModelProto, rank: int, where: str, rows: int) -> list[dict]:
    """The runtime's ALAP cut of a rank graph (runtime.segments.cut_graph) as plain dicts: per segment
    its nodes (by first output name), op counts, an estimated cost, and the collective after it."""
    # Imported here, not at module level: runtime/ is a sibling package, and only this function needs
    # it. runtime.segments imports onnx, numpy and networkx, never onnxruntime.
    from runtime.errors import RunError
    from runtime.segments import Segment, cut_graph

    try:
        cut = cut_graph(model, rank, where)
    except RunError as exc:
        raise TranspileError(str(exc)) from None
    types = Types(model.graph, rows)
    k_count = len(cut.collectives)
    out = []
    for item in cut.items:
        if not isinstance(item, Segment):
            continue
        nodes = list(item.model.graph.node)
        flops = sum(node_flops(n, types) for n in nodes)
        out.append({
            "index": item.index,
            "nodes": len(nodes),
            "node_keys": [n.output[0] for n in nodes if n.output],
            "ops": dict(Counter(_op_name(n) for n in nodes).most_common()),
            "flops": flops,
            "est_seconds": compute_seconds(flops, len(nodes)),
            "inputs": list(item.inputs),
            "outputs": list(item.outputs),
            "followed_by": item.index if item.index < k_count else None,
        })
    return out


# ---------------------------------------------------------------- the report


def _rank_report(out: Path, plan: dict, r: int, rows: int, with_segments: bool) -> dict:
    world = plan["world_size"]
    entry = plan["graphs"]["ranks"][r]
    model = load_model(out / entry["step"])
    step = graph_collectives(model, r, world, plan["collectives"]["step"])
    init_model = load_model(out / entry["init"])
    init = graph_collectives(init_model, r, world, plan["collectives"]["init"])
    report = {
        "rank": r,
        "step_file": entry["step"],
        "init_file": entry["init"],
        "nodes": len(model.graph.node),
        "ops": dict(Counter(_op_name(n) for n in model.graph.node if n.domain != DOMAIN).most_common()),
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


def _check_ranks(ranks: list[int] | None, world: int) -> list[int]:
    if ranks is None:
        return list(range(world))
    for r in ranks:
        if not 0 <= r < world:
            raise TranspileError(f"--rank {r} is out of range: the plan has ranks 0..{world - 1}")
    return list(dict.fromkeys(ranks))


def build_report(path: Path, ranks: list[int] | None = None, *, rows_per_rank: int = DEFAULT_ROWS_PER_RANK,
                 segments: bool = True, diff: bool = False) -> dict:
    """The whole inspection of OUT (or of a plain model.onnx) as one JSON-able dict."""
    report: dict = {"format": REPORT_FORMAT, "format_version": REPORT_VERSION, "source": str(path)}
    if path.is_file():
        if ranks:
            raise TranspileError(f"{path}: --rank needs an OUT directory written by 'transpile', not a model file")
        model = load_model(path)
        report["kind"] = "model"
        report["model"] = model_summary(model, path.name)
        colls = graph_collectives(model, 0, 1, None)
        if colls:
            report["model"]["collectives"] = colls
        return report
    plan = load_plan(path)
    world = plan["world_size"]
    selected = _check_ranks(ranks, world)
    report["kind"] = "out"
    src = path / plan["source_model"]["file"]
    report["model"] = model_summary(load_model(src), src.name) if src.is_file() else None
    params = plan["parameters"]
    report["plan"] = {
        "world_size": world, "strategy": plan["strategy"], "optimizer": plan["optimizer"]["name"],
        "max_grad_norm": plan["optimizer"].get("max_grad_norm"),
        "grad_accumulation": plan.get("grad_accumulation", 1),
        "loss": plan["loss"], "lr_input": plan["lr_input"], "bucket_mb": plan.get("bucket_mb"),
        "parameters": len(params), "parameter_bytes": sum(p["bytes"] for p in params),
        "frozen": list(plan["frozen"]),
    }
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
    report["ranks"] = [_rank_report(path, plan, r, rows_per_rank, segments) for r in selected]
    if diff:
        from transpiler.inspect_diff import diff_report

        report["diff"] = diff_report(path, plan, selected)
    return report


# ---------------------------------------------------------------- command line


def _rank_graph(path: Path, rank: int | None) -> tuple[Path, int]:
    """The step graph to draw: OUT's rank graph (rank 0 by default), or the model file itself."""
    if path.is_file():
        if rank:
            raise TranspileError(f"{path}: --rank needs an OUT directory written by 'transpile', not a model file")
        return path, 0
    plan = load_plan(path)
    r = _check_ranks([rank or 0], plan["world_size"])[0]
    return path / plan["graphs"]["ranks"][r]["step"], r


def inspect_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="transpile inspect", description="Show what 'transpile' wrote into OUT "
                                "(or summarize a plain model.onnx). Docs: docs/inspect.md.")
    p.add_argument("out", help="the -o directory of 'transpile', or an .onnx file")
    p.add_argument("--rank", type=int, action="append", help="show only this rank (repeatable)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema: docs/inspect.md)")
    p.add_argument("--diff", action="store_true", help="what the rewrite changed against the user's model, op by op")
    p.add_argument("--svg", metavar="FILE", help="draw a rank's step graph (the first --rank, default 0) with graphviz")
    p.add_argument("--timeline", metavar="FILE", help="draw the step's schedule per rank (PNG, or SVG/PDF by extension)")
    p.add_argument("--collapse", choices=("auto", "on", "off"), default="auto",
                   help="--svg: fold repeated blocks (h.1, h.2, ...) and per-parameter updates (auto: big graphs)")
    p.add_argument("--rows", type=int, default=DEFAULT_ROWS_PER_RANK,
                   help=f"rows per rank assumed by the cost estimates (default {DEFAULT_ROWS_PER_RANK})")
    p.add_argument("--timings", metavar="FILE.json", help="measured seconds per segment/collective for the timeline")
    return p


def inspect_main(argv: list[str]) -> int:
    args = inspect_parser().parse_args(argv)
    path = Path(args.out)
    if not path.exists():
        raise TranspileError(f"{path}: no such file or directory")
    if args.rows < 1:
        raise TranspileError(f"--rows must be positive, got {args.rows}")
    drew = False
    if args.svg:
        from transpiler.inspect_draw import draw_svg

        graph_path, rank = _rank_graph(path, args.rank[0] if args.rank else None)
        plan = load_plan(path) if path.is_dir() else None
        n = draw_svg(graph_path, rank, args.svg, plan=plan, collapse=args.collapse)
        print(f"wrote {args.svg}: {graph_path.name} ({n} boxes)")
        drew = True
    if args.timeline:
        if path.is_file():
            raise TranspileError(f"{path}: --timeline needs an OUT directory written by 'transpile'")
        from transpiler.inspect_draw import draw_timeline, load_timings

        report = build_report(path, args.rank, rows_per_rank=args.rows)
        timings = load_timings(Path(args.timings)) if args.timings else None
        draw_timeline(report, args.timeline, timings=timings)
        print(f"wrote {args.timeline}: schedule of {len(report['ranks'])} rank(s)")
        drew = True
    if drew and not (args.json or args.diff):
        return 0
    report = build_report(path, args.rank, rows_per_rank=args.rows, diff=args.diff)
    try:
        if args.json:
            print(json.dumps(report, indent=1))
            return 0
        from transpiler.inspect_render import render

        render(report, diff_only=args.diff)
        sys.stdout.flush()
    except BrokenPipeError:  # 'transpile inspect OUT | head': the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0

