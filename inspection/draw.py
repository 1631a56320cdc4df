"""Pictures for ``transpile inspect``: a rank graph as SVG (graphviz ``dot``) and the step's schedule
per rank as a timeline (matplotlib).

The SVG is meant to be read at page width: Constant nodes and initializers are left out unless asked
for, and a large graph folds (COLLAPSE_AUTO_NODES, MAX_BOXES): by repeated block and scope, or down
to one box per segment and class; collectives are always boxes of their own. Labels are built line
by line (``_label``): each line escaped once, then joined with DOT's ``\n``.

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
import textwrap
from collections import Counter, defaultdict
from pathlib import Path

from inspection.costs import collective_seconds, cut_segments, graph_collectives
from inspection.diff import classify, node_key
from inspection.errors import InspectError
from inspection.model import human, load_model

COLORS = {"forward": "#cfe2f3", "backward": "#f4cccc", "optimizer": "#d9ead3", "collective": "#ffd966",
          "constant": "#eeeeee"}
OP_COLORS = {"Reduce": "#e69138", "Broadcast": "#6aa84f", "AllReduce": "#8e7cc3",
             "ReduceScatter": "#c27ba0", "AllGather": "#45818e"}
# What the colours are called in the pictures' titles and legends: a title names only colours drawn.
COLOR_NAMES = {"#cfe2f3": "light blue", "#f4cccc": "light red", "#d9ead3": "light green", "#ffd966": "yellow",
               "#e69138": "orange", "#6aa84f": "green", "#8e7cc3": "purple", "#c27ba0": "pink", "#45818e": "teal",
               "#eeeeee": "grey"}
# --collapse auto: every node is a box up to COLLAPSE_AUTO_NODES drawn nodes; above, repeated blocks
# and scopes fold ("blocks"); if that leaves more than MAX_BOXES boxes, each segment folds to one box
# per class ("segments"), which stays readable at page width whatever the model. Collectives are
# always boxes of their own.
COLLAPSE_AUTO_NODES = 100
MAX_BOXES = 40
TOP_LEVEL = "top level"
TITLE_WIDTH = 90  # characters per line of a picture's title
COLLAPSE_CHOICES = ("auto", "off", "blocks", "segments", "on")  # "on": "blocks" (its older name)
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


def _group_label(name: str, block_word: str | None, params: list[str]) -> str:
    if block_word:
        m = re.search(rf"(?:^|[/.]){re.escape(block_word)}\.(\d+)(?=[/.]|$)", name)
        if m:
            return f"{block_word}.{m.group(1)}"
    for p in params:
        if name.startswith(p + "."):
            return f"update {p}"
    if name.startswith("optimizer."):
        return "optimizer (shared)"
    # anything else folds by its top-level scope ('/ln_f/Add_3' -> 'ln_f', 'loss/grad/Div' -> 'loss');
    # an op at the top level ('/Reshape_1', 'Constant_133') has none: those fold together
    parts = name.strip("/").split("/")
    scope = parts[0].split(".")[0] if len(parts) > 1 else ""
    return scope or TOP_LEVEL


def _esc(text: str) -> str:
    """A string inside a DOT double-quoted string: backslashes and quotes escaped."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _dot_id(text: str) -> str:
    return f'"{_esc(text)}"'


def _label(*lines: str) -> str:
    """A DOT label of several lines: each line escaped, then joined with DOT's line break ``\n``
    (escaping the joined text would turn the break into a literal backslash-n)."""
    return '"' + "\\n".join(_esc(line) for line in lines) + '"'


def _wrap(title: str, width: int = TITLE_WIDTH) -> list[str]:
    """A title's lines, broken between words but never inside a colour's name and never between
    a word and its parenthesis ('forward (light blue)')."""
    keep = re.sub(r"[^\s(]+ \([^()]*\)", lambda m: m.group(0).replace(" ", "\u00a0"), title)
    return [line.replace("\u00a0", " ") for line in textwrap.wrap(keep, width, break_on_hyphens=False)] or [""]


