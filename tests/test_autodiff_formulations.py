"""The fast backward formulations: same gradients as the former ones and as finite differences, and
the graph shape that makes them fast (one Gemm per Linear weight, two reductions per BatchNorm).

- Linear on (batch, time, features): dW is one Gemm over the flattened rows; with the exporters'
  ``x @ Transpose(W)`` no transpose kernel is left in the backward.
- BatchNormalization (transpiler/batchnorm.py "fused"): the inference-mode BatchNormalization fed
  the batch statistics; its rule gives the training-mode gradient, equal to the gradient of the
  all-primitive form and to central differences (float64), with two backward reductions.
- Conv: the per-tap Gemm weight gradient equals the Conv formulation, and is used exactly where it
  applies (group 1, static shapes).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from contract.ops import CONV_WEIGHT_GRAD as WEIGHT_GRAD_OP
from transpiler.autodiff import build_gradients
from transpiler.autodiff.rules import conv as conv_rules
from transpiler.batchnorm import decompose_batchnorm
from transpiler.native_ops import add_op_functions


def _session(proto: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def _differentiate(proto: onnx.ModelProto, wrt: list[str], *, bn: str | None = None):
    """(model with loss and grad outputs, backward op counts)."""
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto, strict_mode=True))
    if bn is not None:
        model, _ = decompose_batchnorm(model, formulation=bn)
    graph = model.graph
    values = {v.name: v for v in [*graph.inputs, *graph.initializers.values()]}
    forward = set(graph)
    result = build_gradients(graph, graph.outputs[0], [values[n] for n in wrt])
    graph.outputs.extend(result.grads[values[n]] for n in wrt)
    add_op_functions(model)
    backward = Counter(node.op_type for node in graph if node not in forward)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out)
    return out, backward, Counter(node.op_type for node in graph)


def _check_vjp(proto, feeds, wrt, grads, eps, rtol):
    """<t, grad> == d/ds loss(x + s t) by central differences, along a random direction t."""
    session = _session(proto)
    rng = np.random.default_rng(1)
    direction = {n: rng.standard_normal(feeds[n].shape) for n in wrt}
    vjp = sum(float(np.sum(direction[n] * g)) for n, g in zip(wrt, grads))

    def loss(step):
        moved = {k: (v + step * direction[k]).astype(v.dtype) if k in direction else v for k, v in feeds.items()}
        return float(session.run([proto.graph.output[0].name], moved)[0])

    np.testing.assert_allclose(vjp, (loss(eps) - loss(-eps)) / (2 * eps), rtol=rtol)


# ---------------------------------------------------------------------------------------------
# Linear


@pytest.mark.parametrize("transposed", [False, True], ids=["x@W", "x@Transpose(W)"])
@pytest.mark.parametrize("batch", [3, "batch"], ids=["static", "symbolic"])
def test_linear_weight_gradient_is_one_gemm(transposed, batch):
    w_shape = [5, 4] if transposed else [4, 5]
    nodes = []
    if transposed:
        nodes.append(onnx.helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]))
    nodes += [
        onnx.helper.make_node("MatMul", ["x", "wt" if transposed else "w"], ["h"]),
        onnx.helper.make_node("Add", ["h", "b"], ["y"]),
        onnx.helper.make_node("Mul", ["y", "c"], ["yc"]),
        onnx.helper.make_node("ReduceSum", ["yc"], ["loss"], keepdims=0),
    ]
    f64 = onnx.TensorProto.DOUBLE
    graph = onnx.helper.make_graph(
        nodes, "linear",
        [onnx.helper.make_tensor_value_info("x", f64, [batch, 2, 4]),
         onnx.helper.make_tensor_value_info("w", f64, w_shape),
         onnx.helper.make_tensor_value_info("b", f64, [5]),
         onnx.helper.make_tensor_value_info("c", f64, [batch, 2, 5])],
        [onnx.helper.make_tensor_value_info("loss", f64, [])],
    )
    proto = onnx.helper.make_model(graph, ir_version=10, opset_imports=[onnx.helper.make_opsetid("", 18)])
    wrt = ["x", "w", "b"]
    out, backward, _ = _differentiate(proto, wrt)
    # dW: one Gemm; dX: one MatMul (with W itself) or Gemm (transB); dB: one ReduceSum (the loss's
    # ReduceSum transposes to an Expand); no Transpose kernel, no batched product and reduction.
    assert backward["Gemm"] + backward["MatMul"] == 2 and backward["Gemm"] >= 1
    assert backward["Transpose"] == 0
    assert backward["ReduceSum"] == 1
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((3, 2, 4)), "w": rng.standard_normal(w_shape),
             "b": rng.standard_normal(5), "c": rng.standard_normal((3, 2, 5))}
    grads = _session(out).run([f"grad.{n}" for n in wrt], feeds)
    x, w, c = feeds["x"], feeds["w"], feeds["c"]
    weight = w.T if transposed else w
    np.testing.assert_allclose(grads[0], c @ weight.T, rtol=1e-12)
    expected_w = np.einsum("btk,btn->kn", x, c)
    np.testing.assert_allclose(grads[1], expected_w.T if transposed else expected_w, rtol=1e-12)
    np.testing.assert_allclose(grads[2], c.sum(axis=(0, 1)), rtol=1e-12)
    _check_vjp(out, feeds, wrt, grads, 1e-6, 1e-7)


# ---------------------------------------------------------------------------------------------
# BatchNormalization


def _bn_model(shape, dtype=onnx.TensorProto.DOUBLE):
    channels = shape[1]
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    nodes = [
        onnx.helper.make_node("BatchNormalization", ["x", "scale", "bias", "rm", "rv"], ["y"], name="bn",
                              epsilon=1e-5, momentum=0.9),
        onnx.helper.make_node("Mul", ["y", "c"], ["yc"]),
        onnx.helper.make_node("ReduceSum", ["yc"], ["loss"], keepdims=0),
    ]
    inits = [onnx.numpy_helper.from_array(np.zeros(channels, np_dtype), "rm"),
             onnx.numpy_helper.from_array(np.ones(channels, np_dtype), "rv")]
    graph = onnx.helper.make_graph(
        nodes, "bn",
        [onnx.helper.make_tensor_value_info("x", dtype, ["n", *shape[1:]]),
         onnx.helper.make_tensor_value_info("scale", dtype, [channels]),
         onnx.helper.make_tensor_value_info("bias", dtype, [channels]),
         onnx.helper.make_tensor_value_info("c", dtype, ["n", *shape[1:]])],
        [onnx.helper.make_tensor_value_info("loss", dtype, [])],
        inits,
    )
    return onnx.helper.make_model(graph, ir_version=10, opset_imports=[onnx.helper.make_opsetid("", 18)])


@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (6, 4)], ids=["2d", "1d"])
def test_batchnorm_fused_gradient_equals_primitive_and_finite_differences(shape):
    proto = _bn_model(shape)
    wrt = ["x", "scale", "bias"]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(shape) * 2 + 1, "scale": rng.uniform(0.5, 2, shape[1]),
             "bias": rng.standard_normal(shape[1]), "c": rng.standard_normal(shape)}
    fused, backward, everything = _differentiate(proto, wrt, bn="fused")
    primitive, _, _ = _differentiate(proto, wrt, bn="primitive")
    assert everything["BatchNormalization"] == 1
    # Forward: two ReduceMeans (mean, variance); backward: sum(dy), sum(dy * (x - mean)), plus
    # the loss scaffolding's ReduceSum transpose (an Expand, no reduction).
    assert everything["ReduceMean"] == 2
    assert backward["ReduceSum"] == 2 and backward["ReduceMean"] == 0
    names = ["loss"] + [f"grad.{n}" for n in wrt]
    got = _session(fused).run(names, feeds)
    want = _session(primitive).run(names, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    _check_vjp(fused, feeds, wrt, got[1:], 1e-6, 1e-7)


def test_batchnorm_node_form_equals_the_fused_form():
    """The default form of a rank-4 float32 BatchNorm: one BatchNormTraining node and one
    BatchNormTrainingGrad (no primitive statistics left), computing through their functions what
    the fused form computes (float32: the same formulas, the variance's inverse squared instead of
    divided by)."""
    shape = (4, 3, 5, 6)
    proto = _bn_model(shape, onnx.TensorProto.FLOAT)
    wrt = ["x", "scale", "bias"]
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal(shape) * 2 + 1, "scale": rng.uniform(0.5, 2, shape[1]),
             "bias": rng.standard_normal(shape[1]), "c": rng.standard_normal(shape)}
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    node, backward, everything = _differentiate(proto, wrt, bn="node")
    fused, _, _ = _differentiate(proto, wrt, bn="fused")
    assert everything["BatchNormTraining"] == 1 and backward["BatchNormTrainingGrad"] == 1
    assert everything["ReduceMean"] == 0 and everything["BatchNormalization"] == 0
    names = ["loss"] + [f"grad.{n}" for n in wrt]
    for got, want in zip(_session(node).run(names, feeds), _session(fused).run(names, feeds)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(np.max(np.abs(want))))


@pytest.mark.parametrize(("shape", "dtype", "world", "node"), [
    ((4, 3, 5, 6), onnx.TensorProto.FLOAT, 1, True),
    ((6, 4), onnx.TensorProto.FLOAT, 1, False),  # not (N, C, H, W): cuDNN's 2-D spatial kernels only
    ((4, 3, 5, 6), onnx.TensorProto.DOUBLE, 1, False),  # the GPU runner's descriptors are float32
    ((4, 3, 5, 6), onnx.TensorProto.FLOAT, 2, False),  # --sync-bn: the statistics' AllReduce sits inside
], ids=["node", "rank2", "float64", "sync-bn"])
def test_batchnorm_node_form_only_where_it_applies(shape, dtype, world, node):
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(_bn_model(shape, dtype)))
    model, buffers = decompose_batchnorm(model, world_size=world)
    ops = Counter(n.op_type for n in model.graph)
    assert ops["BatchNormTraining"] == int(node) and ops["BatchNormalization"] == int(not node)
    assert [b.name for b in buffers] == ["rm", "rv"]


def test_batchnorm_small_epsilon_keeps_primitives():
    """onnxruntime's CUDA kernel clamps epsilon to cuDNN's 1e-5: a smaller one stays exact as primitives."""
    proto = _bn_model((4, 3, 2, 2))
    proto.graph.node[0].attribute[0].f = 1e-6
    _, _, everything = _differentiate(proto, ["x", "scale", "bias"], bn="fused")
    assert everything["BatchNormalization"] == 0


def test_inference_batchnorm_fed_other_statistics_passes_them_gradients():
    """A BatchNormalization whose mean/var are not its input's batch statistics is an ordinary
    inference-mode op: its statistics inputs get their gradients (the rule's spec checks the math)."""
    from transpiler.autodiff.rules.batchnorm import batch_statistics

    proto = _bn_model((4, 3, 2, 2))
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto))
    model, _ = decompose_batchnorm(model)
    node = next(n for n in model.graph if n.op_type == "BatchNormalization")
    assert batch_statistics(node) is not None
    sub = next(n for n in model.graph if n.op_type == "Sub")
    sub.replace_input_with(0, model.graph.inputs[3])  # the variance now is not x's
    assert batch_statistics(node) is None


