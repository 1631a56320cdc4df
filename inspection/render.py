"""Text output of ``transpile inspect``: rich tables on a terminal, plain aligned text when piped.

Both come from the same list of ``Section``s, built from the report dict (inspection/report.py), so
the two outputs state the same facts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TextIO

from inspection.model import human


@dataclass
class Section:
    title: str
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # lines printed under the table
    numeric: set[int] = field(default_factory=set)  # right-aligned columns


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]" if shape is not None else "?"


def _ops(ops: dict, limit: int = 0) -> str:
    items = list(ops.items())
    text = ", ".join(f"{op} {n}" for op, n in (items[:limit] if limit else items))
    return text + (f", ... ({len(items) - limit} more)" if limit and len(items) > limit else "")


def _names(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f", ... (+{len(names) - limit})" if len(names) > limit else "")


def model_sections(m: dict, title: str) -> list[Section]:
    io = Section(f"{title}: {m['file']} (opset {m['opset']}, {m['nodes']} nodes)", ["", "name", "dtype", "shape"])
    for kind, values in (("input", m["inputs"]), ("output", m["outputs"])):
        for v in values:
            io.rows.append([kind, v["name"], v["dtype"], _shape(v["shape"])])
    init = m["initializers"]
    io.notes.append(f"initializers (parameters and constants): {init['count']} tensors, "
                    f"{init['elements']:,} elements, {init['bytes']:,} bytes ({human(init['bytes'])})")
    io.notes.append("ops by type: " + _ops(m["ops"]))
    sections = [io]
    if m.get("collectives"):
        sections.append(collective_section("collectives in this graph", m["collectives"]))
    return sections


def collective_section(title: str, colls: list[dict]) -> Section:
    s = Section(title, ["#", "op", "reduction", "bucket", "root", "bytes", "sent", "received", "tensors"],
                numeric={0, 3, 4, 5, 6, 7})
    for c in colls:
        root = "" if c["root"] is None else (f"{c['root']} (this rank)" if c["is_root"] else str(c["root"]))
        sizes = (["by batch"] * 3 if c.get("batch_sized") else
                 [f"{c['bytes']:,}", f"{c['sent_bytes']:,}", f"{c['recv_bytes']:,}"])
        s.rows.append([str(c["order"]), c["op"], c["reduction"] or "", str(c["bucket"]), root, *sizes,
                       _names([t["name"] for t in c["tensors"]])])
    return s


def out_sections(rep: dict) -> list[Section]:
    sections: list[Section] = []
    if rep.get("model"):
        sections += model_sections(rep["model"], "user model")
    p = rep["plan"]
    summary = Section(f"plan: {rep['source']}")
    summary.notes += [
        f"world size {p['world_size']}, strategy {p['strategy']}, optimizer {p['optimizer']}"
        + (f" (gradients clipped to norm {p['max_grad_norm']:g})" if p.get("max_grad_norm") else "")
        + (f", {p['grad_accumulation']} micro-batches per step" if p.get("grad_accumulation", 1) > 1 else "")
        + f", loss '{p['loss']}', "
        f"learning-rate input '{p['lr_input']}'",
        f"trained parameters: {p['parameters']} ({p['parameter_bytes']:,} bytes, {human(p['parameter_bytes'])}); "
        f"frozen: {len(p['frozen'])}",
    ]
    sections.append(summary)

    t = rep.get("trainable")
    if t is not None:
        ts = Section("initializers: trained or frozen, and why" + ("" if t["recorded"] else
                                                                   " (older plan: reasons not recorded)"),
                     ["initializer", "shape", "status", "reason"])
        for e in t["initializers"]:
            shape = "" if e["shape"] is None else _shape(e["shape"])
            why = e["why"] or ("" if e["status"] == "trained" else "?")
            ts.rows.append([e["name"], shape, e["status"], why])
        if t["summary"]:
            ts.notes.append(t["summary"])
        ts.notes += [f"warning: {w}" for w in t["warnings"]]
        sections.append(ts)

    place = rep["placement"]
    methods = place["methods"]
    cols = ["root rank"]
    for m in methods:
        cols += [f"{m} bytes", f"{m} params"]
    ps = Section(f"placement (used: {place['method']}): parameters and bytes per root rank", cols,
                 numeric=set(range(len(cols))))
    world = rep["plan"]["world_size"]
    for r in range(world):
        row = [str(r)]
        for info in methods.values():
            row += [f"{info['bytes_per_rank'][r]:,}", str(info["params_per_rank"][r]) if info["params_per_rank"] else "?"]
        ps.rows.append(row)
    ps.notes.append("imbalance (max/mean bytes): " + ", ".join(
        f"{m} {info['imbalance']:.3f}" + (" (used)" if m == place["method"] else "") for m, info in methods.items()))
    sections.append(ps)

    first = f", the first {p['first_bucket_mb']} MiB" if p.get("first_bucket_mb") is not None else ""
    bs = Section(f"buckets (cap {p['bucket_mb']:.4g} MiB{first}, in backward order)", ["bucket", "root", "bytes", "params"],
                 numeric={0, 1, 2})
    for b in rep["buckets"]:
        bs.rows.append([str(b["id"]), str(b["root"]), f"{b['bytes']:,}", _names(b["params"], 6)])
    sections.append(bs)

    for rk in rep["ranks"]:
        r = rk["rank"]
        sections.append(collective_section(f"rank {r}: {rk['step_file']} ({rk['nodes']} nodes), step collectives "
                                           "in execution order", rk["collectives"]))
        if rk.get("segments") is not None:
            ss = Section(f"rank {r}: compute segments (ALAP cut) and the collective after each",
                         ["segment", "nodes", "est. GFLOP", "est. ms", "then collective", "top ops"], numeric={0, 1, 2, 3})
            by_order = {c["order"]: c for c in rk["collectives"]}
            for seg in rk["segments"]:
                c = by_order.get(seg["followed_by"])
                then = f"#{c['order']} {c['op']} bucket {c['bucket']}" + (f" root {c['root']}" if c["root"] is not None else "") \
                    if c else "(end of step)"
                ss.rows.append([str(seg["index"]), str(seg["nodes"]), f"{seg['flops'] / 1e9:.4f}",
                                f"{seg['est_seconds'] * 1e3:.3f}", then, _ops(seg["ops"], 4)])
            sections.append(ss)
        sections.append(Section(f"rank {r}: summary", notes=[
            f"sends {rk['sent_bytes_per_step']:,} bytes and receives {rk['recv_bytes_per_step']:,} bytes per step "
            f"({rep['traffic_model']['name']} model)",
            f"root of bucket(s): {', '.join(map(str, rk['root_of_buckets'])) or 'none'}; updates "
            f"{len(rk['updates'])} parameter(s): {_names(rk['updates'], 6) or 'none'}",
            f"optimizer state kept: {rk['optimizer_state_bytes']:,} bytes; state bytes by kind: "
            + ", ".join(f"{k} {v:,}" for k, v in rk["state_bytes"].items()),
            f"init collectives: {len(rk['init_collectives'])} Broadcast(s), "
            f"{sum(c['recv_bytes'] for c in rk['init_collectives']):,} bytes received",
            "ops: " + _ops(rk["ops"], 12),
        ]))

    ts = Section("per rank and step: traffic and optimizer state", ["rank", "sent bytes", "received bytes",
                 "optimizer state bytes", "updates", "root of buckets"], numeric={0, 1, 2, 3, 4})
    for rk in rep["ranks"]:
        ts.rows.append([str(rk["rank"]), f"{rk['sent_bytes_per_step']:,}", f"{rk['recv_bytes_per_step']:,}",
                        f"{rk['optimizer_state_bytes']:,}", str(len(rk["updates"])),
                        ", ".join(map(str, rk["root_of_buckets"]))])
    ts.notes.append("traffic model: " + "; ".join(f"{k}: {v}" for k, v in rep["traffic_model"].items() if k != "name")
                    + " (B: the bucket's bytes, N: world size)")
    sections.append(ts)
    return sections


def diff_sections(rep: dict) -> list[Section]:
    d = rep["diff"]
    sections = []
    for rk in d["ranks"]:
        t = rk["totals"]
        s = Section(f"rank {rk['rank']}: {rk['file']} against {d['user_model']} ({d['user_nodes']} nodes): "
                    f"forward kept {t['forward']}, backward added {t['backward']}, optimizer added {t['optimizer']}, "
                    f"collectives added {t['collective']}, forward removed {rk['forward_removed']}",
                    ["op", "user model", "forward kept", "backward added", "optimizer added", "collectives added",
                     "removed"], numeric={1, 2, 3, 4, 5, 6})
        for row in rk["ops"]:
            s.rows.append([row["op"], *(str(row[k]) for k in ("user", "forward", "backward", "optimizer",
                                                              "collective", "removed"))])
        s.notes.append("inputs added: " + (_names(rk["inputs_added"], 8) or "none"))
        s.notes.append("initializers made state inputs: " + (_names(rk["initializers_now_inputs"], 8) or "none"))
        s.notes.append("outputs added: " + (_names(rk["outputs_added"], 8) or "none"))
        sections.append(s)
    return sections


def sections_of(rep: dict, diff_only: bool = False) -> list[Section]:
    if rep["kind"] == "model":
        return model_sections(rep["model"], "model")
    return diff_sections(rep) if diff_only else out_sections(rep)


def plain(sections: list[Section]) -> str:
    lines: list[str] = []
    for s in sections:
        lines.append(s.title)
        if s.columns:
            widths = [max(len(c), *(len(r[i]) for r in s.rows)) if s.rows else len(c) for i, c in enumerate(s.columns)]

            def fmt(cells, widths=widths, s=s):
                return "  " + "  ".join(c.rjust(w) if i in s.numeric else c.ljust(w)
                                        for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

            lines.append(fmt(s.columns))
            lines.append("  " + "  ".join("-" * w for w in widths))
            lines += [fmt(r) for r in s.rows]
        lines += ["  " + n for n in s.notes]
        lines.append("")
    return "\n".join(lines)


def render(rep: dict, diff_only: bool = False, console=None, file: TextIO | None = None) -> None:
    """Rich tables when ``console`` (default: one on stdout) is a terminal, plain text otherwise."""
    sections = sections_of(rep, diff_only)
    if console is None:
        try:
            from rich.console import Console
        except ImportError:  # rich is in the 'inspect' extra; plain text needs nothing
            (file or sys.stdout).write(plain(sections) + "\n")
            return
        console = Console(file=file)
    if not console.is_terminal:
        console.file.write(plain(sections) + "\n")
        return
    from rich.table import Table
    from rich.text import Text

    # Every string here is the user's (tensor names, shapes like "[batch, 10]", paths): Text objects,
    # never markup, so rich shows them as they are. The title is a line of its own, wrapped at the
    # console's width (between words), not squeezed into the table's width.
    for s in sections:
        console.print(Text(s.title, style="bold"), highlight=False)
        if s.columns:
            table = Table()
            for i, c in enumerate(s.columns):
                table.add_column(Text(c), justify="right" if i in s.numeric else "left")
            for row in s.rows:
                table.add_row(*(Text(cell) for cell in row))
            console.print(table, highlight=False)
        for n in s.notes:  # indented by two, wrapped lines too
            for line in Text(n).wrap(console, max(console.width - 2, 20)):
                line.rstrip()
                console.print(Text("  ") + line, highlight=False, soft_wrap=True)
        console.print()
