"""runtime/gpu/in_session.py: which native nodes of a specialized segment become custom ops of its
session, and how the segment is rewritten for them (CPU: the ops are built, not run)."""

from __future__ import annotations

from types import SimpleNamespace

import onnx
import pytest
from conftest import one_graph_model
from onnx import TensorProto, helper

from runtime.errors import RunError
from runtime.gpu.elementwise_fusion import fuse_elementwise
from runtime.gpu.elementwise_steps import DOMAIN as ELEMENTWISE_DOMAIN
from runtime.gpu.in_session import DOMAIN, take_native_nodes
from runtime.specialize import specialize

_DEVICE = SimpleNamespace(provider="CUDAExecutionProvider")  # what the ops are declared for


class _Runners:
    """What take_native_nodes asks for: a runner per native node (recorded here)."""

    def __init__(self):
        self.groups = []

    def __call__(self, group, where):
        self.groups.append(group)
        return object()


def _fused_model():
    """x -> Mul(x, x) -> Exp -> Add(., b): one fused elementwise node over a batch-sized tensor."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("Exp", ["sq"], ["e"]),
             helper.make_node("Add", ["e", "b"], ["y"])]
    model = one_graph_model(nodes, [helper.make_tensor_value_info("x", f, ["N", 8]), helper.make_tensor_value_info("b", f, [8])],
                            [helper.make_tensor_value_info("y", f, ["N", 8])])
    fused = fuse_elementwise(model)
    assert [n.domain for n in fused.graph.node] == [ELEMENTWISE_DOMAIN]
    return fused


def test_a_native_node_with_static_shapes_becomes_a_custom_op_of_its_own():
    model = specialize(_fused_model(), {"x": (4, 8), "b": (8,)})
    original = onnx.NodeProto()
    original.CopyFrom(model.graph.node[0])  # take_native_nodes rewrites the model in place
    runners = _Runners()
    rewritten, ops = take_native_nodes(model, {ELEMENTWISE_DOMAIN}, runners, _DEVICE, "rank0.onnx: segment 0", (0, 0, 0))
    (node,) = rewritten.graph.node
    (op,) = ops
    assert node.domain == DOMAIN and node.op_type == op.name and not node.attribute
    assert list(node.input) == ["x", "b"] and list(node.output) == ["y"]
    assert op.input_types == [TensorProto.FLOAT, TensorProto.FLOAT] and op.output_types == [TensorProto.FLOAT]
    assert op.provider == "CUDAExecutionProvider"
    # The runner gets the node as it was (its domain, its kernel's attributes), one node per group.
    (group,) = runners.groups
    assert [n.domain for n in group.nodes] == [ELEMENTWISE_DOMAIN] and group.nodes[0].attribute == original.attribute
    assert op.compute.ins == [("x", (4, 8), op.compute.ins[0][2]), ("b", (8,), op.compute.ins[1][2])]
    assert op.compute.outs[0][:2] == ("y", (4, 8))
    # The function no node calls any more is gone; the session's domain is imported.
    assert not [f for f in rewritten.functions if f.domain == ELEMENTWISE_DOMAIN]
    assert DOMAIN in {o.domain for o in rewritten.opset_import}


def test_a_node_without_static_shapes_runs_as_its_function_and_one_without_a_function_is_an_error():
    model = _fused_model()  # not specialized: the batch dimension is symbolic
    rewritten, ops = take_native_nodes(model, {ELEMENTWISE_DOMAIN}, _Runners(), _DEVICE, "rank0.onnx: segment 0", (0, 0, 0))
    assert not ops and rewritten.graph.node[0].domain == ELEMENTWISE_DOMAIN
    assert [f.name for f in rewritten.functions] == [rewritten.graph.node[0].op_type]  # kept: onnxruntime runs it

    del model.functions[:]
    with pytest.raises(RunError, match=r"rank0.onnx: segment 0: node '.*fused_elementwise' \(graph_transpiler.elementwise"):
        take_native_nodes(model, {ELEMENTWISE_DOMAIN}, _Runners(), _DEVICE, "rank0.onnx: segment 0", (0, 0, 0))