# ---------------------------------------------------------------------------------------------
# Conv


CONVS = [
    ([2, 3, 7, 6], [4, 3, 3, 3], {"pads": [1, 1, 1, 1]}),
    ([2, 3, 8, 8], [5, 3, 3, 3], {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ([2, 3, 8, 7], [5, 3, 1, 1], {"strides": [2, 2]}),
    ([2, 3, 5, 6], [4, 3, 1, 1], {}),
    ([2, 3, 9, 8], [4, 3, 3, 2], {"dilations": [2, 1], "pads": [2, 0, 1, 1], "strides": [1, 3]}),
    ([2, 2, 10], [3, 2, 4], {"strides": [3], "dilations": [2], "pads": [2, 1]}),
    ([2, 4, 8, 8], [4, 2, 3, 3], {"group": 2, "pads": [1, 1, 1, 1]}),
]


def _conv_loss(x_shape, w_shape, attrs) -> tuple[onnx.ModelProto, list[int]]:
    """(the model loss = sum(Conv(x, w) * c), the shape of Conv's output and c)."""
    f32 = onnx.TensorProto.FLOAT
    nodes = [onnx.helper.make_node("Conv", ["x", "w"], ["y"], **attrs),
             onnx.helper.make_node("Mul", ["y", "c"], ["yc"]),
             onnx.helper.make_node("ReduceSum", ["yc"], ["loss"], keepdims=0)]
    probe = onnx.shape_inference.infer_shapes(onnx.helper.make_model(
        onnx.helper.make_graph(nodes[:1], "p", [onnx.helper.make_tensor_value_info("x", f32, x_shape),
                                                onnx.helper.make_tensor_value_info("w", f32, w_shape)],
                               [onnx.helper.make_tensor_value_info("y", f32, None)]),
        opset_imports=[onnx.helper.make_opsetid("", 18)]))
    y_shape = [d.dim_value for d in probe.graph.output[0].type.tensor_type.shape.dim]
    graph = onnx.helper.make_graph(
        nodes, "conv",
        [onnx.helper.make_tensor_value_info("x", f32, x_shape), onnx.helper.make_tensor_value_info("w", f32, w_shape),
         onnx.helper.make_tensor_value_info("c", f32, y_shape)],
        [onnx.helper.make_tensor_value_info("loss", f32, [])],
    )
    return onnx.helper.make_model(graph, ir_version=10, opset_imports=[onnx.helper.make_opsetid("", 18)]), y_shape


@pytest.mark.parametrize("x_shape,w_shape,attrs", CONVS, ids=[str(i) for i in range(len(CONVS))])
def test_conv_weight_gradient_gemm_equals_conv(x_shape, w_shape, attrs, monkeypatch):
    proto, y_shape = _conv_loss(x_shape, w_shape, attrs)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(x_shape, dtype=np.float32), "w": rng.standard_normal(w_shape, dtype=np.float32),
             "c": rng.standard_normal(y_shape, dtype=np.float32)}
    results = {}
    for formulation in ("conv", "gemm", "auto"):
        monkeypatch.setattr(conv_rules, "WEIGHT_GRAD", formulation)
        out, backward, _ = _differentiate(proto, ["w"])
        results[formulation] = (_session(out).run(["grad.w"], feeds)[0], backward)
    grouped = attrs.get("group", 1) > 1
    taps = int(np.prod(w_shape[2:]))
    assert results["gemm"][1]["Gemm"] == (0 if grouped else taps)
    assert results["conv"][1]["Gemm"] == 0
    assert results["conv"][1][WEIGHT_GRAD_OP] == results["gemm"][1][WEIGHT_GRAD_OP] == 0
    # The node where cuDNN can run it: group 1, two spatial axes, pads that fit symmetric ones (the
    # asymmetric [2, 0, 1, 1] case does not); onnxruntime computes it through its function here.
    fits = not grouped and len(x_shape) == 4 and attrs.get("pads", [0, 0, 0, 0])[:2] == attrs.get("pads", [0] * 4)[2:]
    assert results["auto"][1][WEIGHT_GRAD_OP] == (1 if fits else 0)
    np.testing.assert_allclose(results["gemm"][0], results["conv"][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results["auto"][0], results["conv"][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size, gemms", [(10, 9), (7, 0)])
def test_conv_weight_gradient_form_follows_the_output_size(size, gemms, monkeypatch):
    """By default the per-tap GEMMs are used from GEMM_MIN_OUTPUT_POSITIONS output positions on
    (10x10 = 100 here: nine taps, nine Gemms), the Conv form below (7x7 = 49)."""
    assert conv_rules.WEIGHT_GRAD == "auto" and 49 < conv_rules.GEMM_MIN_OUTPUT_POSITIONS <= 100
    monkeypatch.setattr(conv_rules, "WEIGHT_GRAD_NODE", False)  # the inline forms (default: the node)
    f32 = onnx.TensorProto.FLOAT
    nodes = [onnx.helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
             onnx.helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    graph = onnx.helper.make_graph(
        nodes, "conv", [onnx.helper.make_tensor_value_info("x", f32, [2, 3, size, size]),
                        onnx.helper.make_tensor_value_info("w", f32, [4, 3, 3, 3])],
        [onnx.helper.make_tensor_value_info("loss", f32, [])])
    proto = onnx.helper.make_model(graph, ir_version=10, opset_imports=[onnx.helper.make_opsetid("", 18)])
    _, backward, _ = _differentiate(proto, ["w"])
    assert backward["Gemm"] == gemms


def test_a_conv_weight_gradient_node_is_emitted_only_where_symmetric_pads_give_it(monkeypatch):
    """The GPU runs ConvWeightGrad with cuDNN, which pads both sides by the begin pads: wherever the
    rule emits the node, that symmetric computation (torch's ``conv2d_weight``, padding = begin)
    equals the node's function on onnxruntime; random windows, asymmetric pads included."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    emitted = 0
    for _ in range(60):
        kernel = [int(k) for k in rng.integers(1, 4, 2)]
        strides = [int(s) for s in rng.integers(1, 3, 2)]
        dilations = [int(d) for d in rng.integers(1, 3, 2)]
        pads = [int(p) for p in rng.integers(0, 3, 4)]
        x_shape = [2, 3, *(int(v) for v in rng.integers(6, 10, 2))]
        w_shape = [4, 3, *kernel]
        proto, y_shape = _conv_loss(x_shape, w_shape, {"strides": strides, "dilations": dilations, "pads": pads})
        if min(y_shape[2:]) < 1:
            continue
        out, backward, _ = _differentiate(proto, ["w"])
        if not backward[WEIGHT_GRAD_OP]:
            continue
        emitted += 1
        (wgrad,) = [n for n in out.graph.node if n.op_type == WEIGHT_GRAD_OP]
        attrs = {a.name: list(a.ints) for a in wgrad.attribute}
        feeds = {"x": rng.standard_normal(x_shape, dtype=np.float32), "w": rng.standard_normal(w_shape, dtype=np.float32),
                 "c": rng.standard_normal(y_shape, dtype=np.float32)}
        actual = _session(out).run(["grad.w"], feeds)[0]
        symmetric = torch.nn.grad.conv2d_weight(
            torch.from_numpy(feeds["x"]).double(), w_shape, torch.from_numpy(feeds["c"]).double(),
            stride=attrs["strides"], padding=attrs["pads"][:2], dilation=attrs["dilations"]).numpy()
        np.testing.assert_allclose(actual, symmetric, rtol=1e-4, atol=1e-4, err_msg=str((x_shape, kernel, attrs)))
    assert emitted >= 10  # the draw covers the node, not only the fallbacks
