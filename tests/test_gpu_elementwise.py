"""runtime/gpu/elementwise_fusion.py, elementwise.py: elementwise chains become one fused node, wired
to compute what their nodes computed (checked on CPU through the NumPy form of each op against
onnxruntime's values of the unfused graph), in a valid order, never through a cycle; on a GPU the
CuPy kernels equal that form."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import one_graph_model
from onnx import TensorProto, helper

from runtime.gpu.elementwise import input_kinds, vector_source
from runtime.gpu.elementwise_fusion import fuse_elementwise
from runtime.gpu.elementwise_steps import DOMAIN, evaluate_numpy


def _session(model: onnx.ModelProto, extra_outputs: list[str]) -> ort.InferenceSession:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    known = {o.name for o in model.graph.output}
    model.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in dict.fromkeys(extra_outputs) if n not in known)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _ops(node: onnx.NodeProto) -> list[str]:
    return [s.decode() for s in next(a.strings for a in node.attribute if a.name == "ops")]


def _check_order(model: onnx.ModelProto) -> None:
    known = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer} | {""}
    for node in model.graph.node:
        missing = [n for n in node.input if n not in known]
        assert not missing, f"{node.name} reads {missing} before they are produced"
        known |= set(node.output)


def _check_fused_values(original: onnx.ModelProto, fused: onnx.ModelProto, feeds: dict) -> int:
    """Every fused node's NumPy outputs, from the unfused graph's values of its inputs, equal the
    unfused graph's values of its outputs. Returns how many fused nodes there are."""
    nodes = [n for n in fused.graph.node if n.domain == DOMAIN]
    names = [name for n in nodes for name in (*n.input, *n.output)]
    session = _session(original, names)
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    values.update(feeds)
    for init in original.graph.initializer:
        values.setdefault(init.name, onnx.numpy_helper.to_array(init))
    for node in nodes:
        got = evaluate_numpy(node, [values[n] for n in node.input])
        for name, value in zip(node.output, got):
            np.testing.assert_allclose(value, values[name], rtol=2e-5, atol=1e-6, err_msg=f"{node.name}: {name}")
    return len(nodes)


def test_the_gpt_s_gelu_and_layernorm_chains_fuse_and_compute_what_they_computed(gpt_train):
    model, feeds = gpt_train
    fused = fuse_elementwise(model)
    _check_order(fused)
    nodes = [n for n in fused.graph.node if n.domain == DOMAIN]
    # GELU's forward (x/sqrt2, erf, +1, *x, *0.5) and its backward's local derivative, which the
    # rule recomputes from x alone (a second erf, exp(-u^2)): one cluster, both read only x.
    assert any(_ops(n).count("Erf") == 2 and "Exp" in _ops(n) and len(_ops(n)) >= 10 for n in nodes)
    assert not any(set(_ops(n)) <= {"Add", "Sum"} for n in nodes)  # left to onnxruntime's Gemm bias
    assert len(fused.graph.node) < len(model.graph.node)
    assert _check_fused_values(model, fused, feeds) == len(nodes)


