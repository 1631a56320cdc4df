"""Errors the user sees from the runtime. Each message is one line naming what is wrong and where."""

from __future__ import annotations

import errno

from contract.errors import UserError


class RunError(UserError, RuntimeError):
    """A problem with OUT, the data or the options that the user can fix.

    The CLI prints ``transpile: error: <message>`` and exits with status 2, without a traceback; a
    rank process prints it once, prefixed with its rank. Messages name the file, field, input or rank
    concerned and fit on one line.
    """


class AgreedError(RunError):
    """A RunError every rank knows of (raised after a host agreement): the rank that raises it
    prints its line, every rank exits with status 2 normally (no teardown, no MPI_Abort)."""

    agreed = True


class PeerFailed(AgreedError):
    """Raised on the ranks that learned, through a host agreement, that another rank failed: that
    rank prints the one line; these exit with the same status and say nothing."""


def os_error_text(exc: OSError) -> str:
    """The OS error of ``exc`` for a one-line message: 'No space left on device (ENOSPC)'."""
    name = errno.errorcode.get(exc.errno or 0)
    text = exc.strerror or (str(exc).splitlines() or [type(exc).__name__])[0]
    return f"{text} ({name})" if name else text
