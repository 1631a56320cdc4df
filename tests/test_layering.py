"""The layers import only downwards (docs/architecture.md): transpiler/ and runtime/ meet only at OUT.

ruff enforces the same rules (each layer's ruff.toml bans the others); this test keeps them true
where ruff is not run. It reads every import statement, also those inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("contract", "transpiler", "runtime", "inspection", "commands", "graph_transpiler")
# What each package may not import (its own first-party neighbours; executors where they matter).
BANNED = {
    "contract": {"transpiler", "runtime", "inspection", "commands", "onnx_ir", "onnxruntime", "cupy", "mpi4py"},
    "transpiler": {"runtime", "inspection", "commands", "onnxruntime", "cupy", "mpi4py"},
    "runtime": {"transpiler", "inspection", "commands"},
    "inspection": {"transpiler", "runtime", "commands", "onnxruntime", "cupy", "mpi4py"},
    "commands": set(),
    "graph_transpiler": {"commands", "inspection"},  # the Python API drives the transpiler and the runtime directly
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


def _module_imports(path: Path) -> set[str]:
    """Dotted first-party modules ``path`` imports (every import statement: also those inside
    functions and under ``if TYPE_CHECKING``, which are a dependency of the reader all the same)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from pkg import module`
    return found


@pytest.mark.parametrize("package", ["runtime/gpu", "runtime", "transpiler"])
def test_no_import_circle_inside(package):
    """Each module of ``package`` (its own files, not subpackages') imports only modules that do not
    import it back, directly or through others of the package: a house of floors, not rooms in a ring."""
    import networkx as nx

    folder = REPO / package
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts): p for p in folder.glob("*.py")
               if p.name != "__init__.py"}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, target) for target in _module_imports(path) if target in modules and target != name)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import circles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles)


@pytest.mark.parametrize("package", ["transpiler", "runtime"])
def test_no_file_over_450_lines(package):
    """A file does one thing; past 450 lines it does several (split it along the seam)."""
    long = [f"{p.relative_to(REPO)} ({n} lines)" for p in sorted((REPO / package).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 450]
    assert not long, ", ".join(long)