def test_a_merge_that_would_make_a_cycle_is_refused():
    """a = x*x feeds a Softmax s; c = a + s. Fusing c into a's cluster would make the fused node read
    s, which reads the fused node."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])
    out = helper.make_tensor_value_info("c2", TensorProto.FLOAT, ["n", 8])
    nodes = [helper.make_node("Mul", ["x", "x"], ["a"]), helper.make_node("Exp", ["a"], ["a2"]),
             helper.make_node("Softmax", ["a2"], ["s"], axis=-1),
             helper.make_node("Add", ["a2", "s"], ["c"]), helper.make_node("Mul", ["c", "c"], ["c2"])]
    model = one_graph_model(nodes, [x], [out])
    fused = fuse_elementwise(model)
    _check_order(fused)
    groups = [set(_ops(n)) for n in fused.graph.node if n.domain == DOMAIN]
    assert groups == [{"Mul", "Exp"}, {"Add", "Mul"}]
    feeds = {"x": np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)}
    assert _check_fused_values(model, fused, feeds) == 2


def test_scalar_constants_are_inlined_exactly_and_small_or_additive_chains_are_left_alone():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    third = onnx.numpy_helper.from_array(np.array(1 / 3, np.float32), "third")
    nodes = [helper.make_node("Mul", ["x", "third"], ["t"]), helper.make_node("Pow", ["t", "third"], ["p"]),
             helper.make_node("Add", ["p", "b"], ["y"])]
    fused = fuse_elementwise(one_graph_model(nodes, [x, b], [y], [third]))
    (node,) = [n for n in fused.graph.node if n.domain == DOMAIN]
    code = next(a.s.decode() for a in node.attribute if a.name == "code")
    assert "__int_as_float(0x3eaaaaab)" in code and "powf" in code  # 1/3 in float32, to the bit
    assert list(node.input) == ["x", "b"] and list(node.output) == ["y"]
    steps = json.loads(next(a.s.decode() for a in node.attribute if a.name == "steps"))
    assert [op for op, _ in steps] == ["Mul", "Pow", "Add"]
    # Additions only (a bias and a residual): left to onnxruntime, unless fused nodes run inside
    # the sessions (``additions``), where they save the Gemm's bias broadcast and the residual's Add.
    adds = [helper.make_node("Add", ["x", "b"], ["t"]), helper.make_node("Add", ["t", "x"], ["y"])]
    assert [n.op_type for n in fuse_elementwise(one_graph_model(adds, [x, b], [y])).graph.node] == ["Add", "Add"]
    (fused_adds,) = fuse_elementwise(one_graph_model(adds, [x, b], [y]), additions=True).graph.node
    assert fused_adds.domain == DOMAIN and list(fused_adds.input) == ["x", "b"] and list(fused_adds.output) == ["y"]
    # A small static tensor: not worth a cut of the onnxruntime graph.
    small = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    assert fuse_elementwise(one_graph_model(nodes, [small, b], [y], [third])).graph.node[0].op_type == "Mul"


def _fused_gpt_nodes(gpt_train) -> list[onnx.NodeProto]:
    """The fused elementwise nodes of the small GPT's training step."""
    model, _ = gpt_train
    return [n for n in fuse_elementwise(model).graph.node if n.domain == DOMAIN]


@pytest.mark.gpu
def test_the_cupy_kernels_equal_the_numpy_form(gpt_train, cupy_kernels):
    cp = cupy_kernels.cp
    rng = np.random.default_rng(0)
    for node in _fused_gpt_nodes(gpt_train):
        inputs = [rng.uniform(-2, 2, size=(4, 3, 16)).astype(np.float32) for _ in node.input]
        got = cupy_kernels.runner(node).run({name: cp.asarray(v) for name, v in zip(node.input, inputs)})
        for g, e in zip(got, evaluate_numpy(node, inputs)):
            np.testing.assert_allclose(cp.asnumpy(g), e, rtol=1e-6, atol=1e-6, err_msg=node.name)


@pytest.mark.parametrize("shapes, shape, kinds", [
    ([(4, 3, 16), (1, 4, 3, 16)], (4, 3, 16), ("full", "full")),
    ([(4, 3, 16), (16,), ()], (4, 3, 16), ("full", "row", "scalar")),
    ([(4, 3, 16), (1, 3, 16), (1,)], (4, 3, 16), ("full", "row", "scalar")),
    ([(4, 3, 16), (4, 1, 16)], (4, 3, 16), None),  # repeated in the middle: CuPy's broadcast
    ([(4, 3, 16), (6,)], (4, 3, 6), None),  # a row of 6 elements: no whole 4-element loads
    ([(3, 5)], (3, 5), None),  # 15 elements
])
def test_the_vectorized_kernel_takes_full_scalar_and_row_inputs_only(shapes, shape, kinds):
    assert input_kinds(shapes, shape) == kinds


def test_each_lane_of_the_vectorized_kernel_runs_the_node_s_own_statements(gpt_train):
    node = next(n for n in _fused_gpt_nodes(gpt_train) if len(n.input) >= 2)
    code = next(a.s.decode() for a in node.attribute if a.name == "code")
    source = vector_source(node, ("full",) + ("row",) * (len(node.input) - 1), "k")
    first = code.split(";")[0]  # "float t0 = OP(x.., ..)" in the ElementwiseKernel body
    for lane in "xyzw":
        assert first.replace("t0", f"t0{lane}").replace("x0", f"a0.{lane}").replace("x1", f"a1.{lane}") in source
    assert "i % m1" in source and source.count("reinterpret_cast<float4*>(y0 + i)") == 1