def _is_constant(node) -> bool:
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx")


def graph_dot(path: Path, rank: int, plan: dict | None = None, collapse: str = "auto",
              constants: bool = False) -> tuple[str, int]:
    """DOT source of a step graph: collectives highlighted, compute segments as clusters; returns
    (source, number of boxes). Constant nodes and initializers are drawn only with ``constants``.
    ``collapse``: see COLLAPSE_AUTO_NODES."""
    if collapse not in COLLAPSE_CHOICES:
        raise InspectError(f"--collapse {collapse}: expected one of {', '.join(COLLAPSE_CHOICES)}")
    model = load_model(path)
    world = plan["world_size"] if plan else 1
    nodes = list(model.graph.node)
    params = sorted((p["name"] for p in plan["parameters"]), key=len, reverse=True) if plan else []
    user = None
    if plan:
        src = path.parent / plan["source_model"]["file"]
        user = load_model(src) if src.is_file() else None
    # a plain model file (no plan) is all forward: it is its own user model
    kinds = classify(model, user if plan else model, [p for p in params])
    colls = {c["name"]: c for c in graph_collectives(model, rank, world, plan["collectives"]["step"] if plan else None)}
    try:
        segments = cut_segments(model, rank, str(path), 1)
    except InspectError:
        segments = []  # a graph the runtime could not cut is still drawn, without clusters
    seg_of = {key: s["index"] for s in segments for key in s["node_keys"]}

    # What is drawn: (key, name, op, kind, segment, inputs) per item; constants only when asked for.
    items = []
    for n in nodes:
        key = node_key(n)
        if _is_constant(n) and not constants:
            continue
        kind = "constant" if _is_constant(n) else kinds[key]
        items.append((key, n.name or key, n.op_type, kind, seg_of.get(key), list(n.input), list(n.output)))
    if constants:
        graph_inputs = {i.name for i in model.graph.input}
        items += [(t.name, t.name, "initializer", "constant", None, [], [t.name])
                  for t in model.graph.initializer if t.name not in graph_inputs]
    level = {"on": "blocks"}.get(collapse, collapse)
    if level == "auto":
        level = "off" if len(items) <= COLLAPSE_AUTO_NODES else "blocks"
        if level == "blocks" and len(_fold(items, "blocks", params)[1]) > MAX_BOXES:
            level = "segments"
    box_of, boxes = _fold(items, level, params)
    producer_box = {o: box_of[key] for key, *_, outputs in items for o in outputs if o}

    title = f"{path.name}: {_color_key(boxes.values())}; clusters: compute segments" + {
        "off": "", "blocks": ", repeated blocks folded", "segments": ", one box per segment and class"}[level]
    if not constants:
        title += "; constants not drawn"
    lines = [f"digraph {_dot_id(path.stem)} {{", "  rankdir=TB; newrank=true; compound=true; nodesep=0.2; ranksep=0.3;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [color="#888888", arrowsize=0.6];',
             f'  label={_label(*_wrap(title))}; labelloc=t; fontname="Helvetica";']

    def box_line(box: str, info: dict) -> str:
        if info["kind"] == "collective":
            key, name, op = info["items"][0][:3]
            c = colls.get(name, {})
            root = f" root {c['root']}" if c.get("root") is not None else ""
            red = f" ({c['reduction']})" if c.get("reduction") else ""
            text = _label(f"#{c.get('order')} {op}{red}", f"bucket {c.get('bucket')}{root}",
                          f"{human(c.get('bytes', 0))}, {len(c.get('tensors', []))} tensor(s)")
            return (f'  {_dot_id(box)} [label={text}, shape=box3d, style="filled,bold", penwidth=2.5, '
                    f'fillcolor="{OP_COLORS.get(op, COLORS["collective"])}", tooltip={_dot_id(name)}];')
        if "label" in info:  # a fold: its name and size (the class is its colour), its top ops in the tooltip
            ops = Counter(it[2] for it in info["items"]).most_common(5)
            n = len(info["items"])
            tip = (info["label"] if info["label"].startswith(info["kind"]) else f"{info['label']} {info['kind']}") + \
                f": {n} nodes: " + ", ".join(f"{o} {c}" for o, c in ops)
            return (f'  {_dot_id(box)} [label={_label(info["label"], f"{n} node" + "s" * (n != 1))}, shape=folder, '
                    f'fillcolor="{COLORS[info["kind"]]}", tooltip={_dot_id(tip)}];')
        key, name, op = info["items"][0][:3]
        short = name if len(name) <= 32 else "..." + name[-29:]
        shape = ', shape=note, fontsize=8' if info["kind"] == "constant" else ""
        return (f'  {_dot_id(box)} [label={_label(op, short)}, fillcolor="{COLORS[info["kind"]]}"{shape}, '
                f'tooltip={_dot_id(name)}];')

    by_seg: dict = defaultdict(list)
    for box, info in boxes.items():
        by_seg[info["seg"] if info["kind"] != "collective" else "coll"].append(box)
    for seg in sorted(k for k in by_seg if isinstance(k, int)):
        after = next((s["followed_by"] for s in segments if s["index"] == seg), None)
        then = f", then collective #{after}" if after is not None else ", end of step"
        lines.append(f"  subgraph cluster_segment{seg} {{")
        lines.append(f'    label={_label(f"segment {seg}{then}")}; style="rounded,dashed"; color="#666666"; fontsize=11;')
        lines += ["  " + box_line(b, boxes[b]) for b in by_seg[seg]]
        lines.append("  }")
    for box in by_seg.get("coll", []) + by_seg.get(None, []):
        lines.append(box_line(box, boxes[box]))
    edges = set()
    for key, _name, _op, _kind, _seg, inputs, _outputs in items:
        dst = box_of[key]
        for i in inputs:
            src = producer_box.get(i)
            if src is not None and src != dst:
                edges.add((src, dst))
    lines += [f"  {_dot_id(a)} -> {_dot_id(b)};" for a, b in sorted(edges)]
    # the communication stream's order: collective k, then k+1 (dotted; it also places the
    # collectives that read nothing of this rank's, a non-root Broadcast, where they run)
    order = sorted((c["order"], box_of[key]) for key, name, *_ in items if (c := colls.get(name)) is not None
                   and c.get("order") is not None and boxes[box_of[key]]["kind"] == "collective")
    lines += [f'  {_dot_id(a)} -> {_dot_id(b)} [style=dotted, color="#aaaaaa", arrowhead=none];'
              for (_, a), (_, b) in zip(order, order[1:])]
    lines.append("}")
    return "\n".join(lines) + "\n", len(boxes)


