"""The body of a model-local ONNX function, built node by node (the functions of the transpiler's
own ops: transpiler/conv_grad.py, transpiler/batchnorm_ops.py).

Bodies are polymorphic: formals and values carry no types or shapes, and attributes of the calling
node reach the body through attribute references (``ir.RefAttr``).
"""

from __future__ import annotations

import onnx_ir as ir


class FunctionBody:
    """Default-domain nodes in order, each named ``{op_type}_{k}`` and its output ``{op_type}_{k}`` in
    lower case; ``function`` makes them the body of one function."""

    def __init__(self):
        self.nodes: list[ir.Node] = []

    def op(self, op_type: str, inputs: list[ir.Value], attributes: list[ir.Attr] = ()) -> ir.Value:
        node = ir.Node("", op_type, inputs, list(attributes), name=f"{op_type}_{len(self.nodes)}")
        node.outputs[0].name = f"{op_type.lower()}_{len(self.nodes)}"
        self.nodes.append(node)
        return node.outputs[0]

    def ints(self, values: list[int]) -> ir.Value:
        """A constant int64 vector."""
        return self.op("Constant", [], [ir.Attr("value_ints", ir.AttributeType.INTS, values)])

    def function(self, domain: str, op_type: str, inputs: list[ir.Value], outputs: dict[str, ir.Value],
                 attributes: dict[str, ir.AttributeType], opset: int, doc: str) -> ir.Function:
        """The function ``domain::op_type`` of these nodes: formal ``inputs``, ``outputs`` by their
        names in the signature, the node attributes it declares (name -> type)."""
        for name, value in outputs.items():
            value.name = name
        graph = ir.Graph(inputs, list(outputs.values()), nodes=self.nodes, opset_imports={"": opset}, name=op_type)
        function = ir.Function(domain, op_type, graph=graph,
                               attributes=[ir.Attr(name, kind, None) for name, kind in attributes.items()])
        function.doc_string = doc
        return function
