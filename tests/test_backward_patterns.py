"""Backward formulations that look past one node (transpiler/autodiff/rules/activations.py).

- The exporters' exact GELU below opset 20 (x * (1 + erf(x / sqrt 2)) * 0.5) is differentiated as
  one piece: the gradient equals torch's, the backward reads only x (so the forward's intermediates
  die in the forward), and onnxruntime then fuses the forward into one Gelu kernel.
- Attention's softmax backward takes its row dot on the attention output (sum dO * O) instead of
  the [T, T] probabilities, with the same gradients as torch.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from transpiler.autodiff import build_gradients
from transpiler.native_ops import add_op_functions

# (how the exporter wrote x / sqrt 2, whether x is the Mul's second operand, Add's operand order)
VARIANTS = [("div", False, False), ("mul", True, True), ("mul_swapped", False, True)]


def _gelu_model(scaled: str, x_second: bool, one_first: bool) -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["inp", "w"], ["x"])]
    if scaled == "div":
        nodes.append(helper.make_node("Div", ["x", "sqrt2"], ["u"]))
    elif scaled == "mul":
        nodes.append(helper.make_node("Mul", ["x", "inv_sqrt2"], ["u"]))
    else:
        nodes.append(helper.make_node("Mul", ["inv_sqrt2", "x"], ["u"]))
    nodes += [
        helper.make_node("Erf", ["u"], ["e"]),
        helper.make_node("Add", ["one", "e"] if one_first else ["e", "one"], ["a"]),
        helper.make_node("Mul", ["a", "x"] if x_second else ["x", "a"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["y"]),
        helper.make_node("Mul", ["y", "c"], ["yc"]),
        helper.make_node("ReduceSum", ["yc"], ["loss"], keepdims=0),
    ]
    rng = np.random.default_rng(3)
    inits = {
        "w": rng.standard_normal((6, 5)).astype(np.float32),
        "c": rng.standard_normal((4, 5)).astype(np.float32),
        "sqrt2": np.array(math.sqrt(2), np.float32),
        "inv_sqrt2": np.array(1 / math.sqrt(2), np.float32),
        "one": np.array(1.0, np.float32),
        "half": np.array(0.5, np.float32),
    }
    graph = helper.make_graph(
        nodes, "gelu", [helper.make_tensor_value_info("inp", TensorProto.FLOAT, [4, 6])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


@pytest.mark.parametrize("scaled,x_second,one_first", VARIANTS)
def test_erf_gelu_gradient_matches_torch_and_reads_only_x(scaled, x_second, one_first, tmp_path):
    model = _gelu_model(scaled, x_second, one_first)
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    w = graph.initializers["w"]
    forward = list(graph)
    grads = build_gradients(graph, graph.outputs[0], [w])
    graph.outputs.append(grads.grads[w])

    # The forward intermediates between x and y have no reader outside the forward chain.
    backward = {node for node in graph if node not in set(forward)}
    for name in ("u", "e", "a"):
        value = next(v for n in forward for v in n.outputs if v.name == name)
        assert not any(use.node in backward for use in value.uses()), name

    proto = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    inp = np.random.default_rng(4).standard_normal((4, 6)).astype(np.float32)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    _, grad_w = session.run(None, {"inp": inp})

    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    tw = torch.tensor(inits["w"], requires_grad=True)
    (torch.nn.functional.gelu(torch.tensor(inp) @ tw) * torch.tensor(inits["c"])).sum().backward()
    np.testing.assert_allclose(grad_w, tw.grad.numpy(), rtol=1e-5, atol=1e-6)

    if scaled != "div":
        return
    # The TorchScript exporter's form (Div by sqrt 2): onnxruntime's own GeluFusion now applies,
    # the forward chain becomes one com.microsoft.Gelu (it did not while the backward read u and a).
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath)
    assert [n.op_type for n in optimized.graph.node if n.domain == "com.microsoft"].count("Gelu") == 1


def test_a_mul_that_only_looks_like_gelu_keeps_the_plain_rule():
    """x * (1 + erf(x / 2)): not GELU (the scale is not sqrt 2), so both factors get their gradient."""
    nodes = [
        helper.make_node("Div", ["x", "two"], ["u"]),
        helper.make_node("Erf", ["u"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["a"]),
        helper.make_node("Mul", ["x", "a"], ["m"]),
        helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
         numpy_helper.from_array(np.array(1.0, np.float32), "one")])
    model = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)]))
    ir_model = ir.serde.deserialize_model(model)
    g = ir_model.graph
    x = g.inputs[0]
    forward = set(g)
    result = build_gradients(g, g.outputs[0], [x])
    g.outputs.append(result.grads[x])
    # The plain rules: the Erf rule's Exp, and no recomputed Erf in the backward.
    assert not any(n.op_type == "Erf" for n in g if n not in forward)
    session = ort.InferenceSession(ir.serde.serialize_model(ir_model).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    xs = np.linspace(-2, 2, 5).astype(np.float32)
    _, grad = session.run(None, {"x": xs})
    tx = torch.tensor(xs, requires_grad=True)
    (tx * (1 + torch.erf(tx / 2))).sum().backward()
    np.testing.assert_allclose(grad, tx.grad.numpy(), rtol=1e-5, atol=1e-6)


def _attention_model(v_transposed: bool) -> onnx.ModelProto:
    """loss = sum(softmax(q @ k^T * s) @ v * c), q = inp @ wq; v (or its transpose) an input."""
    b, h, t, d = 2, 3, 5, 4
    nodes = [
        helper.make_node("MatMul", ["q_in", "wq"], ["q"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
        helper.make_node("Softmax", ["scaled"], ["p"], axis=-1),
    ]
    if v_transposed:  # v arrives as (b, h, d, t), transposed in the graph: dy's MatMul reads v^T^T
        nodes.append(helper.make_node("Transpose", ["v_in"], ["v"], perm=[0, 1, 3, 2]))
    nodes += [
        helper.make_node("MatMul", ["p", "v" if v_transposed else "v_in"], ["o"]),
        helper.make_node("Mul", ["o", "c"], ["oc"]),
        helper.make_node("ReduceSum", ["oc"], ["loss"], keepdims=0),
    ]
    rng = np.random.default_rng(7)
    inits = {"wq": rng.standard_normal((d, d)).astype(np.float32),
             "c": rng.standard_normal((b, h, t, d)).astype(np.float32),
             "scale": np.array(0.5, np.float32)}
    v_shape = [b, h, d, t] if v_transposed else [b, h, t, d]
    graph = helper.make_graph(
        nodes, "attn",
        [helper.make_tensor_value_info("q_in", TensorProto.FLOAT, [b, h, t, d]),
         helper.make_tensor_value_info("k", TensorProto.FLOAT, [b, h, t, d]),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, v_shape)],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


@pytest.mark.parametrize("v_transposed", [False, True])
def test_softmax_row_dot_is_taken_on_the_attention_output(v_transposed):
    model = _attention_model(v_transposed)
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    wanted = [graph.initializers["wq"], *(v for v in graph.inputs if v.name in ("k", "v_in"))]
    forward = set(graph)
    grads = build_gradients(graph, graph.outputs[0], wanted)
    graph.outputs.extend(grads.grads[v] for v in wanted)
    # No backward reduction reads a (.., T, T) tensor: the row dot reduces the (.., T, d) product.
    t, d = 5, 4
    for node in graph:
        if node not in forward and node.op_type == "ReduceSum":
            assert list(node.inputs[0].shape)[-2:] == [t, d], node.name

    rng = np.random.default_rng(8)
    feeds = {i.name: rng.standard_normal([x.dim_value for x in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in model.graph.input}
    session = ort.InferenceSession(ir.serde.serialize_model(ir_model).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    _, grad_wq, grad_k, grad_v = session.run(None, feeds)

    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    tw = torch.tensor(inits["wq"], requires_grad=True)
    tk = torch.tensor(feeds["k"], requires_grad=True)
    tv = torch.tensor(feeds["v_in"], requires_grad=True)
    v = tv.transpose(-1, -2) if v_transposed else tv
    p = torch.softmax(torch.tensor(feeds["q_in"]) @ tw @ tk.transpose(-1, -2) * 0.5, dim=-1)
    ((p @ v) * torch.tensor(inits["c"])).sum().backward()
    for got, want in ((grad_wq, tw.grad), (grad_k, tk.grad), (grad_v, tv.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


def _cross_entropy_gradient(scores_shape, x, labels):
    nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss"],
                              reduction="mean", ignore_index=-100)]
    graph = helper.make_graph(
        nodes, "ce",
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, list(scores_shape)),
         helper.make_tensor_value_info("labels", TensorProto.INT64, list(labels.shape))],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)]))
    ir_model = ir.serde.deserialize_model(model)
    g = ir_model.graph
    scores = g.inputs[0]
    g.outputs.append(build_gradients(g, g.outputs[0], [scores]).grads[scores])
    add_op_functions(ir_model)  # the SoftmaxCrossEntropyGrad node's function (transpiler/loss_ops.py)
    ops = {n.op_type for n in g} | {n.op_type for f in ir_model.functions.values() for n in f.graph}
    session = ort.InferenceSession(ir.serde.serialize_model(ir_model).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"scores": x, "labels": labels})[1], ops


@pytest.mark.parametrize("scores_shape", [(6, 5), (3, 5, 4)])
def test_cross_entropy_gradient_equals_the_one_hot_form_bit_for_bit(scores_shape, monkeypatch):
    """The label's element gets p - 1 by ScatterElements, the others stay p: the same float ops
    as c * (exp(log_prob) - onehot), so the same bits; ignored labels (-100) get no gradient. 2-D
    scores get one SoftmaxCrossEntropyGrad node, whose function computes those same bits."""
    from transpiler.autodiff.rules import losses

    rng = np.random.default_rng(9)
    x = rng.standard_normal(scores_shape).astype(np.float32)
    labels = rng.integers(0, scores_shape[1], size=[scores_shape[0], *scores_shape[2:]])
    labels.reshape(-1)[1] = -100
    grad, ops = _cross_entropy_gradient(scores_shape, x, labels)
    assert "ScatterElements" in ops and "Range" not in ops
    assert ("SoftmaxCrossEntropyGrad" in ops) == (len(scores_shape) == 2)
    monkeypatch.setattr(losses, "_one_node_applies", lambda *_: False)
    monkeypatch.setattr(losses, "_minus_one_at_labels",
                        lambda ctx, prob, safe: ctx.op("Sub", [prob, losses._class_mask(ctx, prob, safe)]))
    one_hot, ops = _cross_entropy_gradient(scores_shape, x, labels)
    assert "Range" in ops
    np.testing.assert_array_equal(grad, one_hot)
    ignored = np.unravel_index(1, labels.shape)
    assert not grad[(ignored[0], slice(None), *ignored[1:])].any()  # the ignored label's sample


def _chain_with(one: np.ndarray, sqrt2: np.ndarray) -> onnx.ModelProto:
    """loss = sum(x * (erf(x / sqrt2) + one) * 0.5), x = inp @ w; ``one`` and ``sqrt2`` initializers."""
    nodes = [helper.make_node("MatMul", ["inp", "w"], ["x"]),
             helper.make_node("Div", ["x", "sqrt2"], ["u"]),
             helper.make_node("Erf", ["u"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["a"]),
             helper.make_node("Mul", ["x", "a"], ["m"]),
             helper.make_node("Mul", ["m", "half"], ["y"]),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    inits = {"w": np.random.default_rng(5).standard_normal((3, 5)).astype(np.float32), "one": one, "sqrt2": sqrt2,
             "half": np.array(0.5, np.float32)}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("inp", TensorProto.FLOAT, [4, 3])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return onnx.shape_inference.infer_shapes(
        helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)]), strict_mode=True)


def _gradients(model: onnx.ModelProto, wrt: list[str], inp: np.ndarray) -> list[np.ndarray]:
    ir_model = ir.serde.deserialize_model(model)
    g = ir_model.graph
    values = [g.initializers[name] for name in wrt]
    result = build_gradients(g, g.outputs[0], values)
    g.outputs.extend(result.grads[v] for v in values)
    session = ort.InferenceSession(ir.serde.serialize_model(ir_model).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"inp": inp})[1:]


def test_trained_constants_of_the_gelu_chain_keep_their_gradients():
    """A chain whose 1 and sqrt 2 are trained initializers is no GELU to the rule: they get gradients."""
    one, sqrt2 = np.array([1.0], np.float32), np.array([math.sqrt(2)], np.float32)
    inp = np.random.default_rng(6).standard_normal((4, 3)).astype(np.float32)
    grad_w, grad_one, grad_sqrt2 = _gradients(_chain_with(one, sqrt2), ["w", "one", "sqrt2"], inp)
    model = _chain_with(one, sqrt2)
    w = torch.tensor(numpy_helper.to_array(model.graph.initializer[0]), requires_grad=True)
    t_one, t_sqrt2 = torch.tensor(one, requires_grad=True), torch.tensor(sqrt2, requires_grad=True)
    x = torch.tensor(inp) @ w
    (x * (torch.erf(x / t_sqrt2) + t_one) * 0.5).sum().backward()
    for got, want in ((grad_w, w.grad), (grad_one, t_one.grad), (grad_sqrt2, t_sqrt2.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
    assert abs(grad_one[0]) > 1e-3


def test_a_gelu_chain_whose_constant_broadcasts_x_up_keeps_the_plain_rule():
    """A size-1 constant of higher rank than x makes the product [1, 4, 5]: the plain rules sum the
    gradient back to x's shape (the whole-chain rule would not), so they apply."""
    one = np.ones((1, 1, 1), np.float32)
    inp = np.random.default_rng(7).standard_normal((4, 3)).astype(np.float32)
    model = _chain_with(one, np.array(math.sqrt(2), np.float32))
    (grad_w,) = _gradients(model, ["w"], inp)
    w = torch.tensor(numpy_helper.to_array(model.graph.initializer[0]), requires_grad=True)
    torch.nn.functional.gelu(torch.tensor(inp) @ w).sum().backward()
    np.testing.assert_allclose(grad_w, w.grad.numpy(), rtol=1e-5, atol=1e-6)
