"""Where the Reduce rules (transpiler/autodiff/rules/reduce.py) leave the smooth case: zeros in a
ReduceProd group and an all-zero ReduceL2 group, against torch's autograd (finite differences cannot
reach a point the random specs never sample)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from transpiler.autodiff import build_gradients

torch = pytest.importorskip("torch")


def _gradient(op: str, x: np.ndarray, axes: list[int], keepdims: int) -> np.ndarray:
    """d sum(c * op(x)) / dx from the rule, for the fixed cotangent c = 1, 2, 3, ..."""
    nodes = [
        helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims, name="op"),
        helper.make_node("Mul", ["y", "c"], ["yc"]),
        helper.make_node("ReduceSum", ["yc"], ["loss"], keepdims=0),
    ]
    reduced = np.sum(x, axis=tuple(axes), keepdims=bool(keepdims))
    inits = [onnx.numpy_helper.from_array(np.array(axes, np.int64), "axes"),
             onnx.numpy_helper.from_array(np.arange(1, reduced.size + 1, dtype=np.float64).reshape(reduced.shape), "c")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, list(x.shape))],
                              [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])], inits)
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(
        helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)])))
    x_value = model.graph.inputs[0]
    model.graph.outputs.append(build_gradients(model.graph, model.graph.outputs[0], [x_value]).grads[x_value])
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[1]


def _torch_gradient(fn, x: np.ndarray) -> np.ndarray:
    t = torch.tensor(x, requires_grad=True)
    y = fn(t)
    (y * torch.arange(1, y.numel() + 1, dtype=torch.float64).reshape(y.shape)).sum().backward()
    return t.grad.numpy()


def test_reduce_prod_with_zeros_matches_torch():
    # Rows: no zero, one zero (only it gets a gradient: the product of the others), two zeros (none).
    x = np.array([[1.5, -2.0, 0.5], [3.0, 0.0, -1.5], [0.0, 2.0, 0.0]])
    np.testing.assert_allclose(_gradient("ReduceProd", x, [1], 0), _torch_gradient(lambda t: t.prod(dim=1), x),
                               rtol=1e-12)
    np.testing.assert_allclose(_gradient("ReduceProd", x, [0], 1),
                               _torch_gradient(lambda t: t.prod(dim=0, keepdim=True), x), rtol=1e-12)


def test_reduce_l2_of_zeros_matches_torch():
    # torch's norm backward gives 0 where the norm is 0 (not NaN from 0 / 0).
    x = np.array([[0.0, 0.0, 0.0], [3.0, -4.0, 0.0]])
    got = _gradient("ReduceL2", x, [1], 1)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, _torch_gradient(lambda t: torch.linalg.vector_norm(t, dim=1, keepdim=True), x),
                               rtol=1e-12)