@pytest.mark.gpu
def test_the_vectorized_kernels_equal_cupy_s_elementwise_kernels_bit_for_bit(gpt_train, cupy_kernels):
    cp = cupy_kernels.cp
    nodes = _fused_gpt_nodes(gpt_train)
    rng = np.random.default_rng(2)
    vectorized = 0
    for node in nodes:
        # Every input the output's shape; the later ones a row (a bias); and 15 elements (no 4-wide loads).
        for shapes in ([(4, 3, 16)] * len(node.input), [(4, 3, 16)] + [(16,)] * (len(node.input) - 1),
                       [(3, 5)] * len(node.input)):
            inputs = {name: cp.asarray(rng.uniform(-2, 2, size=dims).astype(np.float32))
                      for name, dims in zip(node.input, shapes)}
            runner = cupy_kernels.runner(node)
            got = runner.run(inputs)
            _, kernel, vector = runner.kernels[0]
            expected = kernel(*inputs.values())
            expected = expected if isinstance(expected, tuple) else (expected,)
            for g, e in zip(got, expected):
                assert cp.array_equal(g, e), (node.name, shapes)
            vectorized += any(kinds is not None for kinds in vector.layouts.values())
    assert vectorized >= len(nodes)  # each node took the 4-wide kernel for at least one layout