def _fold(items: list[tuple], level: str, params: list[str]) -> tuple[dict[str, str], dict[str, dict]]:
    """(box of every item, boxes): each item its own box ("off"), or one box per segment, class and
    repeated block or scope ("blocks"), or per segment and class ("segments"); collectives alone.
    At the "blocks" level an op at the top level (no scope: '/Reshape_1') joins the box of a
    producer of the same segment and class, so that plumbing between scopes adds no boxes."""
    block_word = _block_word([it[1] for it in items]) if level == "blocks" else None
    box_of: dict[str, str] = {}
    boxes: dict[str, dict] = {}
    producer = {o: it[0] for it in items for o in it[6] if o}
    for i, it in enumerate(items):
        key, name, _op, kind, seg, inputs = it[:6]
        if level == "off" or kind == "collective":
            box = f"n{i}"
            boxes[box] = {"seg": seg, "kind": kind, "items": [it]}
            box_of[key] = box
            continue
        if level == "blocks":
            label = _group_label(name, block_word, params)
            if label == TOP_LEVEL:
                near = [box_of[producer[x]] for x in inputs if producer.get(x) in box_of]
                near = [b for b in near if "label" in boxes[b] and (boxes[b]["seg"], boxes[b]["kind"]) == (seg, kind)]
                if near:
                    label = boxes[near[0]]["label"]
        else:
            label = kind if seg is not None else f"{kind}, outside the segments"
        box = f"g:{seg}:{label}:{kind}"
        boxes.setdefault(box, {"seg": seg, "kind": kind, "items": [], "label": label})["items"].append(it)
        box_of[key] = box
    return box_of, boxes


