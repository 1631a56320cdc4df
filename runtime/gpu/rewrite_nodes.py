"""What the backend's rewrites of the step graph into native nodes share (cross_entropy.py,
scatter_add.py, parameter_casts.py, bias_grad.py, batchnorm_casts.py, layernorm_casts.py,
conv_data_grad.py): reading a node's attribute or a Constant's value, giving a fused node its ONNX
function (the nodes it replaced, renamed onto the function's formal names, so that a session that
cannot take it computes what the graph computed before) with its domain in the model's opsets,
dropping the nodes it replaced, and the graph's readers and value types they decide by.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from contract.collectives import consumed


def attribute(node: onnx.NodeProto, name: str, default=None):
    """The value of ``node``'s attribute ``name``, ``default`` where it has none."""
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def constant_value(node: onnx.NodeProto | None) -> np.ndarray | None:
    """The tensor of a Constant node's ``value``; None for any other node (or none)."""
    if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    value = attribute(node, "value")
    return None if value is None else numpy_helper.to_array(value)


def readers_of(nodes: list[onnx.NodeProto]) -> dict[str, list[int]]:
    """Each value's readers: the positions in ``nodes`` of the nodes that take it as an input, or
    whose subgraphs (If, Loop, Scan bodies) read it from the outer scope (``consumed``), so that no
    rewrite drops a value a body reads."""
    readers: dict[str, list[int]] = {}
    for k, node in enumerate(nodes):
        for name in consumed(node):
            readers.setdefault(name, []).append(k)
    return readers


def value_types(graph: onnx.GraphProto) -> dict[str, tuple[int, list[int | None] | None]]:
    """Each typed value's (element type, dimensions): an int where static, None where not; the
    dimensions None where the rank is unknown. From the graph's inputs, value_info, outputs and
    initializers."""
    types = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        t = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim] if t.HasField("shape") else None
        types[value.name] = (t.elem_type, dims)
    types.update((t.name, (t.data_type, list(t.dims))) for t in graph.initializer)
    return types


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
