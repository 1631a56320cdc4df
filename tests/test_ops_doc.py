"""docs/ops.md's index of every ONNX op is what ``transpiler.autodiff.ops_table`` makes from the rule
registry: a rule registered without ``python -m transpiler.autodiff.ops_table --write`` fails here.

That every registered rule has a finite-difference spec is tests/test_autodiff_rules.py's
``test_every_rule_has_a_spec``.
"""

from __future__ import annotations

import re
from pathlib import Path

import onnx
import pytest

from transpiler.autodiff import ops_table
from transpiler.autodiff._registry import _RULES, non_differentiable_ops, registered_ops

DOC = Path(__file__).resolve().parents[1] / "docs" / "ops.md"
FIX = "run `python -m transpiler.autodiff.ops_table --write`"


def _section(text: str) -> str:
    assert text.count(ops_table.BEGIN) == 1 and text.count(ops_table.END) == 1, "docs/ops.md lost its index markers"
    return ops_table.BEGIN + text.split(ops_table.BEGIN, 1)[1].split(ops_table.END, 1)[0] + ops_table.END


def _documented_rows() -> dict[str, tuple[str, str]]:
    """op -> (gradient, rule file) from the index table in docs/ops.md."""
    rows = {}
    for line in _section(DOC.read_text()).splitlines():
        match = re.match(r"\| `(\w+)` \| (.*?) \| (.*?) \|", line)
        if match:
            rows[match[1]] = (match[2], match[3].strip("`"))
    return rows


def test_the_index_in_docs_is_current():
    documented = _section(DOC.read_text())
    made_with = re.search(r"in onnx (\S+) \(opset", documented)
    if made_with and made_with[1] != onnx.__version__:
        # The schemas differ between onnx releases; the registry's part is checked below all the same.
        pytest.skip(f"docs/ops.md's index was made with onnx {made_with[1]}, this is onnx {onnx.__version__}")
    assert documented == ops_table.index_markdown(), f"docs/ops.md's ops index is not current: {FIX}"


def test_the_index_names_every_rule_and_non_differentiable_op():
    """Whatever the onnx version: each registered op has its row, with its rule's file."""
    rows = _documented_rows()
    wrong = [op for op in sorted(registered_ops())
             if op not in rows or not rows[op][0].startswith("into ") or rows[op][1] != ops_table.rule_module(_RULES[op])]
    wrong += [op for op in sorted(non_differentiable_ops())
              if op not in rows or rows[op][1] != "non_differentiable.py"]
    assert not wrong, f"ops whose row in docs/ops.md is missing or stale: {wrong}; {FIX}"
    assert not [op for op, (gradient, _) in rows.items()
                if gradient.startswith("into ") and op not in registered_ops()], f"rows for rules that are gone; {FIX}"


def test_every_rule_is_found_in_its_module():
    assert [op for op in _RULES if ops_table.rule_module(_RULES[op]) == "?"] == []


def test_notes_and_groups_name_only_what_the_registry_holds():
    assert set(ops_table.RULE_NOTES) <= registered_ops(), "notes for ops without a rule"
    grouped = [op for ops in ops_table.NON_DIFFERENTIABLE_GROUPS.values() for op in ops]
    assert len(grouped) == len(set(grouped))
    assert set(grouped) == non_differentiable_ops(), "rules/non_differentiable.py and the groups disagree"
    assert not set(ops_table.NO_RULE_NOTES) & registered_ops(), "a no-rule note for an op that has a rule"


def test_every_default_domain_op_has_a_row():
    rows = ops_table.index_rows()
    assert {op for op, *_ in rows} >= set(ops_table.latest_schemas())
    assert all(gradient.startswith(("into ", "none: ")) for _, gradient, _, _ in rows)


def test_write_replaces_only_the_section(tmp_path):
    doc = tmp_path / "ops.md"
    doc.write_text(f"# head\n\nprose\n\n{ops_table.BEGIN}\nstale\n{ops_table.END}\n\n## tail\n")
    assert ops_table.main(["--check", "--doc", str(doc)]) == 1
    assert ops_table.main(["--write", "--doc", str(doc)]) == 0
    assert ops_table.main(["--check", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# head\n\nprose\n\n" + ops_table.BEGIN) and text.endswith(ops_table.END + "\n\n## tail\n")
    assert "stale" not in text
