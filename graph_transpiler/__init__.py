"""graph-transpiler's Python API: compile, train and export from a script or a notebook.

    from graph_transpiler import export, train, transpile

Docs: docs/api.md. The same operations as the ``transpile`` command (commands/), whose options they
take as keyword arguments.
"""

from graph_transpiler.api import TrainResult, export, train, transpile

__all__ = ["TrainResult", "export", "train", "transpile"]
