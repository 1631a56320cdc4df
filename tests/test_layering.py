"""The layers import only downwards (docs/architecture.md): transpiler/ and runtime/ meet only at OUT.

ruff enforces the same rules (each layer's ruff.toml bans the others); this test keeps them true
where ruff is not run. It reads every import statement, also those inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("contract", "transpiler", "runtime", "inspection", "commands")
# What each package may not import (its own first-party neighbours; executors where they matter).
BANNED = {
    "contract": {"transpiler", "runtime", "inspection", "commands", "onnx_ir", "onnxruntime", "cupy", "mpi4py"},
    "transpiler": {"runtime", "inspection", "commands", "onnxruntime", "cupy", "mpi4py"},
    "runtime": {"transpiler", "inspection", "commands"},
    "inspection": {"transpiler", "runtime", "commands", "onnxruntime", "cupy", "mpi4py"},
    "commands": set(),
}
# ``python -m transpiler.cli`` stays a name of the transpile command: its __main__ block hands over.
ALLOWED = {("transpiler/cli.py", "commands")}


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


@pytest.mark.parametrize("package", LAYERS)
def test_layers_import_only_downwards(package):
    wrong = []
    for path in sorted((REPO / package).rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        wrong += [f"{rel}:{line} imports {module}" for line, module in _imports(path)
                  if module in BANNED[package] and (rel, module) not in ALLOWED]
    assert not wrong, "; ".join(wrong)
