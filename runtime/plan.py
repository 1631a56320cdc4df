"""plan.json as the runtime reads it: the contract's reader (contract/plan.py), errors as RunError.

The plan is the transpiler's promise about OUT (docs/contracts.md); its schema and validation live in
``contract.plan``, shared with the writer and with ``inspection/``.
"""

from __future__ import annotations

from pathlib import Path

from contract import plan as _contract
from contract.plan import Accumulator, DataInput, Gradient, GraphFiles, Parameter, Plan, StateEntry
from runtime.errors import RunError

PLAN_FORMAT = _contract.FORMAT
PLAN_FORMAT_VERSION = _contract.FORMAT_VERSION


def load_plan(out_dir: str | Path) -> Plan:
    """Read ``out_dir/plan.json`` (or a plan.json path) and validate the fields the runtime uses."""
    try:
        return _contract.load_plan(out_dir)
    except _contract.PlanError as exc:
        raise RunError(str(exc)) from None


__all__ = ["Accumulator", "DataInput", "Gradient", "GraphFiles", "Parameter", "Plan", "StateEntry", "load_plan"]
