"""Errors the user sees from the runtime. Each message is one line naming what is wrong and where."""

from __future__ import annotations

from contract.errors import UserError


class RunError(UserError, RuntimeError):
    """A problem with OUT, the data or the options that the user can fix.

    The CLI prints ``transpile: error: <message>`` and exits with status 2, without a traceback; a
    rank process prints it once, prefixed with its rank. Messages name the file, field, input or rank
    concerned and fit on one line.
    """
