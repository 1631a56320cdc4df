"""Whole-graph autodiff: fan-in sums, an MLP against torch autograd, symbolic batch, path finding."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from transpiler.autodiff import GradientError, build_gradients, check_supported, differentiable_values
from transpiler.errors import TranspileError, UnsupportedOpsError
from transpiler.native_ops import add_op_functions

OPSET = 18


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("test.custom", 1)]
    model = helper.make_model(graph, ir_version=10, opset_imports=opsets)
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def _differentiate(model: onnx.ModelProto, wrt: list[str]):
    """build_gradients on the model; returns (session, Gradients, graph) with grads as outputs."""
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    values = {v.name: v for v in (*graph.inputs, *graph.initializers.values())}
    result = build_gradients(graph, graph.outputs[0], [values[n] for n in wrt])
    graph.outputs.extend(result.grads[values[n]] for n in wrt)
    add_op_functions(ir_model)
    proto = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session, result, graph


def test_gradients_of_a_value_used_twice_are_summed():
    # loss = sum(x * x + x): x feeds Mul twice and Add once, so dL/dx = 2x + 1 from three parts.
    model = _model(
        [
            helper.make_node("Mul", ["x", "x"], ["sq"]),
            helper.make_node("Add", ["sq", "x"], ["s"]),
            helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0),
        ],
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [5])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
    )
    session, result, graph = _differentiate(model, ["x"])
    x = np.linspace(-1, 1, 5)
    _, grad = session.run(None, {"x": x})
    np.testing.assert_allclose(grad, 2 * x + 1, rtol=1e-12)
    final = result.grads[graph.inputs[0]]
    assert final.name == "grad.x"
    assert final.producer().op_type == "Sum" and len(final.producer().inputs) == 3


def _mlp(loss_form: str, batch: int | str) -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    params = {
        "fc1.weight": rng.standard_normal((8, 4)).astype(np.float32) * 0.5,
        "fc1.bias": rng.standard_normal(8).astype(np.float32) * 0.1,
        "fc2.weight": rng.standard_normal((3, 8)).astype(np.float32) * 0.5,
        "fc2.bias": rng.standard_normal(3).astype(np.float32) * 0.1,
    }
    initializers = [numpy_helper.from_array(v, k) for k, v in params.items()]
    nodes = [
        helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h"], name="/fc1/Gemm", transB=1),
        helper.make_node("Relu", ["h"], ["a"], name="/relu/Relu"),
        helper.make_node("Gemm", ["a", "fc2.weight", "fc2.bias"], ["out"], name="/fc2/Gemm", transB=1),
        helper.make_node("Sub", ["out", "target"], ["diff"], name="/loss/Sub"),
    ]
    if loss_form == "pow":
        initializers.append(numpy_helper.from_array(np.array(2.0, np.float32), "two"))
        nodes += [
            helper.make_node("Pow", ["diff", "two"], ["sq"], name="/loss/Pow"),
            helper.make_node("ReduceMean", ["sq"], ["loss"], name="/loss/ReduceMean", keepdims=0),
        ]
    else:
        initializers.append(numpy_helper.from_array(np.array([0, 1], np.int64), "axes"))
        nodes += [
            helper.make_node("Mul", ["diff", "diff"], ["sq"], name="/loss/Mul"),
            helper.make_node("ReduceMean", ["sq", "axes"], ["loss"], name="/loss/ReduceMean", keepdims=0),
        ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4]),
        helper.make_tensor_value_info("target", TensorProto.FLOAT, [batch, 3]),
    ]
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    return _model(nodes, inputs, outputs, initializers)


PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def _torch_grads(
    model: onnx.ModelProto, x: np.ndarray, target: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    params = {
        init.name: torch.tensor(numpy_helper.to_array(init), requires_grad=True)
        for init in model.graph.initializer
        if init.name in PARAMS
    }
    hidden = torch.relu(torch.nn.functional.linear(torch.tensor(x), params["fc1.weight"], params["fc1.bias"]))
    out = torch.nn.functional.linear(hidden, params["fc2.weight"], params["fc2.bias"])
    loss = torch.mean((out - torch.tensor(target)) ** 2)
    loss.backward()
    return loss.item(), {k: p.grad.numpy() for k, p in params.items()}


@pytest.mark.parametrize("loss_form", ["pow", "mul"])
def test_mlp_gradients_match_torch(loss_form: str):
    model = _mlp(loss_form, batch=6)
    session, result, graph = _differentiate(model, PARAMS)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    target = rng.standard_normal((6, 3)).astype(np.float32)
    loss, *grads = session.run(None, {"x": x, "target": target})
    expected_loss, expected = _torch_grads(model, x, target)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for name, grad in zip(PARAMS, grads):
        assert grad.dtype == np.float32
        np.testing.assert_allclose(grad, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)

    # The backward finishes the last layer first: that is the order buckets are formed in.
    order = [v.name for v in result.order]
    assert set(order[:2]) == {"fc2.weight", "fc2.bias"} and set(order[2:]) == {"fc1.weight", "fc1.bias"}
    assert [result.grads[graph.initializers[n]].name for n in PARAMS] == [f"grad.{n}" for n in PARAMS]
    for name in PARAMS:
        param, grad = graph.initializers[name], result.grads[graph.initializers[name]]
        assert grad.dtype == param.dtype and list(grad.shape) == list(param.shape)


def test_symbolic_batch_runs_at_several_batch_sizes():
    model = _mlp("pow", batch="batch")
    session, _, _ = _differentiate(model, PARAMS)
    rng = np.random.default_rng(3)
    for batch in (3, 8):
        x = rng.standard_normal((batch, 4)).astype(np.float32)
        target = rng.standard_normal((batch, 3)).astype(np.float32)
        _, *grads = session.run(None, {"x": x, "target": target})
        _, expected = _torch_grads(model, x, target)
        for name, grad in zip(PARAMS, grads):
            np.testing.assert_allclose(
                grad, expected[name], rtol=1e-5, atol=1e-6, err_msg=f"{name} @ {batch}"
            )


def _path_model() -> onnx.ModelProto:
    # loss = sum(Reshape(x, Shape(s)) * w_used * Cast<float>(Cast<int>(c)) + Where(m > 0, p, q))
    # s, c and m reach the loss only through non-differentiable edges; unused is not used at all.
    f = TensorProto.FLOAT
    inits = {
        "w_used": np.ones((2, 3), np.float32),
        "unused": np.ones((4,), np.float32),
        "s": np.zeros((2, 3), np.float32),
        "c": np.full((2, 3), 2.5, np.float32),
        "m": np.array([1.0, -1.0, 1.0], np.float32),
        "p": np.full((3,), 3.0, np.float32),
        "q": np.full((3,), 5.0, np.float32),
        "zero": np.array(0.0, np.float32),
    }
    nodes = [
        helper.make_node("Shape", ["s"], ["s_shape"]),
        helper.make_node("Reshape", ["x", "s_shape"], ["xr"]),
        helper.make_node("Mul", ["xr", "w_used"], ["xw"]),
        helper.make_node("Cast", ["c"], ["c_int"], to=TensorProto.INT64),
        helper.make_node("Cast", ["c_int"], ["c_float"], to=f),
        helper.make_node("Mul", ["xw", "c_float"], ["xwc"]),
        helper.make_node("Greater", ["m", "zero"], ["mask"]),
        helper.make_node("Where", ["mask", "p", "q"], ["pq"]),
        helper.make_node("Add", ["xwc", "pq"], ["total"]),
        helper.make_node("ReduceSum", ["total"], ["loss"], keepdims=0),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", f, [6])],
        [helper.make_tensor_value_info("loss", f, [])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )


def test_differentiable_values_cut_at_non_differentiable_edges():
    graph = ir.serde.deserialize_model(_path_model()).graph
    found = {v.name for v in differentiable_values(graph, graph.outputs[0])}
    trainable = {name for name in graph.initializers if name in found}
    assert trainable == {"w_used", "p", "q"}
    assert {"x", "xr", "c_float", "loss"} <= found
    assert not {"s", "s_shape", "c", "c_int", "m", "mask", "zero"} & found


def test_off_path_wrt_gets_explicit_zeros_and_names_stay_unique():
    model = _path_model()
    # A value already called "grad.w_used" forces the published gradient to another name.
    model.graph.node.append(helper.make_node("Identity", ["w_used"], ["grad.w_used"]))
    session, result, graph = _differentiate(model, ["w_used", "unused", "c", "p"])
    grads = dict(
        zip(["w_used", "unused", "c", "p"], session.run(None, {"x": np.arange(6, dtype=np.float32)})[1:])
    )
    np.testing.assert_array_equal(grads["unused"], np.zeros(4, np.float32))
    np.testing.assert_array_equal(grads["c"], np.zeros((2, 3), np.float32))
    # pq broadcasts over the 2 rows of xwc, so each p element is counted twice.
    np.testing.assert_array_equal(grads["p"], np.array([2, 0, 2], np.float32))
    np.testing.assert_array_equal(grads["w_used"], 2.0 * np.arange(6, dtype=np.float32).reshape(2, 3))
    assert result.grads[graph.initializers["w_used"]].name == "grad.w_used_1"
    # Zeros are produced last, after every real gradient.
    assert [v.name for v in result.order][-2:] == ["unused", "c"]
    names = [v.name for node in graph for v in node.outputs]
    assert len(names) == len(set(names))


def test_unknown_op_is_reported_before_the_graph_changes():
    model = _model(
        [
            helper.make_node("Mystery", ["x"], ["e"], name="mystery", domain="test.custom"),
            helper.make_node("Mul", ["e", "w"], ["y"], name="mul"),
            helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.ones(3, np.float32), "w")],
    )
    graph = ir.serde.deserialize_model(model).graph
    x, w = graph.inputs[0], graph.initializers["w"]
    # An op without a rule is assumed to pass gradients, so what lies behind it is still found.
    assert x in differentiable_values(graph, graph.outputs[0])
    check_supported(graph, graph.outputs[0], [w])  # w does not go through Erf
    before = len(graph)
    with pytest.raises(UnsupportedOpsError, match="'test.custom::Mystery' .*'mystery'"):
        build_gradients(graph, graph.outputs[0], [x, w])
    assert len(graph) == before


def test_parameter_read_inside_an_if_branch_is_found_and_reported():
    f = TensorProto.FLOAT
    branch = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["branch_out"])],
        "branch",
        [],
        [helper.make_tensor_value_info("branch_out", f, [3])],
    )
    model = _model(
        [
            helper.make_node("If", ["flag"], ["chosen"], name="if", then_branch=branch, else_branch=branch),
            helper.make_node("ReduceSum", ["chosen"], ["loss"], keepdims=0, name="sum"),
        ],
        [
            helper.make_tensor_value_info("x", f, [3]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("loss", f, [])],
        [numpy_helper.from_array(np.ones(3, np.float32), "w")],
    )
    graph = ir.serde.deserialize_model(model).graph
    w = graph.initializers["w"]
    assert w in differentiable_values(graph, graph.outputs[0])
    with pytest.raises(UnsupportedOpsError, match="'If' .*'if'"):
        check_supported(graph, graph.outputs[0], [w])


def test_unbroadcast_with_unknown_rank_sums_at_run_time():
    # Reshape to a shape fed at run time: xr, and so xr + b, have unknown rank, so the axes to sum
    # for b can only be found at run time.
    model = _model(
        [
            helper.make_node("Reshape", ["x", "dims"], ["xr"]),
            helper.make_node("Add", ["xr", "b"], ["s"]),
            helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0),
        ],
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, [24]),
            helper.make_tensor_value_info("dims", TensorProto.INT64, ["n"]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        [numpy_helper.from_array(np.zeros(4), "b")],
    )
    session, _, graph = _differentiate(model, ["x", "b"])
    assert graph.node(1).outputs[0].shape is None
    _, grad_x, grad_b = session.run(None, {"x": np.ones(24), "dims": np.array([2, 3, 4])})
    np.testing.assert_array_equal(grad_x, np.ones(24))
    np.testing.assert_array_equal(grad_b, np.full(4, 6.0))


def test_rule_errors_name_the_node():
    model = _model(
        [
            helper.make_node("Reshape", ["x", "dims"], ["xr"]),
            helper.make_node("MatMul", ["xr", "w"], ["y"], name="/proj/MatMul"),
            helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
        ],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [8]),
            helper.make_tensor_value_info("dims", TensorProto.INT64, ["n"]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.ones((4, 2), np.float32), "w")],
    )
    graph = ir.serde.deserialize_model(model).graph
    with pytest.raises(GradientError, match="MatMul node '/proj/MatMul': the rank of 'xr' is unknown"):
        build_gradients(graph, graph.outputs[0], [graph.initializers["w"]])


def test_non_scalar_loss_is_rejected():
    model = _model(
        [helper.make_node("Mul", ["x", "x"], ["loss"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [3])],
    )
    graph = ir.serde.deserialize_model(model).graph
    with pytest.raises(TranspileError, match="float scalar"):
        build_gradients(graph, graph.outputs[0], [graph.inputs[0]])


def _run_with_grads(
    model: onnx.ModelProto, wrt: list[str], feeds: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    session, _, _ = _differentiate(model, wrt)
    _, *grads = session.run(None, feeds)
    return dict(zip(wrt, grads))


def test_dropout_training_gradient_uses_the_mask_it_adds():
    # The exporter drops Dropout's mask: the rule adds it as a second output of the forward node.
    model = _model(
        [
            helper.make_node("Dropout", ["x", "ratio", "training"], ["y"], name="/drop/Dropout", seed=3),
            helper.make_node("Mul", ["y", "c"], ["yc"]),
            helper.make_node("ReduceSum", ["yc"], ["loss"], keepdims=0),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 50])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [
            numpy_helper.from_array(np.array(0.25, np.float32), "ratio"),
            numpy_helper.from_array(np.array(True), "training"),
            numpy_helper.from_array(np.linspace(-1, 1, 50).astype(np.float32), "c"),
        ],
    )
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    result = build_gradients(graph, graph.outputs[0], [graph.inputs[0]])
    dropout = next(node for node in graph if node.op_type == "Dropout")
    assert len(dropout.outputs) == 2 and dropout.outputs[1].name
    graph.outputs.extend([result.grads[graph.inputs[0]], dropout.outputs[0], dropout.outputs[1]])
    proto = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(4).uniform(1, 2, (4, 50)).astype(np.float32)
    _, grad, y, mask = session.run(None, {"x": x})
    assert 0 < mask.mean() < 1
    c = np.linspace(-1, 1, 50).astype(np.float32)
    np.testing.assert_allclose(grad, c * mask / 0.75, rtol=1e-6)
    np.testing.assert_allclose(y, x * mask / 0.75, rtol=1e-6)


def test_ties_share_the_gradient_like_torch():
    # Max/Min of tied inputs and ReduceMax over tied elements split the gradient equally, as
    # torch.maximum and torch.amax do.
    model = _model(
        [
            helper.make_node("Max", ["a", "b"], ["m"]),
            helper.make_node("ReduceMax", ["a", "axes"], ["r"], keepdims=0),
            helper.make_node("ReduceSum", ["m"], ["sm"], keepdims=0),
            helper.make_node("ReduceSum", ["r"], ["sr"], keepdims=0),
            helper.make_node("Add", ["sm", "sr"], ["loss"]),
        ],
        [helper.make_tensor_value_info(n, TensorProto.DOUBLE, [2, 3]) for n in ("a", "b")],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        [numpy_helper.from_array(np.array([1]), "axes")],
    )
    a = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]])
    b = np.array([[1.0, 0.0, 4.0], [2.0, 5.0, 0.0]])
    grads = _run_with_grads(model, ["a", "b"], {"a": a, "b": b})
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    (torch.maximum(ta, tb).sum() + torch.amax(ta, dim=1).sum()).backward()
    np.testing.assert_allclose(grads["a"], ta.grad.numpy())
    np.testing.assert_allclose(grads["b"], tb.grad.numpy())


def test_einsum_with_a_repeated_index_is_rejected_naming_the_node():
    model = _model(
        [
            helper.make_node("Einsum", ["x"], ["d"], name="/diag/Einsum", equation="ii->i"),
            helper.make_node("ReduceSum", ["d"], ["loss"], keepdims=0),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
    )
    graph = ir.serde.deserialize_model(model).graph
    with pytest.raises(GradientError, match="Einsum node '/diag/Einsum'.*repeats an index"):
        build_gradients(graph, graph.outputs[0], [graph.inputs[0]])


def _params(rng: np.random.Generator, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    return {k: (rng.standard_normal(s) * 0.3).astype(np.float32) for k, s in shapes.items()}


def test_attention_block_with_dynamic_reshapes_matches_torch():
    # What transformer exports look like: a symbolic batch, head splits through
    # Shape -> Gather -> Concat -> Reshape, 4-D batched MatMul, Softmax, LayerNormalization, GELU.
    heads, dim, seq = 2, 8, 5
    rng = np.random.default_rng(5)
    params = _params(
        rng,
        {
            "wq": (dim, dim),
            "wk": (dim, dim),
            "wv": (dim, dim),
            "ln.weight": (dim,),
            "ln.bias": (dim,),
            "fc": (dim, dim),
        },
    )
    consts = {
        "idx0": np.array(0, np.int64),
        "idx1": np.array(1, np.int64),
        "split": np.array([heads, dim // heads], np.int64),
        "flat": np.array([dim], np.int64),
        "scale": np.array(1 / np.sqrt(dim // heads), np.float32),
    }
    nodes = [
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Gather", ["xs", "idx0"], ["b"], axis=0),
        helper.make_node("Gather", ["xs", "idx1"], ["t"], axis=0),
        helper.make_node("Unsqueeze", ["b", "axes0"], ["b1"]),
        helper.make_node("Unsqueeze", ["t", "axes0"], ["t1"]),
        helper.make_node("Concat", ["b1", "t1", "split"], ["heads_shape"], axis=0),
        helper.make_node("Concat", ["b1", "t1", "flat"], ["merged_shape"], axis=0),
    ]
    for name in ("q", "k", "v"):
        nodes += [
            helper.make_node("MatMul", ["x", f"w{name}"], [f"{name}_lin"]),
            helper.make_node("Reshape", [f"{name}_lin", "heads_shape"], [f"{name}_split"]),
            helper.make_node("Transpose", [f"{name}_split"], [f"{name}_h"], perm=[0, 2, 1, 3]),
        ]
    nodes += [
        helper.make_node("Transpose", ["k_h"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q_h", "k_t"], ["att_raw"]),
        helper.make_node("Mul", ["att_raw", "scale"], ["att_scaled"]),
        helper.make_node("Softmax", ["att_scaled"], ["att"], axis=-1),
        helper.make_node("MatMul", ["att", "v_h"], ["ctx_h"]),
        helper.make_node("Transpose", ["ctx_h"], ["ctx_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctx_t", "merged_shape"], ["ctx"]),
        helper.make_node("Add", ["ctx", "x"], ["res"]),
        helper.make_node("LayerNormalization", ["res", "ln.weight", "ln.bias"], ["normed"], axis=-1),
        helper.make_node("MatMul", ["normed", "fc"], ["h"]),
        helper.make_node("Gelu", ["h"], ["g"]),
        helper.make_node("Mul", ["g", "g"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
    ]
    inits = {**params, **consts, "axes0": np.array([0], np.int64)}
    graph = helper.make_graph(
        nodes,
        "attn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", dim])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 20)]), strict_mode=True
    )
    session, _, _ = _differentiate(model, list(params))
    for batch in (1, 3):
        x = rng.standard_normal((batch, seq, dim)).astype(np.float32)
        _, *grads = session.run(None, {"x": x})
        tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
        tx = torch.tensor(x)

        def heads_of(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(t.shape[0], seq, heads, dim // heads).transpose(1, 2)

        q, k, v = (heads_of(tx @ tp[w]) for w in ("wq", "wk", "wv"))
        att = torch.softmax(q @ k.transpose(-1, -2) * consts["scale"].item(), dim=-1)
        ctx = (att @ v).transpose(1, 2).reshape(batch, seq, dim)
        normed = torch.nn.functional.layer_norm(ctx + tx, (dim,), tp["ln.weight"], tp["ln.bias"])
        out = torch.nn.functional.gelu(normed @ tp["fc"])
        (out * out).mean().backward()
        for name, grad in zip(params, grads):
            np.testing.assert_allclose(
                grad, tp[name].grad.numpy(), rtol=2e-4, atol=2e-6, err_msg=f"{name} @ {batch}"
            )


def test_small_cnn_with_cross_entropy_matches_torch():
    rng = np.random.default_rng(6)
    params = _params(
        rng,
        {
            "conv.weight": (4, 2, 3, 3),
            "conv.bias": (4,),
            "dw.weight": (4, 1, 3, 3),
            "fc.weight": (3, 4),
            "fc.bias": (3,),
        },
    )
    nodes = [
        helper.make_node(
            "Conv", ["x", "conv.weight", "conv.bias"], ["c1"], strides=[2, 2], pads=[1, 1, 1, 1]
        ),
        helper.make_node("LeakyRelu", ["c1"], ["a1"], alpha=0.1),
        helper.make_node("Conv", ["a1", "dw.weight"], ["c2"], group=4, pads=[1, 1, 1, 1]),
        helper.make_node("MaxPool", ["c2"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("AveragePool", ["p"], ["ap"], kernel_shape=[2, 2], pads=[0, 0, 1, 1]),
        helper.make_node("GlobalAveragePool", ["ap"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], transB=1),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], reduction="mean"),
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 11, 10]),
            helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(v, k) for k, v in params.items()],
    )
    x = rng.standard_normal((3, 2, 11, 10)).astype(np.float32)
    labels = np.array([0, 2, 1])
    grads = _run_with_grads(model, list(params), {"x": x, "labels": labels})
    F = torch.nn.functional
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    h = F.leaky_relu(F.conv2d(torch.tensor(x), tp["conv.weight"], tp["conv.bias"], stride=2, padding=1), 0.1)
    h = F.max_pool2d(F.conv2d(h, tp["dw.weight"], groups=4, padding=1), 2)
    # ONNX AveragePool with end-only pads and count_include_pad=0 divides by the real elements;
    # torch pads symmetrically, so build it as a window sum over zero padding / the element count.
    summed = F.avg_pool2d(F.pad(h, (0, 1, 0, 1)), 2, stride=1, divisor_override=1)
    counts = F.avg_pool2d(F.pad(torch.ones_like(h), (0, 1, 0, 1)), 2, stride=1, divisor_override=1)
    pooled = summed / counts
    logits = F.linear(pooled.mean(dim=(2, 3)), tp["fc.weight"], tp["fc.bias"])
    F.cross_entropy(logits, torch.tensor(labels)).backward()
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, tp[name].grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