def _relu_grad_model(reader_domain: str, else_value: float = 0.0, mask_read_twice: bool = False,
                     threshold: float = 0.0, zero_dims: tuple = ()) -> onnx.ModelProto:
    """y = Relu(x); dx = Where(Greater(y, threshold), dy, else) read by a node of ``reader_domain``
    (``else`` of shape ``zero_dims``)."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu"),
             helper.make_node("Greater", ["y", "zero"], ["mask"], name="mask"),
             helper.make_node("Where", ["mask", "dy", "other"], ["dx"], name="relu_grad"),
             helper.make_node("Neg" if reader_domain == "" else "Op", ["dx"], ["out"], name="reader", domain=reader_domain)]
    outputs = [helper.make_tensor_value_info("out", f, [4, 8])]
    if mask_read_twice:
        outputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, [4, 8]))
    inits = [helper.make_tensor("zero", f, [], [threshold]), helper.make_tensor("other", f, list(zero_dims), [else_value])]
    model = one_graph_model(nodes, [helper.make_tensor_value_info(n, f, [4, 8]) for n in ("x", "dy")], outputs, inits)
    if reader_domain:
        model.opset_import.append(helper.make_opsetid(reader_domain, 1))
    return model


def test_relu_s_backward_becomes_one_fused_node_where_a_native_node_reads_it():
    from runtime.gpu.elementwise_fusion import fuse_relu_masks

    model = _relu_grad_model("test.native")
    fused = fuse_relu_masks(model, {"test.native"})
    assert [n.domain for n in fused.graph.node] == ["", DOMAIN, "test.native"]
    _check_order(fused)
    node = fused.graph.node[1]
    assert list(node.input) == ["y", "dy"] and list(node.output) == ["dx"]
    # Its NumPy form equals onnxruntime's Greater + Where, zeros and negative values included.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 8)).astype(np.float32)
    x[0, :3] = 0.0
    dy = rng.normal(size=(4, 8)).astype(np.float32)
    unfused = _relu_grad_model("")
    session = _session(unfused, ["y", "dx"])
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x, "dy": dy})))
    np.testing.assert_array_equal(evaluate_numpy(node, [values["y"], dy])[0], values["dx"])


def test_a_bf16_relu_s_backward_becomes_one_fused_node_of_bf16_values():
    """Under --precision bf16 the mask reads bf16 y and dy and writes bf16 (its zeros bf16
    constants): one node whose function (run by onnxruntime) and NumPy form give Where(y > 0, dy, 0)
    exactly."""
    from runtime.gpu.elementwise_fusion import fuse_relu_masks
    from runtime.gpu.elementwise_steps import round_bf16_numpy, widen_bf16_numpy

    b, f = TensorProto.BFLOAT16, TensorProto.FLOAT
    nodes = [helper.make_node("Cast", ["y32"], ["y"], to=b), helper.make_node("Cast", ["dy32"], ["dy"], to=b),
             helper.make_node("Greater", ["y", "zero"], ["mask"], name="mask"),
             helper.make_node("Where", ["mask", "dy", "zero"], ["dx"], name="relu_grad"),
             helper.make_node("Cast", ["dx"], ["out"], to=f, name="reader")]
    model = one_graph_model(nodes, [helper.make_tensor_value_info(n, f, [4, 8]) for n in ("y32", "dy32")],
                            [helper.make_tensor_value_info("out", f, [4, 8])], [helper.make_tensor("zero", b, [], [0.0])])
    model = onnx.shape_inference.infer_shapes(model)
    fused = fuse_relu_masks(model, {""})  # the Cast reading it counted as a native node
    node = fused.graph.node[2]
    assert node.domain == DOMAIN and [n.op_type for n in fused.graph.node if n.domain == ""] == ["Cast", "Cast", "Cast"]
    rng = np.random.default_rng(2)
    y = np.maximum(rng.normal(size=(4, 8)), 0).astype(np.float32)
    y[0, :3] = 0.0
    dy = rng.normal(size=(4, 8)).astype(np.float32)
    yb, dyb = (widen_bf16_numpy(round_bf16_numpy(a)) for a in (y, dy))  # onnxruntime's CPU has no bf16 Greater
    want = np.where(yb > 0, dyb, np.float32(0))
    np.testing.assert_array_equal(_session(fused, []).run(None, {"y32": y, "dy32": dy})[0], want)
    bits = evaluate_numpy(node, [round_bf16_numpy(y), round_bf16_numpy(dy)])[0]
    np.testing.assert_array_equal(bits, round_bf16_numpy(want))


@pytest.mark.parametrize("case", ["no native reader", "mask read elsewhere", "else value not zero", "threshold not zero",
                                  "else value broadcasts to a higher rank"])
def test_relu_s_backward_stays_with_onnxruntime_where_fusing_would_cut_or_change_it(case):
    from runtime.gpu.elementwise_fusion import fuse_relu_masks

    model = {"no native reader": lambda: _relu_grad_model(""),
             "mask read elsewhere": lambda: _relu_grad_model("test.native", mask_read_twice=True),
             "else value not zero": lambda: _relu_grad_model("test.native", else_value=-0.0),
             "threshold not zero": lambda: _relu_grad_model("test.native", threshold=0.5),
             "else value broadcasts to a higher rank": lambda: _relu_grad_model("test.native", zero_dims=(1, 1, 1))}[case]()
    assert fuse_relu_masks(model, {"test.native"}) is model


@pytest.mark.gpu
def test_the_relu_mask_kernel_equals_its_numpy_form(cupy_kernels):
    from runtime.gpu.elementwise_fusion import fuse_relu_masks

    cp = cupy_kernels.cp
    node = fuse_relu_masks(_relu_grad_model("test.native"), {"test.native"}).graph.node[1]
    rng = np.random.default_rng(1)
    runner = cupy_kernels.runner(node)
    # 16-byte loads over whole rows; a tail of 3 after them; views 4 bytes off (one element at a time).
    for shape, offset in (((64, 33), 0), ((7, 5), 0), ((1001,), 1)):
        y = np.maximum(rng.normal(size=shape), 0).astype(np.float32)
        dy = rng.normal(size=shape).astype(np.float32)
        y_dev, dy_dev = (cp.asarray(np.concatenate([np.zeros(offset, np.float32), a.reshape(-1)]))[offset:].reshape(shape)
                         for a in (y, dy))
        got = runner.run({"y": y_dev, "dy": dy_dev})
        np.testing.assert_array_equal(cp.asnumpy(got[0]), evaluate_numpy(node, [y, dy])[0], err_msg=str((shape, offset)))
        out = cp.full(shape, np.nan, dtype=cp.float32)  # a bound run writes every element
        runner.prepare(0, {"dx": out})
        runner.run_bound(0, {"y": y_dev, "dy": dy_dev})
        np.testing.assert_array_equal(cp.asnumpy(out), evaluate_numpy(node, [y, dy])[0], err_msg=str((shape, offset)))


@pytest.mark.parametrize("additions", [False, True])
def test_fused_nodes_carry_functions_that_infer_shapes_and_run_on_onnxruntime(gpt_train, additions):
    """Each fused node's op_type names a function of its steps in standard ops: shape inference sees
    through it (a segment holding it keeps static shapes), and onnxruntime runs it to the unfused
    graph's values; the relu mask's function equals Greater + Where exactly."""
    from runtime.gpu.elementwise_fusion import fuse_relu_masks

    model, feeds = gpt_train
    fused = fuse_elementwise(model, additions=additions)
    functions = {f.name for f in fused.functions if f.domain == DOMAIN}
    nodes = [n for n in fused.graph.node if n.domain == DOMAIN]
    assert nodes and {n.op_type for n in nodes} <= functions
    inferred = onnx.shape_inference.infer_shapes(fused)
    shaped = {v.name for v in inferred.graph.value_info if v.type.tensor_type.HasField("shape")}
    assert all(name in shaped for n in nodes for name in n.output)
    for want, got in zip(_session(model, []).run(None, feeds), _session(fused, []).run(None, feeds)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)

    relu = fuse_relu_masks(_relu_grad_model(""), {""})  # the reader's domain counted as native
    assert relu.graph.node[1].domain == DOMAIN
    rng = np.random.default_rng(1)
    x, dy = rng.normal(size=(2, 4, 8)).astype(np.float32)
    x[0, :3] = 0.0
    want = _session(_relu_grad_model(""), []).run(None, {"x": x, "dy": dy})
    np.testing.assert_array_equal(_session(relu, []).run(None, {"x": x, "dy": dy})[0], want[0])
