"""The optimizers as one table: what each one reads and what state it keeps.

Everything that asks "which optimizer is this?" reads this table: ``OptimizerConfig`` (its slots,
its default weight decay, whether it reads the step counter, which hyper-parameters apply), the CLI
(which ``--option`` an optimizer uses), the rank builder (state inputs) and the tests (one
conformance case per entry). The update formulas themselves are emitted by
``transpiler.optimizer.emit_update``; a new optimizer is an entry here plus its formula there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    # OptimizerConfig fields the update reads (besides lr, which every update reads). The CLI
    # rejects an --option whose field no chosen optimizer reads.
    hyper_parameters: tuple[str, ...]
    # Per-parameter state tensors, each of the parameter's shape, in the order plan.json lists them.
    slots: tuple[str, ...] = ()
    # torch's default when the user gives no weight decay.
    default_weight_decay: float = 0.0
    # Reads the shared float32 step counter (Adam's bias corrections).
    uses_step: bool = False


OPTIMIZER_TABLE: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec("sgd", hyper_parameters=("weight_decay",)),
        OptimizerSpec("momentum", hyper_parameters=("weight_decay", "momentum", "nesterov"),
                      slots=("momentum_buffer",)),
        OptimizerSpec("adam", hyper_parameters=("weight_decay", "betas", "eps"), slots=("exp_avg", "exp_avg_sq"),
                      uses_step=True),
        # AdamW decays by default (torch.optim.AdamW's weight_decay=1e-2); the others do not.
        OptimizerSpec("adamw", hyper_parameters=("weight_decay", "betas", "eps"), slots=("exp_avg", "exp_avg_sq"),
                      default_weight_decay=1e-2, uses_step=True),
    )
}


def optimizers_using(field: str) -> tuple[str, ...]:
    """Names of the optimizers whose update reads the OptimizerConfig field ``field``."""
    return tuple(name for name, spec in OPTIMIZER_TABLE.items() if field in spec.hyper_parameters)
