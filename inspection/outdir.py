"""OUT as inspect and view read it: plan.json through the contract's reader, and the rank graphs."""

from __future__ import annotations

from pathlib import Path

from contract import plan as contract_plan
from inspection.errors import InspectError


def load_plan(out: Path) -> dict:
    """OUT's plan.json as a dict, validated by the contract's reader (with the descriptive fields
    inspect shows). A few failures keep the words ``transpile inspect`` has always used for them
    (tests/test_cli_errors.py pins them); every other one is the reader's own line."""
    try:
        return contract_plan.load_plan(out, report_fields=True).raw
    except contract_plan.PlanError as exc:
        raise InspectError(_worded(exc)) from None


def _worded(exc: contract_plan.PlanError) -> str:
    path, d = exc.path, exc.details
    if exc.kind == "format":
        return f"{path}: not a graph-transpiler plan (format {d['found']!r})"
    if exc.kind == "version":
        return (f"{path}: format_version {d['found']} is not supported (this version reads "
                f"{' and '.join(map(str, contract_plan.READS_VERSIONS))}); transpile the model again")
    if exc.kind == "ranks":
        return f"{path}: world_size {d['world_size']} but {d['entries']} rank graph entries"
    if exc.kind == "type" and "expected" in d:
        expected = d["expected"] if isinstance(d["expected"], tuple) else (d["expected"],)
        return f"{path}: field '{exc.field}' is {d['got']}, expected {' or '.join(t.__name__ for t in expected)}"
    return str(exc)


def check_ranks(ranks: list[int] | None, world: int) -> list[int]:
    if ranks is None:
        return list(range(world))
    for r in ranks:
        if not 0 <= r < world:
            raise InspectError(f"--rank {r} is out of range: the plan has ranks 0..{world - 1}")
    return list(dict.fromkeys(ranks))


def rank_graph(path: Path, rank: int | None) -> tuple[Path, int]:
    """The step graph to draw: OUT's rank graph (rank 0 by default), or the model file itself."""
    if path.is_file():
        if rank:
            raise InspectError(f"{path}: --rank needs an OUT directory written by 'transpile', not a model file")
        return path, 0
    plan = load_plan(path)
    r = check_ranks([rank or 0], plan["world_size"])[0]
    return path / plan["graphs"]["ranks"][r]["step"], r