def _color_key(boxes) -> str:
    """'forward (light blue), ..., collectives: Reduce (orange), Broadcast (green)': the classes and
    collective ops of the boxes drawn, in the colours box_line fills them with."""
    present = {b["kind"] for b in boxes}
    parts = [f"{kind} ({COLOR_NAMES[COLORS[kind]]})" for kind in ("forward", "backward", "optimizer", "constant")
             if kind in present]
    ops = list(dict.fromkeys(b["items"][0][2] for b in boxes if b["kind"] == "collective"))
    if ops:
        parts.append("collectives: " + ", ".join(
            f"{op} ({COLOR_NAMES[OP_COLORS.get(op, COLORS['collective'])]})" for op in ops))
    return ", ".join(parts)


def draw_svg(path: Path, rank: int, svg: str, plan: dict | None = None, collapse: str = "auto",
             constants: bool = False) -> int:
    dot = shutil.which("dot")
    if dot is None:
        raise InspectError(DOT_MISSING)
    source, n_boxes = graph_dot(path, rank, plan, collapse, constants)
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


# Layout of the timeline, in inches at DPI dots per inch: fixed margins, so that label positions
# computed before drawing are where the labels land (no tight_layout afterwards).
DPI = 110
FIG_W, LEFT, RIGHT = 14.0, 1.25, 0.35
LANE_IN = 1.1 / 3  # a rank is 3 units of y: compute lane, comm lane, space
INSIDE_PT, TAG_PT, KEY_PT = 7, 7, 7  # font sizes
TAG_BASE_PT, TAG_ROW_PT, TAG_GAP_PX = 12, 11, 6  # first tag row above the axes, row pitch, gap between tags
KEY_MAX = 48  # key entries listed; past that the key says how many more


def _spread(centers: list[float], widths: list[float], lo: float, hi: float, gap: float) -> list[float]:
    """Left edges of labels of these widths, as near their centers as they can be without touching
    (``gap`` apart), in the same order, inside [lo, hi] where they fit: clusters of overlapping
    labels are centred on their members' centres and merged until none overlap."""
    clusters: list[list] = []  # [first index, last index, left edge]
    for i, (c, w) in enumerate(zip(centers, widths)):
        clusters.append([i, i, c - w / 2])
        while len(clusters) > 1:
            a, b = clusters[-2], clusters[-1]
            a_width = sum(widths[a[0]:a[1] + 1]) + gap * (a[1] - a[0])
            if a[2] + a_width + gap <= b[2]:
                break
            first, last = a[0], b[1]
            width = sum(widths[first:last + 1]) + gap * (last - first)
            middle = (centers[first] + centers[last]) / 2
            clusters[-2:] = [[first, last, middle - width / 2]]
    lefts = []
    for first, last, left in clusters:
        for i in range(first, last + 1):
            lefts.append(left)
            left += widths[i] + gap
    for i in range(len(lefts)):  # clamp into [lo, hi]: forward, then backward
        lefts[i] = max(lefts[i], lo if i == 0 else lefts[i - 1] + widths[i - 1] + gap)
    for i in reversed(range(len(lefts))):
        lefts[i] = min(lefts[i], hi - widths[i] if i == len(lefts) - 1 else lefts[i + 1] - gap - widths[i])
    return lefts


