"""LayerNormalization as a native node, with the Cast to bfloat16 after it folded in.

The precision pass keeps LayerNormalization in float32 (torch.autocast's list, docs/precision.md),
so a bf16 transformer's step graph holds, per LayerNorm,

    X -> LayerNormalization -> (Y, mean, inv_std_dev);  Y -> Cast(bfloat16) -> MatMul ...

onnxruntime's kernel writes Y in float32 and a second kernel rounds it: two passes over the
activation where one reads X and writes the bfloat16 Y (GPT-2-small: 25 of each, 0.47 ms of an
11.3 ms step on an H200). The rewrite makes each LayerNormalization over the last axis whose X,
scale and B are float32 (as the graph's value types say; scale and B of X's width, unbroadcast) and
whose three outputs are all named (a training step: the gradient reads the statistics) one node of
``DOMAIN`` that layernorm.py's
``layer_norm_forward`` runs; where Y is read by one Cast to bfloat16 and otherwise only by Shape
nodes (shapes are dtype-blind), the Cast's value becomes the node's Y and the Shape nodes read
it. A float32 step gets the node too (one kernel at the memory's speed instead of onnxruntime's).

The fused node keeps the node's attributes and carries a function (the node, and the Cast), so a
session that cannot take it computes what the graph computed before; the kernel computes the same
up to float32 rounding (its sums' order; docs/gpu.md).
"""

from __future__ import annotations

import onnx
from onnx import helper

from runtime.gpu.layernorm import FORWARD
from runtime.gpu.rewrite_nodes import add_function, attribute, drop_nodes, readers_of, renamed, value_types

DOMAIN = "graph_transpiler.gpu.layernorm"  # the runtime's own: the fused nodes of this rewrite


def _float_rows(types: dict, inputs: list[str]) -> bool:
    """Whether X, scale (and B) are float32 and scale (and B) of shape [C], C X's last dimension
    where that is static: the kernel's contract (ONNX lets them broadcast; such a node stays)."""
    known = [types.get(name, (None, None)) for name in inputs]
    if any(dtype != onnx.TensorProto.FLOAT for dtype, _ in known):
        return False
    x, *rows = (dims for _, dims in known)
    widths = {dims[0] if dims is not None and len(dims) == 1 else None for dims in rows}
    width = widths.pop() if len(widths) == 1 else None
    return width is not None and bool(x) and x[-1] in (None, width)


def fold_layernorms(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each LayerNormalization the module docstring names made one ``DOMAIN``
    node, in place; returned."""
    graph = model.graph
    nodes = list(graph.node)
    readers = readers_of(nodes)
    types = value_types(graph)
    outputs = {o.name for o in graph.output}
    dropped: set[int] = set()
    fused = 0
    for node in nodes:
        if node.op_type != "LayerNormalization" or node.domain not in ("", "ai.onnx") or attribute(node, "axis", -1) != -1 \
                or attribute(node, "stash_type", 1) != 1 or len(node.output) != 3 or not all(node.output) \
                or not all(node.input) or not _float_rows(types, list(node.input)):
            continue
        y = node.output[0]
        after = [k for k in readers.get(y, []) if nodes[k].op_type != "Shape"]
        narrow = nodes[after[0]] if len(after) == 1 and y not in outputs else None
        if narrow is not None and (narrow.op_type != "Cast" or attribute(narrow, "to") != onnx.TensorProto.BFLOAT16):
            narrow = None
        formal_in = [f"i{j}" for j in range(len(node.input))]
        formal_out = ["o0", "o1", "o2"]
        body = [renamed(node, formal_in, ["wide0" if narrow is not None else "o0", "o1", "o2"])]
        outs = list(node.output)
        if narrow is not None:
            body.append(helper.make_node("Cast", ["wide0"], ["o0"], to=onnx.TensorProto.BFLOAT16))
            outs[0] = narrow.output[0]
            dropped.add(after[0])
            for k in readers.get(y, []):
                if k not in dropped:  # a Shape
                    nodes[k].input[0] = outs[0]
        op_type = f"{FORWARD}_{fused}"
        add_function(model, DOMAIN, op_type, formal_in, formal_out, body)
        del node.output[:]
        node.output.extend(outs)
        node.domain, node.op_type, node.name = DOMAIN, op_type, node.name or op_type
        fused += 1
    if dropped:
        drop_nodes(graph, nodes, dropped)
    return model
