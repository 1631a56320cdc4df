"""What the backend's rewrites of the step graph into native nodes share (cross_entropy.py,
scatter_add.py, parameter_casts.py, bias_grad.py, batchnorm_casts.py, layernorm_casts.py,
conv_data_grad.py): reading a node's attribute or a Constant's value, giving a fused node its ONNX
function (the nodes it replaced, renamed onto the function's formal names, so that a session that
cannot take it computes what the graph computed before) with its domain in the model's opsets, and
dropping the nodes it replaced.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def attribute(node: onnx.NodeProto, name: str, default=None):
    """The value of ``node``'s attribute ``name``, ``default`` where it has none."""
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def constant_value(node: onnx.NodeProto | None) -> np.ndarray | None:
    """The tensor of a Constant node's ``value``; None for any other node (or none)."""
    if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    value = attribute(node, "value")
    return None if value is None else numpy_helper.to_array(value)


def renamed(node: onnx.NodeProto, inputs: list[str], outputs: list[str]) -> onnx.NodeProto:
    """A copy of ``node`` (op, domain, attributes) over ``inputs`` and ``outputs``, unnamed: the
    replaced node as a line of its fused node's function."""
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.name = ""
    del copy.input[:], copy.output[:]
    copy.input.extend(inputs)
    copy.output.extend(outputs)
    return copy


def add_function(model: onnx.ModelProto, domain: str, op_type: str, inputs: list[str], outputs: list[str],
                 body: list[onnx.NodeProto], extra_opsets: tuple = ()) -> None:
    """Add the function ``domain::op_type`` of ``body`` (over the model's default-domain opset and
    ``extra_opsets``) to ``model``, and ``domain`` to its opsets where it is not there yet."""
    opsets = [o for o in model.opset_import if o.domain in ("", "ai.onnx")] + list(extra_opsets)
    model.functions.append(helper.make_function(domain, op_type, inputs, outputs, body, opsets))
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, 1))


def drop_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], dropped: set[int]) -> None:
    """``graph``'s nodes made ``nodes`` (its nodes as a rewrite read them, some changed in place)
    less the positions in ``dropped``, in order."""
    kept = [n for k, n in enumerate(nodes) if k not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
