"""Errors of ``transpile inspect`` and ``transpile view``: one line, printed as ``transpile: error: ...``."""

from __future__ import annotations

from contract.errors import UserError


class InspectError(UserError):
    """OUT, a model file or an option that inspect or view cannot use (one line naming it)."""
