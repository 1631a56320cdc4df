"""Names the step and init graphs give to the values the transpiler adds (docs/contracts.md).

The plan lists the actual names (``lr_input``, ``state[].input/output``, ``accumulators[]``); the
runtime reads them from there. These are the rules the writer follows to make them.
"""

from __future__ import annotations

LR_INPUT = "lr"  # the float32 scalar learning rate fed every step
STEP_STATE = "optimizer.step"  # the step counter's state input
# With --clip-grad-norm: the step graph's output holding the global squared L2 norm of the
# gradients (every rank holds the same value), which the runtime checks like the loss.
GRAD_NORM_OUTPUT = "grad_norm.squared.global"
NEXT = ".next"  # a state input's updated output is named input + NEXT
ACC = ".acc"  # a gradient accumulator input is named gradient + ACC (its output + NEXT)
GRAD_PREFIX = "grad."  # the gradient of parameter P is named GRAD_PREFIX + P


def next_name(state_input: str) -> str:
    """The output that carries ``state_input``'s value after a step."""
    return state_input + NEXT


def grad_name(param: str) -> str:
    return GRAD_PREFIX + param