def timeline_figure(report: dict, timings: dict | None = None):
    """The step's schedule per rank as a matplotlib Figure (Agg canvas), and the schedule.

    A label is written inside its box where it fits. A collective too narrow for its label gets a
    tag ``#k`` above the axes, joined to it by a leader line; tags are spread so that none touches
    another (in more rows when one row is full), and the key under the legend spells each one out."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise InspectError("--timeline needs matplotlib: pip install 'graph-transpiler[inspect]'") from None

    sched = schedule(report, timings)
    ranks = [rk["rank"] for rk in report["ranks"]]
    scale = 1e3  # ms
    total = max(sched["step_seconds"], 1e-12) * scale
    xmax = total * 1.02
    y_of = {}
    ticks, tick_labels = [], []
    for i, r in enumerate(ranks):
        base = (len(ranks) - 1 - i) * 3
        y_of[(r, "compute")], y_of[(r, "comm")] = base + 1.5, base + 0.5
        ticks += [base + 1.5, base + 0.5]
        tick_labels += [f"rank {r} compute", f"rank {r} comm"]
    ylim = (-0.2, 3 * (len(ranks) - 1) + 2.2)
    axes_w = FIG_W - LEFT - RIGHT
    axes_h = (ylim[1] - ylim[0]) * LANE_IN
    px_per_ms, px_per_y = axes_w * DPI / xmax, LANE_IN * DPI

    fig = Figure(figsize=(FIG_W, 4), dpi=DPI)
    renderer = FigureCanvasAgg(fig).get_renderer()

    def size_px(text: str, points: float, **kw) -> tuple[float, float]:
        t = fig.text(0, 0, text, fontsize=points, **kw)
        box = t.get_window_extent(renderer)
        t.remove()
        return box.width, box.height

    ax = fig.add_axes((0, 0, 1, 1))
    inside, tagged = [], {}
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
            text = f"#{it['index']} {it['kind']} b{it['bucket']}\n{human(it['bytes'])}" + \
                (f" r{it['root']}" if it["root"] is not None else "")
        tw, th = size_px(text, INSIDE_PT)
        if tw + 4 <= w * px_per_ms and th + 2 <= 0.8 * px_per_y:
            inside.append((x0 + w / 2, y, text, it["kind"] != "segment" and it["is_root"]))
        elif it["kind"] != "segment":  # a narrow segment stays unlabelled: the tables list them
            tagged[it["index"]] = (x0 + w / 2, f"{it['kind']}, bucket {it['bucket']}, {human(it['bytes'])}"
                                   + (f", root {it['root']}" if it["root"] is not None else ""))
    for x, y, text, hatched in inside:  # on a hatched box, the text on a light patch
        ax.text(x, y, text, ha="center", va="center", fontsize=INSIDE_PT,
                bbox={"boxstyle": "square,pad=0.1", "fc": "white", "alpha": 0.75, "ec": "none"} if hatched else None)

    # tags of the narrow collectives, in x order, spread over as few rows as hold them
    order = sorted(tagged, key=lambda k: (tagged[k][0], k))
    widths = [size_px(f"#{k}", TAG_PT)[0] + 2 for k in order]
    avail = axes_w * DPI
    rows = 1
    while any(sum(widths[r::rows]) + TAG_GAP_PX * len(widths[r::rows]) > avail for r in range(rows)):
        rows += 1
    for r in range(rows if order else 0):
        ks, ws = order[r::rows], widths[r::rows]
        centers = [tagged[k][0] * px_per_ms for k in ks]
        for k, c, w, left in zip(ks, centers, ws, _spread(centers, ws, 0.0, avail, TAG_GAP_PX)):
            ax.annotate(f"#{k}", xy=(tagged[k][0], 1.0), xycoords=("data", "axes fraction"),
                        xytext=((left + w / 2 - c) * 72 / DPI, TAG_BASE_PT + r * TAG_ROW_PT), textcoords="offset points",
                        ha="center", va="bottom", fontsize=TAG_PT, annotation_clip=False,
                        bbox={"boxstyle": "square,pad=0.05", "fc": "white", "ec": "none"},
                        arrowprops={"arrowstyle": "-", "color": "#888888", "lw": 0.6, "shrinkA": 0, "shrinkB": 0})
    band_pt = TAG_BASE_PT + rows * TAG_ROW_PT + 2 if order else 0

    ax.set_yticks(ticks, tick_labels, fontsize=8)
    ax.set_xlabel("time in the step, ms (" + ("measured" if sched["estimated"] == 0 else
                  "estimated" if sched["measured"] == 0 else "measured where given, else estimated") + ")")
    cm = report["cost_model"]
    p = report["plan"]
    ax.set_title(f"{p['world_size']} rank(s), {p['strategy']}, {p['optimizer']}: step schedule "
                 f"(one compute + one comm stream per rank)", fontsize=10, pad=band_pt + 6)
    ax.set_xlim(0, xmax)
    ax.set_ylim(*ylim)
    ax.grid(axis="x", alpha=0.3)

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
    legend = fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 4), fontsize=7, frameon=False)
    legend_h = legend.get_window_extent(renderer).height / DPI

    # the key: what each tag stands for, in columns
    entries = [f"#{k}: {tagged[k][1]}" for k in sorted(tagged)]
    if len(entries) > KEY_MAX:
        entries = entries[:KEY_MAX - 1] + [f"... {len(entries) - KEY_MAX + 1} more ('transpile inspect OUT' lists them)"]
    key_title = "collectives too narrow to label (#order: op, bucket, bytes, root):"
    key_w = max((size_px(e, KEY_PT)[0] for e in entries), default=0) + 18
    line_h = size_px("#0", KEY_PT)[1] * 1.25 / DPI
    cols = max(1, min(len(entries), int((FIG_W - 0.6) * DPI // key_w))) if entries else 1
    per_col = -(-len(entries) // cols) if entries else 0
    key_h = (per_col + 1) * line_h + 0.1 if entries else 0.0

    title_h = (size_px("Ag", 10)[1] + band_pt * DPI / 72 + 6 * DPI / 72) / DPI + 0.15
    below_axes = 0.6  # tick labels and the x label
    height = title_h + axes_h + below_axes + legend_h + 0.1 + key_h + 0.1
    fig.set_size_inches(FIG_W, height)
    bottom = key_h + 0.1 + legend_h + 0.1 + below_axes
    ax.set_position((LEFT / FIG_W, bottom / height, axes_w / FIG_W, axes_h / height))
    legend.set_bbox_to_anchor(((LEFT + axes_w / 2) / FIG_W, (key_h + 0.1 + legend_h + 0.05) / height), transform=fig.transFigure)
    if entries:
        top = key_h + 0.05
        fig.text(0.3 / FIG_W, top / height, key_title, fontsize=KEY_PT, va="top")
        for c in range(cols):
            chunk = entries[c * per_col:(c + 1) * per_col]
            for j, entry in enumerate(chunk):
                fig.text((0.3 + c * key_w / DPI) / FIG_W, (top - (j + 1) * line_h) / height, entry, fontsize=KEY_PT,
                         va="top")
    return fig, sched


def _metadata(file: str) -> dict:
    """Metadata without dates, so that the same drawing gives the same file (the renderer's version,
    which matplotlib writes, stays: docs/images/make_images.py reads it)."""
    suffix = Path(file).suffix.lower()
    if suffix == ".svg":
        return {"Date": None}
    if suffix == ".pdf":
        return {"CreationDate": None, "ModDate": None}
    if suffix in (".eps", ".ps"):
        return {"CreationDate": None}
    return {}  # PNG and JPEG carry no date


def draw_timeline(report: dict, file: str, timings: dict | None = None) -> dict:
    """Write the timeline (format by the file's extension); the same drawing gives the same bytes."""
    import matplotlib

    fig, sched = timeline_figure(report, timings)
    try:
        with matplotlib.rc_context({"svg.hashsalt": "graph-transpiler"}):
            fig.savefig(file, dpi=DPI, metadata=_metadata(file))
    except (OSError, ValueError) as exc:
        raise InspectError(f"{file}: cannot write the timeline ({exc})") from None
    return sched
