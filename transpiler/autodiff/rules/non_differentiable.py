"""Ops that pass no gradient. They may lie on the path to the loss; the path is cut there."""

from transpiler.autodiff._registry import non_differentiable

# Sources, shape queries and integer/boolean results: there is nothing to differentiate.
non_differentiable(
    "Constant", "ConstantOfShape", "Shape", "Size", "Range", "EyeLike",
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf", "ArgMax", "ArgMin", "NonZero",
)  # fmt: skip

# Piecewise constant: the derivative is zero wherever it exists.
non_differentiable("Floor", "Ceil", "Round", "Sign", "Hardmax")

# One-hot encodings and bitwise ops produce masks or integers.
non_differentiable(
    "OneHot", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "NonMaxSuppression",
)  # fmt: skip
