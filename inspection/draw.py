"""Pictures for ``transpile inspect``: a rank graph as SVG (graphviz ``dot``) and the step's schedule
per rank as a timeline (matplotlib).

The timeline has no measured times on CPU: segment and collective durations come from the report's
cost model (FLOPs at a nominal rate plus a per-node overhead; bytes over a nominal link plus a
latency), and ``--timings FILE.json`` replaces any of them with measurements (``load_timings``).
The schedule is the one a device runtime with one compute stream and one communication stream per
rank would follow: segments run in order on the compute stream; collective k starts once every rank
has finished segment k and the previous collective has ended (collectives synchronize the ranks);
a segment that reads a collective's output waits for it. The CPU runtime runs the same items one
after the other, without overlap.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

from inspection.costs import collective_seconds, cut_segments, graph_collectives
from inspection.diff import classify, node_key
from inspection.errors import InspectError
from inspection.model import human, load_model

COLORS = {"forward": "#cfe2f3", "backward": "#f4cccc", "optimizer": "#d9ead3", "collective": "#ffd966"}
OP_COLORS = {"Reduce": "#e69138", "Broadcast": "#6aa84f", "AllReduce": "#8e7cc3",
             "ReduceScatter": "#c27ba0", "AllGather": "#45818e"}
# What the colours are called in the pictures' titles and legends: a title names only colours drawn.
COLOR_NAMES = {"#cfe2f3": "light blue", "#f4cccc": "light red", "#d9ead3": "light green", "#ffd966": "yellow",
               "#e69138": "orange", "#6aa84f": "green", "#8e7cc3": "purple", "#c27ba0": "pink", "#45818e": "teal"}
COLLAPSE_AUTO_NODES = 200
# 'blocks.3', 'h.3', 'layers.3' as PyTorch names modules; not 'MatMul_3' (exporters' op suffixes)
_BLOCK = re.compile(r"(?:^|[/.])([A-Za-z_]+)\.(\d+)(?=[/.]|$)")

DOT_MISSING = ("graphviz 'dot' is not installed; install it with 'apt-get install graphviz' (Debian/Ubuntu), "
               "'brew install graphviz' (macOS) or 'conda install graphviz', then run again")


# ---------------------------------------------------------------- SVG


def _block_word(names: list[str]) -> str | None:
    """The name component that numbers repeated blocks ('h' in '/h.3/attn/MatMul'), if any."""
    indices: dict[str, set[str]] = defaultdict(set)
    for name in names:
        for word, idx in _BLOCK.findall(name):
            indices[word].add(idx)
    candidates = [(len(v), w) for w, v in indices.items() if len(v) >= 2]
    return max(candidates)[1] if candidates else None


def _group_label(name: str, block_word: str | None, params: list[str]) -> str | None:
    if block_word:
        m = re.search(rf"(?:^|[/.]){re.escape(block_word)}\.(\d+)(?=[/.]|$)", name)
        if m:
            return f"{block_word}.{m.group(1)}"
    for p in params:
        if name.startswith(p + "."):
            return f"update {p}"
    if name.startswith("optimizer."):
        return "optimizer (shared)"
    # anything else folds by its top-level scope ('/ln_f/Add_3' -> 'ln_f', 'loss/grad/Div' -> 'loss')
    return name.strip("/").split("/")[0].split(".")[0] or None


def _dot_id(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def graph_dot(path: Path, rank: int, plan: dict | None = None, collapse: str = "auto") -> tuple[str, int]:
    """DOT source of a step graph: collectives highlighted, compute segments as clusters; returns
    (source, number of boxes)."""
    model = load_model(path)
    world = plan["world_size"] if plan else 1
    nodes = list(model.graph.node)
    params = sorted((p["name"] for p in plan["parameters"]), key=len, reverse=True) if plan else []
    user = None
    if plan:
        src = path.parent / plan["source_model"]["file"]
        user = load_model(src) if src.is_file() else None
    kinds = classify(model, user, [p for p in params])
    colls = {c["name"]: c for c in graph_collectives(model, rank, world, plan["collectives"]["step"] if plan else None)}
    try:
        segments = cut_segments(model, rank, str(path), 1)
    except InspectError:
        segments = []  # a graph the runtime could not cut is still drawn, without clusters
    seg_of = {key: s["index"] for s in segments for key in s["node_keys"]}
    fold = collapse == "on" or (collapse == "auto" and len(nodes) > COLLAPSE_AUTO_NODES)
    block_word = _block_word([n.name or node_key(n) for n in nodes]) if fold else None

    # box of every node: itself, or a fold (segment, label, class)
    box_of: dict[str, str] = {}
    boxes: dict[str, dict] = {}
    for i, n in enumerate(nodes):
        key = node_key(n)
        kind = kinds[key]
        seg = seg_of.get(key)
        label = _group_label(n.name or key, block_word, params) if fold and kind != "collective" else None
        if label is None:
            box = f"n{i}"
            boxes[box] = {"seg": seg, "kind": kind, "nodes": [n]}
        else:
            box = f"g:{seg}:{label}:{kind}"
            boxes.setdefault(box, {"seg": seg, "kind": kind, "nodes": [], "label": label})["nodes"].append(n)
        box_of[key] = box
    producer_box = {o: box_of[node_key(n)] for n in nodes for o in n.output if o}

    lines = [f"digraph {_dot_id(path.stem)} {{", "  rankdir=TB; newrank=true; compound=true;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [color="#888888", arrowsize=0.6];',
             f'  label="{_esc(path.name)}: {_esc(_color_key(nodes, kinds))}; '
             f'clusters: compute segments{", repeated blocks folded" if fold else ""}"; labelloc=t; fontname="Helvetica";']

    def box_line(box: str, info: dict) -> str:
        if info["kind"] == "collective":
            n = info["nodes"][0]
            c = colls.get(n.name, {})
            root = f" root {c['root']}" if c.get("root") is not None else ""
            red = f" ({c['reduction']})" if c.get("reduction") else ""
            text = (f"#{c.get('order')} {n.op_type}{red}\\nbucket {c.get('bucket')}{root}\\n"
                    f"{human(c.get('bytes', 0))}, {len(c.get('tensors', []))} tensor(s)")
            return (f'  {_dot_id(box)} [label="{text}", shape=box3d, style="filled,bold", penwidth=2.5, '
                    f'fillcolor="{OP_COLORS.get(n.op_type, COLORS["collective"])}", tooltip="{_esc(n.name)}"];')
        if "label" in info:
            ops = Counter(n.op_type for n in info["nodes"]).most_common(3)
            text = f"{info['label']} {info['kind']}\\n{len(info['nodes'])} nodes: " + ", ".join(f"{o} {c}" for o, c in ops)
            return f'  {_dot_id(box)} [label="{_esc(text)}", shape=folder, fillcolor="{COLORS[info["kind"]]}"];'
        n = info["nodes"][0]
        name = n.name or node_key(n)
        short = name if len(name) <= 32 else "..." + name[-29:]
        return (f'  {_dot_id(box)} [label="{_esc(n.op_type)}\\n{_esc(short)}", fillcolor="{COLORS[info["kind"]]}", '
                f'tooltip="{_esc(name)}"];')

    by_seg: dict = defaultdict(list)
    for box, info in boxes.items():
        by_seg[info["seg"] if info["kind"] != "collective" else "coll"].append(box)
    for seg in sorted(k for k in by_seg if isinstance(k, int)):
        after = next((s["followed_by"] for s in segments if s["index"] == seg), None)
        then = f", then collective #{after}" if after is not None else ", end of step"
        lines.append(f"  subgraph cluster_segment{seg} {{")
        lines.append(f'    label="segment {seg}{then}"; style="rounded,dashed"; color="#666666"; fontsize=11;')
        lines += ["  " + box_line(b, boxes[b]) for b in by_seg[seg]]
        lines.append("  }")
    for box in by_seg.get("coll", []) + by_seg.get(None, []):
        lines.append(box_line(box, boxes[box]))
    edges = set()
    for n in nodes:
        dst = box_of[node_key(n)]
        for i in n.input:
            src = producer_box.get(i)
            if src is not None and src != dst:
                edges.add((src, dst))
    lines += [f"  {_dot_id(a)} -> {_dot_id(b)};" for a, b in sorted(edges)]
    lines.append("}")
    return "\n".join(lines) + "\n", len(boxes)


def _color_key(nodes, kinds: dict[str, str]) -> str:
    """'forward (light blue), ..., collectives: Reduce (orange), Broadcast (green)': the kinds and
    collective ops this graph has, in the colours box_line fills them with."""
    present = {kinds[node_key(n)] for n in nodes}
    parts = [f"{kind} ({COLOR_NAMES[COLORS[kind]]})" for kind in ("forward", "backward", "optimizer") if kind in present]
    ops = list(dict.fromkeys(n.op_type for n in nodes if kinds[node_key(n)] == "collective"))
    if ops:
        parts.append("collectives: " + ", ".join(
            f"{op} ({COLOR_NAMES[OP_COLORS.get(op, COLORS['collective'])]})" for op in ops))
    return ", ".join(parts)


def draw_svg(path: Path, rank: int, svg: str, plan: dict | None = None, collapse: str = "auto") -> int:
    dot = shutil.which("dot")
    if dot is None:
        raise InspectError(DOT_MISSING)
    source, n_boxes = graph_dot(path, rank, plan, collapse)
    done = subprocess.run([dot, "-Tsvg", "-o", svg], input=source, text=True, capture_output=True)
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no message"])[0]
        raise InspectError(f"{svg}: graphviz 'dot' failed ({first})")
    return n_boxes


# ---------------------------------------------------------------- timeline


def load_timings(path: Path) -> dict:
    """Measured durations: ``{"ranks": [{"rank": 0, "segments": {"0": s, ...}, "collectives": {"0": s}}]}``
    (seconds; any item left out keeps its estimate). A device runtime can write this file."""
    try:
        data = json.loads(path.read_text())
        return {int(r["rank"]): {"segments": {int(k): float(v) for k, v in r.get("segments", {}).items()},
                                 "collectives": {int(k): float(v) for k, v in r.get("collectives", {}).items()}}
                for r in data["ranks"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InspectError(f"{path}: not a timings file ({type(exc).__name__}: {exc}); format: docs/inspect.md") from None


def schedule(report: dict, timings: dict | None = None) -> dict:
    """Start and end of every segment and collective per rank (see the module docstring)."""
    timings = timings or {}
    ranks = report["ranks"]
    k_count = len(ranks[0]["collectives"]) if ranks else 0
    compute_free = {rk["rank"]: 0.0 for rk in ranks}
    comm_free = 0.0
    coll_end: dict[int, float] = {}
    out: dict = {"items": [], "measured": 0, "estimated": 0}
    segs = {rk["rank"]: {s["index"]: s for s in rk.get("segments", [])} for rk in ranks}
    coll_out = {rk["rank"]: {c["order"]: set(c["outputs"]) for c in rk["collectives"]} for rk in ranks}

    def duration(r: int, kind: str, k: int, estimate: float) -> float:
        measured = timings.get(r, {}).get(kind, {}).get(k)
        out["measured" if measured is not None else "estimated"] += 1
        return measured if measured is not None else estimate

    for k in range(k_count + 1):
        for rk in ranks:
            r = rk["rank"]
            seg = segs[r].get(k)
            if seg is None:
                continue
            waits = [coll_end[j] for j in range(k) if coll_out[r][j] & set(seg["inputs"])]
            start = max([compute_free[r], *waits])
            end = start + duration(r, "segments", k, seg["est_seconds"])
            compute_free[r] = end
            out["items"].append({"rank": r, "lane": "compute", "kind": "segment", "index": k, "start": start, "end": end,
                                 "nodes": seg["nodes"]})
        if k < k_count:
            start = max([comm_free, *compute_free.values()])
            per_rank = [duration(rk["rank"], "collectives", k,
                                 collective_seconds(rk["collectives"][k]["sent_bytes"], rk["collectives"][k]["recv_bytes"]))
                        for rk in ranks]
            end = start + max(per_rank)  # a collective ends together on every rank: the slowest sets it
            comm_free = coll_end[k] = end
            for rk in ranks:
                c = rk["collectives"][k]
                out["items"].append({"rank": rk["rank"], "lane": "comm", "kind": c["op"], "index": k, "start": start,
                                     "end": end, "bucket": c["bucket"], "root": c["root"], "bytes": c["bytes"],
                                     "is_root": c["is_root"]})
    out["step_seconds"] = max([0.0, comm_free, *compute_free.values()])
    return out


def draw_timeline(report: dict, file: str, timings: dict | None = None) -> dict:
    try:
        import matplotlib
    except ImportError:
        raise InspectError("--timeline needs matplotlib: pip install 'graph-transpiler[inspect]'") from None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sched = schedule(report, timings)
    ranks = [rk["rank"] for rk in report["ranks"]]
    scale = 1e3  # ms
    fig_h = 1.6 + 1.1 * len(ranks)
    fig, ax = plt.subplots(figsize=(14, fig_h))
    y_of = {}
    ticks, labels = [], []
    for i, r in enumerate(ranks):
        base = (len(ranks) - 1 - i) * 3
        y_of[(r, "compute")] = base + 1.5
        y_of[(r, "comm")] = base + 0.5
        ticks += [base + 1.5, base + 0.5]
        labels += [f"rank {r} compute", f"rank {r} comm"]
    total = max(sched["step_seconds"], 1e-12) * scale
    for it in sched["items"]:
        y = y_of[(it["rank"], it["lane"])]
        x0, w = it["start"] * scale, (it["end"] - it["start"]) * scale
        if it["kind"] == "segment":
            ax.barh(y, w, left=x0, height=0.8, color="#9fc5e8", edgecolor="#3d85c6")
            text = f"seg {it['index']}"
        else:
            root = it["is_root"]
            ax.barh(y, w, left=x0, height=0.8, color=OP_COLORS.get(it["kind"], "#ffd966"), edgecolor="black",
                    hatch="//" if root else None, linewidth=1.2 if root else 0.5)
            text = f"{it['kind'][0]}{it['index']} b{it['bucket']}\n{human(it['bytes'])}" + \
                (f" r{it['root']}" if it["root"] is not None else "")
        if w > total * 0.035:
            ax.text(x0 + w / 2, y, text, ha="center", va="center", fontsize=7, clip_on=True)
        elif it["kind"] != "segment" and it["rank"] == ranks[0]:
            # too narrow to write in: label it once, above the first rank's lanes
            ax.text(x0 + w / 2, y_of[(ranks[0], "compute")] + 0.5, text.replace("\n", " "), rotation=90,
                    ha="center", va="bottom", fontsize=6)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("time in the step, ms (" + ("measured" if sched["estimated"] == 0 else
                  "estimated" if sched["measured"] == 0 else "measured where given, else estimated") + ")")
    cm = report["cost_model"]
    p = report["plan"]
    ax.set_title(f"{p['world_size']} rank(s), {p['strategy']}, {p['optimizer']}: step schedule "
                 f"(one compute + one comm stream per rank)", fontsize=10)
    present = sorted({it["kind"] for it in sched["items"] if it["kind"] != "segment"})
    handles = [Patch(facecolor="#9fc5e8", edgecolor="#3d85c6", label="compute segment")]
    handles += [Patch(facecolor=OP_COLORS.get(k, "#ffd966"), edgecolor="black", label=k) for k in present]
    if present:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="this rank is the root"))
    if sched["estimated"]:  # the cost model's assumptions, only where it gave a duration drawn
        handles.append(Patch(facecolor="none", edgecolor="none", label=(
            ("estimates" if not sched["measured"] else "estimates (items not in --timings)")
            + f": {cm['compute_flops_per_s'] / 1e12:g} TFLOP/s + {cm['node_overhead_s'] * 1e6:g} us/node, "
            f"{cm['link_bytes_per_s'] / 1e9:g} GB/s + {cm['collective_latency_s'] * 1e6:g} us/collective, "
            f"{cm['rows_per_rank']} rows/rank")))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18 if len(ranks) > 1 else -0.35),
              ncol=min(len(handles), 4), fontsize=7, frameon=False)
    ax.set_xlim(0, total * 1.02)
    ax.set_ylim(-0.2, max(y_of.values()) + (2.6 if sched["items"] and len(report["ranks"][0]["collectives"]) else 0.6))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(file, dpi=110)
    except (OSError, ValueError) as exc:
        raise InspectError(f"{file}: cannot write the timeline ({exc})") from None
    finally:
        plt.close(fig)
    return sched
