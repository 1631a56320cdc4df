"""Errors the user sees. Each message is one line naming what is wrong and where."""

from __future__ import annotations

from contract.errors import UserError


class TranspileError(UserError):
    """A problem with the user's input (model, options, data) that the user can fix.

    The CLI prints ``transpile: error: <message>`` and exits with status 2, without a traceback.
    Messages name the file, node, op or rank concerned and fit on one line.
    """


class UnsupportedOpsError(TranspileError):
    """The path from the parameters to the loss has ops without a gradient rule."""

    def __init__(self, nodes: list[tuple[str, str]], where: str = ""):
        # nodes: (op_type, node_name) for every unsupported node, all listed at once.
        self.nodes = nodes
        by_op: dict[str, list[str]] = {}
        for op, name in nodes:
            by_op.setdefault(op, []).append(name)
        parts = "; ".join(f"'{op}' (nodes: {', '.join(repr(n) for n in names)})" for op, names in sorted(by_op.items()))
        prefix = f"{where}: " if where else ""
        super().__init__(
            f"{prefix}gradient rule not implemented for {len(by_op)} op type(s) on the path to the loss: {parts}"
            " (supported ops: docs/ops.md)"
        )
