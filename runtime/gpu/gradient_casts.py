"""The fused update reads a bfloat16 gradient itself: under ``--precision bf16`` a weight's gradient
comes out of a bfloat16 product (MatMul, Gemm, ConvWeightGrad) and the graph widens it with a
``Cast`` to float32 for the parameter's update (autocast's float32 ``.grad``). Where that Cast's
only reader is the update, ``fold_gradient_casts`` drops it, gives the update the bfloat16 value,
and marks the node (attribute ``GRADIENT_TYPE``); the update kernel (update_kernel.py) widens each
element as it reads it. Widening is exact, so the update computes on the same float32 values.

Why: GPT-2-small's bf16 step ran 73 such Casts on an H200 (0.31 ms a step), each writing a float32
copy of a weight's gradient that the update then read again: 6 bytes of traffic an element plus
the update's 4, where the update now reads 2. The gradients between the session and the update
also take half the memory, since the bfloat16 value crosses between them as it is
(buffers.bfloat16_edges).

Only for the GPU backend's native update (native.py's ``update`` row): the node's ONNX function
takes a float32 gradient, so the rewrite runs only where no session runs the node as its function.
"""

from __future__ import annotations

import onnx
from onnx import helper

from contract.ops import FUSED_UPDATE_DOMAIN
from runtime.gpu.rewrite_nodes import attribute, drop_nodes, readers_of, value_types

GRADIENT_TYPE = "gradient_type"  # attribute of a marked update: its gradient's ONNX element type
GRAD = 1  # the gradient's position among an update node's inputs (runtime/update_reference.py)


def fold_gradient_casts(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each fused update whose gradient is a Cast to float32 of a bfloat16 value,
    read by nothing else, reading that value instead (the module docstring); in place, returned."""
    graph = model.graph
    nodes = list(graph.node)
    producer = {name: k for k, node in enumerate(nodes) for name in node.output}
    readers = readers_of(nodes)
    types = value_types(graph)
    kept = {v.name for v in graph.output}
    dropped: set[int] = set()
    for position, node in enumerate(nodes):
        if node.domain != FUSED_UPDATE_DOMAIN or len(node.input) <= GRAD:
            continue
        grad = node.input[GRAD]
        k = producer.get(grad)
        cast = nodes[k] if k is not None else None
        if (cast is None or cast.op_type != "Cast" or cast.domain not in ("", "ai.onnx")
                or attribute(cast, "to") != onnx.TensorProto.FLOAT
                or types.get(cast.input[0], (None,))[0] != onnx.TensorProto.BFLOAT16
                or readers.get(grad) != [position] or grad in kept):
            continue
        node.input[GRAD] = cast.input[0]
        node.attribute.append(helper.make_attribute(GRADIENT_TYPE, onnx.TensorProto.BFLOAT16))
        dropped.add(k)
    if dropped:
        gone = {nodes[k].output[0] for k in dropped}
        drop_nodes(graph, nodes, dropped)
        info = [v for v in graph.value_info if v.name not in gone]
        del graph.value_info[:]
        graph.value_info.extend(info)
    return model


def bfloat16_gradients(nodes) -> frozenset[str]:
    """The gradients that update nodes marked by ``fold_gradient_casts`` read in bfloat16."""
    return frozenset(n.input[GRAD] for n in nodes if attribute(n, GRADIENT_TYPE) == onnx.TensorProto.BFLOAT16)
