"""runtime/specialize.py: a segment specialized to its input shapes computes exactly what it computed
before, with every shape computation folded away (what CUDA graphs on the GPU backend need)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import one_graph_model
from onnx import TensorProto, helper, numpy_helper

from runtime.specialize import remaining_shape_ops, specialize

pytest.importorskip("torch")


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    # No onnxruntime graph optimizations: they fuse differently once scales are constants, which
    # is the point on a GPU but would hide whether folding itself is exact.
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_the_gpt_backward_has_no_shape_computation_left_and_is_bitwise_unchanged(gpt_train):
    model, feeds = gpt_train
    assert remaining_shape_ops(model), "the symbolic-batch graph computes shapes at run time"
    static = specialize(model, {name: value.shape for name, value in feeds.items()})
    assert remaining_shape_ops(static) == []
    assert "NonZero" not in {n.op_type for n in static.graph.node}
    assert len(static.graph.node) < len(model.graph.node)
    for before, after in zip(_run(model, feeds), _run(static, feeds)):
        np.testing.assert_array_equal(before, after)
    onnx.checker.check_model(static)


def test_transcendental_and_random_constants_are_left_to_the_device():
    """Exp of a constant may differ by an ulp between numpy and the device: never folded; random ops
    never; integer shape arithmetic always."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
    nodes = [
        helper.make_node("Exp", ["c"], ["e"]),
        helper.make_node("Mul", ["x", "e"], ["xe"]),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Reshape", ["xe", "s"], ["y"]),
        helper.make_node("RandomUniformLike", ["x"], ["r"]),
        helper.make_node("Add", ["x", "r"], ["z"]),
    ]
    model = one_graph_model(nodes, [x], [y, z], [numpy_helper.from_array(np.array(0.5, np.float32), "c")])
    static = specialize(model, {"x": (2, 3)})
    kept = [n.op_type for n in static.graph.node]
    assert "Shape" not in kept
    assert "Exp" in kept and "RandomUniformLike" in kept
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    np.testing.assert_array_equal(_run(model, feeds)[0], _run(static, feeds)[0])


def test_inputs_not_named_keep_their_symbolic_shape():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, ["m"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = one_graph_model([helper.make_node("Shape", ["w"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])],
                   [x, w], [y])
    static = specialize(model, {"x": (2, 3)})
    assert [n.op_type for n in static.graph.node] == ["Shape", "Reshape"]
    dims = static.graph.input[1].type.tensor_type.shape.dim
    assert dims[0].dim_param == "m"
