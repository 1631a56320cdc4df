"""The optimizers as one table: what each one reads and what state it keeps.

Everything that asks "which optimizer is this?" reads this table: ``OptimizerConfig`` (below: its slots,
its default weight decay, whether it reads the step counter, which hyper-parameters apply), the CLI
(which ``--option`` an optimizer uses), the rank builder (state inputs) and the tests (one
conformance case per entry). The update formulas themselves are emitted by
``transpiler.optimizer.emit_update``; a new optimizer is an entry here plus its formula there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transpiler.errors import TranspileError


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
    # The learning rate when the user gives none (docs/cli.md): 0.01, Adam's customary 1e-3.
    default_lr: float = 0.01
    # Reads the shared float32 step counter (Adam's bias corrections).
    uses_step: bool = False


OPTIMIZER_TABLE: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec("sgd", hyper_parameters=("weight_decay",)),
        OptimizerSpec("momentum", hyper_parameters=("weight_decay", "momentum", "nesterov"),
                      slots=("momentum_buffer",)),
        OptimizerSpec("adam", hyper_parameters=("weight_decay", "betas", "eps"), slots=("exp_avg", "exp_avg_sq"),
                      default_lr=1e-3, uses_step=True),
        # AdamW decays by default (torch.optim.AdamW's weight_decay=1e-2); the others do not.
        OptimizerSpec("adamw", hyper_parameters=("weight_decay", "betas", "eps"), slots=("exp_avg", "exp_avg_sq"),
                      default_weight_decay=1e-2, default_lr=1e-3, uses_step=True),
    )
}


def optimizers_using(field: str) -> tuple[str, ...]:
    """Names of the optimizers whose update reads the OptimizerConfig field ``field``."""
    return tuple(name for name, spec in OPTIMIZER_TABLE.items() if field in spec.hyper_parameters)


@dataclass(frozen=True)
class OptimizerConfig:
    """An optimizer and its hyper-parameters; one per training graph.

    ``weight_decay=None`` means torch's default for that optimizer (0.01 for adamw, 0 otherwise) and
    ``lr=None`` the table's default (0.01; 1e-3 for adam and adamw); both are resolved on
    construction, so ``config.weight_decay`` and ``config.lr`` are always floats. ``momentum`` and
    ``nesterov`` apply to "momentum" only; ``betas`` and ``eps`` to "adam" and "adamw" only.
    ``max_grad_norm`` (any optimizer; None: no clipping) scales the gradients, before the update, by
    ``min(1, max_grad_norm / (total_norm + 1e-6))``, total_norm being the L2 norm of all of them.
    """

    name: str = "sgd"
    lr: float | None = None  # None: the optimizer's default_lr (0.01; 1e-3 for adam/adamw)
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float | None = None
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        if self.weight_decay is None and self.name in OPTIMIZER_TABLE:
            object.__setattr__(self, "weight_decay", OPTIMIZER_TABLE[self.name].default_weight_decay)
        if self.lr is None:
            object.__setattr__(self, "lr", OPTIMIZER_TABLE[self.name].default_lr if self.name in OPTIMIZER_TABLE else 0.01)
        if isinstance(self.betas, list):
            # JSON and argparse give lists; a tuple keeps the frozen config hashable.
            object.__setattr__(self, "betas", tuple(self.betas))

    def validate(self) -> OptimizerConfig:
        """Raise TranspileError naming the option for a bad value; return self when all are good."""
        if self.name not in OPTIMIZER_TABLE:
            raise TranspileError(
                f"--optimizer: unknown optimizer {self.name!r} (available: {', '.join(OPTIMIZER_TABLE)})"
            )
        _check_number("--lr", self.lr, low=0.0)
        _check_number("--weight-decay", self.weight_decay, low=0.0)
        _check_number("--momentum", self.momentum, low=0.0)
        _check_number("--eps", self.eps, low=0.0)
        if "momentum" in self.spec.hyper_parameters and self.momentum == 0:
            raise TranspileError(
                "--momentum: must be > 0 for --optimizer momentum (use --optimizer sgd for none)"
            )
        if self.nesterov and "nesterov" not in self.spec.hyper_parameters:
            raise TranspileError(f"--nesterov: needs --optimizer momentum, not {self.name!r}")
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            raise TranspileError(f"--betas: expected two numbers (beta1, beta2), got {self.betas!r}")
        for index, beta in enumerate(self.betas):
            _check_number("--betas", beta, low=0.0, high=1.0, what=f"beta{index + 1}")
        if self.max_grad_norm is not None:
            value = self.max_grad_norm
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                raise TranspileError(f"--clip-grad-norm: must be > 0, got {value!r} (leave it out for no clipping)")
            _check_number("--clip-grad-norm", value, low=0.0)
        return self

    @property
    def spec(self):
        """This optimizer's entry in ``transpiler.optimizer_table.OPTIMIZER_TABLE``."""
        return OPTIMIZER_TABLE[self.name]

    def slots(self) -> tuple[str, ...]:
        """Names of the per-parameter state tensors, in order (each has the parameter's shape)."""
        return self.spec.slots

    def uses_step(self) -> bool:
        """True when the update reads the shared step counter (Adam's bias corrections)."""
        return self.spec.uses_step

    def to_json(self) -> dict:
        """The hyper-parameters as plan.json records them; momentum is 0 where the update uses none."""
        return {
            "name": self.name,
            "lr": self.lr,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "momentum": self.momentum if "momentum" in self.spec.hyper_parameters else 0.0,
            "nesterov": self.nesterov,
            "max_grad_norm": self.max_grad_norm,
        }


def _check_number(option: str, value, *, low: float, high: float | None = None, what: str = "") -> None:
    label = f"{option} ({what})" if what else option
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TranspileError(f"{label}: expected a finite number, got {value!r}")
    if value < low:
        raise TranspileError(f"{label}: must be >= {low:g}, got {value!r}")
    if high is not None and value >= high:
        raise TranspileError(f"{label}: must be in [{low:g}, {high:g}), got {value!r}")
