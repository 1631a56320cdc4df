"""Reverse-mode autodiff over ONNX graphs, into standard (default-domain) ONNX ops only.

Public surface:

- ``differentiable_values(graph, loss)``: the values the loss depends on through ops that pass a
  gradient (non-differentiable ops such as Shape cut the path).
- ``check_supported(graph, loss, wrt)``: raises ``UnsupportedOpsError`` naming *every* node on a path
  from ``wrt`` to ``loss`` whose op has no gradient rule.
- ``build_gradients(graph, loss, wrt)``: appends the backward nodes to ``graph`` and returns a
  ``Gradients`` with the gradient value of each ``wrt`` value and the order in which the backward
  finishes them (the order buckets are formed in).

Rules live in ``transpiler/autodiff/rules/``, one table keyed by ONNX op type.
"""

from ._backward import Gradients, build_gradients
from ._context import GradientError
from ._paths import check_supported, differentiable_values

__all__ = ["GradientError", "Gradients", "build_gradients", "check_supported", "differentiable_values"]
