"""The error every layer raises for a problem the user can fix.

``transpile`` (commands/) prints it as one line, ``transpile: error: <message>``, and exits with
status 2, without a traceback. Each layer subclasses it (TranspileError, RunError, InspectError,
PlanError), so the command catches one class without importing the layers it does not run.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input that the user can fix; the message is one line naming the
    file, field, node, op or rank concerned."""

    def __init__(self, message: str):
        if "\n" in message:
            raise ValueError(f"{type(self).__name__} messages must be one line")
        super().__init__(message)
