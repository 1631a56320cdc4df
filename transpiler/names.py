"""Names the training graphs give to values the runtime feeds or reads: the contract's
(contract/names.py, docs/contracts.md), plus the transpiler's own collective-order marker."""

from __future__ import annotations

from contract.names import ACC, GRAD_NORM_OUTPUT, LR_INPUT, NEXT, STEP_STATE

__all__ = ["ACC", "AFTER_GRADIENTS", "GRAD_NORM_OUTPUT", "LR_INPUT", "NEXT", "STEP_STATE"]

AFTER_GRADIENTS = -2  # order of a collective that follows every gradient collective (the clip norm)
