"""BatchNorm reading and writing bfloat16: the casts around each training BatchNorm node of a
``--precision bf16`` step graph folded into it.

The precision pass keeps BatchNorm in float32 (torch.autocast's list, docs/precision.md), so a bf16
ResNet's step graph holds, per BatchNorm,

    Xb -> Cast(float32) -> BatchNormTraining -> Y -> Cast(bfloat16) -> Relu ...
    dYb -> Cast(float32) -> BatchNormTrainingGrad(dY, X as float32, ...) -> dX -> Cast(bfloat16) -> ...

Four passes over the activation in casts, and a float32 copy of X kept from the forward to the
backward. batchnorm.py's kernels read and write bfloat16 with float32 statistics and arithmetic,
which is what the casts computed: the rewrite makes each such node one node of ``DOMAIN`` that reads
the casts' inputs and writes the output Cast's value; a Cast that nothing reads any more goes.

A node is fused where its first output (Y, dX) is read only by one Cast to bfloat16; its X (and dY)
are read through a Cast to float32 where one produced them. A forward node whose Y (the bfloat16
one, or a float32 Y with no Cast after it) only a Relu reads takes the Relu in too (attribute
``relu``; the kernel applies it before rounding, which is the same value: rounding keeps signs and
zero): one pass over the activation less (ResNet-18: 9 of its 20 BatchNorms, in bf16 and float32). The fused node keeps the node's
attributes and carries a function (the casts around the original node), so a session that cannot
take it (in_session.TAKES: float32 and bfloat16 only) computes what the graph computed before.
"""

from __future__ import annotations

import onnx
from onnx import helper

from contract.ops import BATCHNORM_DOMAIN, BATCHNORM_TRAINING, BATCHNORM_TRAINING_GRAD, BATCHNORM_VERSION
from runtime.gpu.rewrite_nodes import add_function, attribute, drop_nodes, readers_of, renamed

DOMAIN = "graph_transpiler.gpu.batchnorm"  # the runtime's own: the fused nodes of this rewrite
_WIDE_INPUTS = {BATCHNORM_TRAINING: (0,), BATCHNORM_TRAINING_GRAD: (0, 1)}  # X; dY and X


def fold_batchnorm_casts(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each training BatchNorm node whose first output only a Cast to bfloat16 reads
    made one ``DOMAIN`` node (the module docstring), in place; returned."""
    graph = model.graph
    nodes = list(graph.node)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output}
    readers = readers_of(nodes)
    outputs = {o.name for o in graph.output}
    dropped: set[int] = set()
    widened: set[int] = set()  # input Casts the fused nodes now read around
    fused = 0
    for node in nodes:
        if node.domain != BATCHNORM_DOMAIN or node.op_type not in _WIDE_INPUTS:
            continue
        after = readers.get(node.output[0], [])
        if node.output[0] in outputs:
            continue
        narrow = nodes[after[0]] if len(after) == 1 else None
        if narrow is not None and (narrow.op_type != "Cast" or attribute(narrow, "to") != onnx.TensorProto.BFLOAT16):
            narrow = None
        forward = node.op_type == BATCHNORM_TRAINING
        if narrow is not None:  # bfloat16 Y, and a Relu after its Cast
            relu = _only_relu(nodes, readers.get(narrow.output[0], [])) \
                if forward and narrow.output[0] not in outputs else None
        else:  # float32 Y read by a Relu alone
            relu = _only_relu(nodes, after) if forward else None
            if relu is None:
                continue
        inputs, outs = list(node.input), list(node.output)
        formal_in = [f"i{j}" for j in range(len(inputs))]
        formal_out = [f"o{j}" for j in range(len(outs))]
        body, inner_in = [], list(formal_in)
        for j in _WIDE_INPUTS[node.op_type] if narrow is not None else ():
            k = producer.get(inputs[j])
            cast = None if k is None else nodes[k]
            if cast is not None and cast.op_type == "Cast" and attribute(cast, "to") == onnx.TensorProto.FLOAT:
                inputs[j], inner_in[j] = cast.input[0], f"w{j}"
                body.append(helper.make_node("Cast", [formal_in[j]], [inner_in[j]], to=onnx.TensorProto.FLOAT))
                widened.add(k)
        y = "wide0"
        body.append(renamed(node, inner_in, [y, *formal_out[1:]]))
        if narrow is not None:
            y = "narrow0" if relu is not None else formal_out[0]
            body.append(helper.make_node("Cast", ["wide0"], [y], to=onnx.TensorProto.BFLOAT16))
        if relu is not None:
            body.append(helper.make_node("Relu", [y], [formal_out[0]]))
        op_type = f"{node.op_type}_{fused}"
        add_function(model, DOMAIN, op_type, formal_in, formal_out, body,
                     extra_opsets=(helper.make_opsetid(BATCHNORM_DOMAIN, BATCHNORM_VERSION),))
        if narrow is not None:
            outs[0] = narrow.output[0]
            dropped.add(after[0])
        if relu is not None:
            outs[0] = nodes[relu].output[0]
            dropped.add(relu)
            node.attribute.append(helper.make_attribute("relu", 1))
        del node.input[:], node.output[:]
        node.input.extend(inputs)
        node.output.extend(outs)
        node.domain, node.op_type = DOMAIN, op_type
        fused += 1
    if fused:
        still_read = {name for name, at in readers_of(nodes).items() if any(k not in dropped for k in at)}
        dropped |= {k for k in widened if nodes[k].output[0] not in still_read and nodes[k].output[0] not in outputs}
        drop_nodes(graph, nodes, dropped)
    return model


def _only_relu(nodes: list[onnx.NodeProto], readers: list[int]) -> int | None:
    """The index of the one Relu (of the default domain) that ``readers`` are, or None."""
    if len(readers) != 1:
        return None
    node = nodes[readers[0]]
    return readers[0] if node.op_type == "Relu" and node.domain in ("", "ai.onnx") else None
