"""Names the training graphs give to values the runtime feeds or reads (docs/contracts.md)."""

from __future__ import annotations

LR_INPUT = "lr"  # the float32 scalar learning-rate input of every step graph
STEP_STATE = "optimizer.step"  # the shared step counter (optimizers whose table entry uses_step)
NEXT = ".next"  # suffix of a state input's updated output
ACC = ".acc"  # suffix of a gradient accumulator (gradient name + ACC)
AFTER_GRADIENTS = -2  # order of a collective that follows every gradient collective (the clip norm)
