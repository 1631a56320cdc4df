"""Learning-rate schedules. The learning rate is an input of every step graph, so a schedule is a
host-side function of the step: no re-transpiling, no graph change.

With ``T`` steps in all, ``W`` warmup steps and step ``t`` counted from 0 (the formulas of
torch.optim.lr_scheduler, which the tests use as the oracle):

- warmup (any schedule, ``t < W``): ``lr * (t + 1) / W``  (LinearLR(start_factor=1/W, total_iters=W-1))
- ``constant``: ``lr``
- ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * u / U)) / 2`` with ``u = t - W``, ``U = T - W``
  (CosineAnnealingLR(T_max=U, eta_min=min_lr))
- ``linear``: ``lr + (min_lr - lr) * u / U``  (linear decay to min_lr at the end)
- ``step``: ``lr * gamma ** floor(u / step_size)``  (StepLR)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from runtime.errors import RunError

SCHEDULES = ("constant", "cosine", "linear", "step")
# The options each schedule reads besides --warmup-steps (which every schedule takes); giving one
# that the chosen schedule ignores is an error, as the transpiler refuses --momentum for adam.
USES = {"constant": (), "cosine": ("min_lr",), "linear": ("min_lr",), "step": ("step_size", "gamma")}
OPTIONS = {"min_lr": "--min-lr", "step_size": "--lr-step-size", "gamma": "--lr-gamma"}


@dataclass(frozen=True)
class Schedule:
    kind: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    step_size: int = 0  # "step": decay every step_size steps
    gamma: float = 0.1  # "step": by this factor

    def validate(self, steps: int) -> None:
        if self.kind not in SCHEDULES:
            raise RunError(f"--lr-schedule '{self.kind}' is not one of: {', '.join(SCHEDULES)}")
        if not 0 <= self.warmup_steps < max(steps, 1):
            raise RunError(f"--warmup-steps must be in [0, steps) = [0, {steps}), got {self.warmup_steps}")
        if not 0 <= self.min_lr < float("inf"):
            raise RunError(f"--min-lr must be a finite number >= 0, got {self.min_lr}")
        if not 0 <= self.gamma < float("inf"):
            raise RunError(f"--lr-gamma must be a finite number >= 0, got {self.gamma}")
        if self.kind == "step" and self.step_size < 1:
            raise RunError("--lr-schedule step needs --lr-step-size N (N >= 1)")

    @classmethod
    def from_options(cls, kind: str, warmup_steps: int | None = None, **given) -> Schedule:
        """The schedule of ``--lr-schedule kind`` and the options the user gave (None: not given;
        those get the defaults above). An option the schedule does not use is a RunError."""
        unused = [OPTIONS[k] for k, v in given.items() if v is not None and k not in USES.get(kind, ())]
        if unused:
            users = [name for name, keys in USES.items() if any(OPTIONS[k] in unused for k in keys)]
            raise RunError(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used by --lr-schedule {kind} "
                           f"(only by {' and '.join(users)}); remove {'it' if len(unused) == 1 else 'them'} or choose "
                           "that schedule")
        return cls(kind, 0 if warmup_steps is None else warmup_steps, **{k: v for k, v in given.items() if v is not None})

    def describe(self) -> str:
        """The schedule in words, for the run's banner."""
        words = {"constant": "constant", "cosine": f"cosine to {self.min_lr:g}", "linear": f"linear to {self.min_lr:g}",
                 "step": f"step: x{self.gamma:g} every {self.step_size} steps"}[self.kind]
        return words + (f", after {self.warmup_steps} warmup steps" if self.warmup_steps else "")

    def function(self, lr: float, steps: int) -> Callable[[int], float]:
        """``lr_at(t)`` for steps ``t = 0 .. steps-1``."""
        warm, decay = self.warmup_steps, steps - self.warmup_steps

        def lr_at(t: int) -> float:
            if t < warm:
                return lr * (t + 1) / warm
            u = t - warm
            if self.kind == "cosine":
                return self.min_lr + (lr - self.min_lr) * (1 + math.cos(math.pi * u / decay)) / 2
            if self.kind == "linear":
                return lr + (self.min_lr - lr) * u / decay
            if self.kind == "step":
                return lr * self.gamma ** (u // self.step_size)
            return lr

        return lr_at
