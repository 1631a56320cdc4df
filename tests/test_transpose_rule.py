"""Transpose's gradient when the gradient arriving is a Gemm's output (transpiler/autodiff/rules/
shape_ops.py): the rule then writes the transposed product as one Gemm with swapped operands and
flipped trans flags, which is right only for a Transpose that swaps the two axes.

dynamo writes an identity ``Transpose(perm=[0, 1])`` after the ``aten.index.Tensor`` of CLIP's
text pooling (``hidden[arange(B), eos_positions]``, a GatherND), and the projection behind it is a
MatMul whose input gradient is a Gemm: the shortcut transposed that gradient, and the GatherND's
ScatterND failed at run time on a [32, 6] update for a [6, 32] value (the zoo's clip, dynamo 18).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from transpiler.autodiff import build_gradients

F64 = TensorProto.DOUBLE


def _gradients(perm: list[int] | None, x_shape: list[int]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """loss = sum(c * (Transpose(x, perm) @ w)); returns (feeds, gradients of x and w)."""
    attrs = {} if perm is None else {"perm": perm}
    moved = list(reversed(x_shape)) if perm is None else [x_shape[p] for p in perm]
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], **attrs),
        helper.make_node("MatMul", ["xt", "w"], ["y"]),
        helper.make_node("Mul", ["y", "c"], ["yc"]),
        helper.make_node("ReduceSum", ["yc"], ["loss"], keepdims=0),
    ]
    w_shape, c_shape = [moved[-1], 3], [*moved[:-1], 3]
    graph = helper.make_graph(
        nodes, "transpose",
        [helper.make_tensor_value_info("x", F64, x_shape), helper.make_tensor_value_info("w", F64, w_shape),
         helper.make_tensor_value_info("c", F64, c_shape)],
        [helper.make_tensor_value_info("loss", F64, [])])
    proto = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)])
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto, strict_mode=True))
    graph_ir = model.graph
    values = {v.name: v for v in graph_ir.inputs}
    result = build_gradients(graph_ir, graph_ir.outputs[0], [values["x"], values["w"]])
    graph_ir.outputs.extend([result.grads[values["x"]], result.grads[values["w"]]])
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(x_shape), "w": rng.standard_normal(w_shape), "c": rng.standard_normal(c_shape)}
    session = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    dx, dw = session.run(["grad.x", "grad.w"], feeds)
    return feeds, {"x": dx, "w": dw}


@pytest.mark.parametrize("perm,x_shape", [
    ([0, 1], [6, 4]),  # identity: the CLIP text pooling under dynamo
    ([1, 0], [4, 6]),  # the swap the Gemm shortcut is for
    (None, [4, 6]),  # no perm: reversed axes, a swap for rank 2
    ([0, 1, 2], [2, 6, 4]),
    ([1, 0, 2], [6, 2, 4]),
], ids=["identity", "swap", "default", "identity-3d", "batch-swap-3d"])
def test_transpose_gradient_behind_a_gemm_keeps_the_input_shape(perm, x_shape):
    feeds, grads = _gradients(perm, x_shape)
    x, w, c = feeds["x"], feeds["w"], feeds["c"]
    xt = np.transpose(x, perm)
    assert grads["x"].shape == x.shape
    # d loss / d xt = c @ w^T, moved back through the inverse permutation
    inverse = None if perm is None else np.argsort(perm)
    np.testing.assert_allclose(grads["x"], np.transpose(c @ w.T, inverse), rtol=1e-12)
    np.testing.assert_allclose(grads["w"], xt.reshape(-1, xt.shape[-1]).T @ c.reshape(-1, c.shape[-1]), rtol=1e-12)
