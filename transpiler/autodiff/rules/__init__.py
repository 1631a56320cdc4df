"""Gradient rules, one table keyed by ONNX op type; importing this package registers them all.

Modules group rules by kind of op; each rule is a small function registered with a decorator from
``transpiler.autodiff._registry`` (see docs/ops.md for how to add one).
"""

from . import (
    activation_set,
    activations,
    attention,
    batchnorm,
    collectives,
    conv,
    elementwise,
    indexing,
    linalg,
    losses,
    lstm_gru,
    non_differentiable,
    normalization,
    reduce,
    sequences,
    shape_ops,
)

__all__ = [
    "activation_set",
    "activations",
    "attention",
    "batchnorm",
    "collectives",
    "conv",
    "elementwise",
    "indexing",
    "linalg",
    "losses",
    "lstm_gru",
    "non_differentiable",
    "normalization",
    "reduce",
    "sequences",
    "shape_ops",
]
