"""``transpile inspect OUT``: what the rewrite produced, per rank, read back from OUT."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import onnx

from transpiler.collectives import DOMAIN
from transpiler.errors import TranspileError
from transpiler.plan import FORMAT


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


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
    if plan.get("format") != FORMAT:
        raise TranspileError(f"{path}: not a graph-transpiler plan (format {plan.get('format')!r})")
    return plan


def describe(out: Path, ranks: list[int] | None = None) -> str:
    plan = load_plan(out)
    world = plan["world_size"]
    lines = [
        f"plan: {out}",
        f"  world size {world}, strategy {plan['strategy']}, optimizer {plan['optimizer']['name']}, "
        f"loss '{plan['loss']}', learning-rate input '{plan['lr_input']}'",
        "  data inputs: " + ", ".join(f"{d['name']} {d['dtype']} {d['shape']}" for d in plan["data_inputs"]),
    ]
    total = sum(p["bytes"] for p in plan["parameters"])
    lines.append(f"  parameters: {len(plan['parameters'])} ({_human(total)}); frozen: {len(plan['frozen'])}")

    place = plan["placement"]
    lines.append(f"placement ({place['method']}): bytes per root rank, imbalance = max/mean")
    alternatives = {place["method"]: place, **place.get("other_methods", {})}
    for method, info in alternatives.items():
        per = ", ".join(f"r{r}: {_human(b)} ({n} params)" for r, (b, n) in enumerate(zip(info["bytes_per_rank"], info["params_per_rank"])))
        mark = "*" if method == place["method"] else " "
        lines.append(f" {mark} {method:<9} imbalance {info['imbalance']:.3f}   {per}")

    lines.append(f"buckets (cap {plan['bucket_mb']} MiB, backward order):")
    for b in plan["buckets"]:
        lines.append(f"  bucket {b['id']}: root {b['root']}, {_human(b['bytes'])}, {len(b['params'])} params: {', '.join(b['params'])}")

    for phase in ("init", "step"):
        coll = plan["collectives"][phase]
        per_step = sum(c["bytes"] for c in coll)
        lines.append(f"{phase} collectives ({len(coll)}, {_human(per_step)} in all), same order on every rank:")
        for c in coll:
            root = f" root {c['root']}" if c["root"] is not None else ""
            red = f" {c['reduction']}" if c["reduction"] else ""
            lines.append(
                f"  #{c['order']:<3} {c['op']:<9}{red}{root}  bucket {c['bucket']}  {_human(c['bytes'])}  {', '.join(c['params'])}"
            )

    selected = range(world) if ranks is None else ranks
    for r in selected:
        if not 0 <= r < world:
            raise TranspileError(f"--rank {r} is out of range: the plan has ranks 0..{world - 1}")
        entry = plan["graphs"]["ranks"][r]
        model = onnx.load(out / entry["step"], load_external_data=False)
        ops = Counter(n.op_type for n in model.graph.node if n.domain != DOMAIN)
        colls = [n for n in model.graph.node if n.domain == DOMAIN]
        lines.append(
            f"rank {r}: {entry['step']} ({len(model.graph.node)} nodes), {len(entry['updates'])} parameter updates, "
            f"optimizer state {_human(entry['optimizer_state_bytes'])}"
        )
        lines.append("  ops: " + ", ".join(f"{op} {n}" for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))))
        lines.append("  collectives: " + ", ".join(f"{n.op_type}[{len(n.input)}->{len(n.output)}]" for n in colls))
    return "\n".join(lines)


def inspect_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="transpile inspect", description="Show what 'transpile' wrote into OUT.")
    p.add_argument("out", help="the -o directory of 'transpile'")
    p.add_argument("--rank", type=int, action="append", help="show only this rank (repeatable)")
    p.add_argument("--json", action="store_true", help="print plan.json")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.json:
        print(json.dumps(load_plan(out), indent=1))
        return 0
    print(describe(out, args.rank))
    return 0
