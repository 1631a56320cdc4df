"""``transpile inspect OUT|MODEL.onnx [options]``: arguments, and which output to make."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from inspection.errors import InspectError
from inspection.outdir import load_plan, rank_graph
from inspection.report import DEFAULT_ROWS_PER_RANK, build_report

# What matplotlib writes without extra packages (it picks the format from the extension).
TIMELINE_FORMATS = (".png", ".svg", ".pdf", ".eps", ".ps", ".jpg", ".jpeg")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="the -o directory of 'transpile', or an .onnx file")
    p.add_argument("--rank", type=int, action="append", help="show only this rank (repeatable)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema: docs/inspect.md)")
    p.add_argument("--diff", action="store_true", help="what the rewrite changed against the user's model, op by op")
    p.add_argument("--svg", metavar="FILE.svg", help="draw a rank's step graph (the first --rank, default 0) with graphviz")
    p.add_argument("--timeline", metavar="FILE.png",
                   help=f"draw the step's schedule per rank (format by extension: {', '.join(TIMELINE_FORMATS)})")
    p.add_argument("--collapse", choices=("auto", "off", "blocks", "segments", "on"), default="auto",
                   help="--svg: off: a box per node; blocks (or on): fold repeated blocks (h.1, h.2, ...), scopes "
                        "and per-parameter updates; segments: one box per segment and class; auto (default): off "
                        "up to 100 nodes, else blocks if that gives at most 40 boxes, else segments")
    p.add_argument("--constants", action="store_true",
                   help="--svg: also draw Constant nodes and initializers (not drawn by default)")
    p.add_argument("--rows", type=int, default=DEFAULT_ROWS_PER_RANK,
                   help=f"rows per rank assumed by the cost estimates (default {DEFAULT_ROWS_PER_RANK})")
    p.add_argument("--timings", metavar="FILE.json", help="measured seconds per segment/collective for the timeline")
    return p


def _check_extension(option: str, file: str | None, allowed: tuple[str, ...]) -> None:
    """A picture's format is its file's extension: 'x.png' must not receive SVG."""
    if file is not None and Path(file).suffix.lower() not in allowed:
        raise InspectError(f"{option} {file}: the file name must end with {' or '.join(allowed)} "
                           f"(the format is chosen by the extension)")


def execute(args: argparse.Namespace) -> int:
    _check_extension("--svg", args.svg, (".svg",))
    _check_extension("--timeline", args.timeline, TIMELINE_FORMATS)
    path = Path(args.out)
    if not path.exists():
        raise InspectError(f"{path}: no such file or directory")
    if args.rows < 1:
        raise InspectError(f"--rows must be positive, got {args.rows}")
    drew = False
    if args.svg:
        from inspection.draw import draw_svg

        graph_path, rank = rank_graph(path, args.rank[0] if args.rank else None)
        plan = load_plan(path) if path.is_dir() else None
        n = draw_svg(graph_path, rank, args.svg, plan=plan, collapse=args.collapse, constants=args.constants)
        print(f"wrote {args.svg}: {graph_path.name} ({n} boxes)")
        drew = True
    if args.timeline:
        if path.is_file():
            raise InspectError(f"{path}: --timeline needs an OUT directory written by 'transpile'")
        from inspection.draw import draw_timeline, load_timings

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
        from inspection.render import render

        render(report, diff_only=args.diff)
        sys.stdout.flush()
    except BrokenPipeError:  # 'transpile inspect OUT | head': the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
