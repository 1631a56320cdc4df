"""Elementwise fusion with bfloat16 edges (--precision bf16; runtime/gpu/elementwise_steps.py): a
chain's casts from and to bfloat16 join it, so the fused node reads and writes bfloat16 itself,
and computes exactly what the graph's casts and float32 nodes compute. Checked on CPU against
onnxruntime (whose CPU provider has bf16 Cast and Transpose, not bf16 arithmetic) through the
NumPy form, and through the fused node's ONNX function; on a GPU, the CuPy kernel against the
NumPy form, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import one_graph_model
from onnx import TensorProto, helper

from runtime.gpu.elementwise_fusion import fuse_elementwise
from runtime.gpu.elementwise_steps import (
    DOMAIN,
    ROUND,
    WIDEN,
    evaluate_numpy,
    fused_steps,
    fused_types,
    round_bf16_numpy,
    widen_bf16_numpy,
)

F, B = TensorProto.FLOAT, TensorProto.BFLOAT16


def _model() -> onnx.ModelProto:
    """x (float) -> bf16 -> Transpose (a bf16 value no chain makes) -> [to float, *x, + b, to bf16]
    -> Transpose -> float: a bias-add-and-activation chain between two bf16 producers/readers,
    as a bf16 MatMul's output feeds one and the next MatMul reads its result."""
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=B),
             helper.make_node("Transpose", ["xb"], ["a"], perm=[1, 0]),
             helper.make_node("Cast", ["a"], ["af"], to=F),
             helper.make_node("Mul", ["af", "af"], ["sq"]),
             helper.make_node("Add", ["sq", "b"], ["s"]),
             helper.make_node("Cast", ["s"], ["sb"], to=B),
             helper.make_node("Transpose", ["sb"], ["tb"], perm=[1, 0]),
             helper.make_node("Cast", ["tb"], ["y"], to=F)]
    inputs = [helper.make_tensor_value_info("x", F, ["n", 64]), helper.make_tensor_value_info("b", F, ["n"])]
    return one_graph_model(nodes, inputs, [helper.make_tensor_value_info("y", F, [64, "n"])])


def _feeds(rows: int = 37) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 64)).astype(np.float32) * np.float32(3)
    x[0, :4] = [np.inf, -np.inf, np.nan, 1.00390625]  # a tie rounds to even (1.0039 = 1 + 2^-8)
    return {"x": x, "b": rng.normal(size=rows).astype(np.float32)}


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    """onnxruntime's CPU session of ``model`` as written (no graph optimizations)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return _session(model).run(None, feeds)[0]


def test_the_casts_join_the_chain_which_reads_and_writes_bfloat16():
    fused = fuse_elementwise(_model(), bfloat16=True)
    (node,) = [n for n in fused.graph.node if n.domain == DOMAIN]
    assert list(node.input) == ["a", "b"] and list(node.output) == ["sb"]
    assert fused_types(node) == ([B, F], [B])
    assert [op for op, _ in fused_steps(node)[0]] == [WIDEN, "Mul", "Add", ROUND]
    # The casts outside (each alone on its side of a Transpose) stay onnxruntime's.
    assert [n.op_type for n in fused.graph.node if n.domain != DOMAIN] == ["Cast", "Transpose", "Transpose", "Cast"]
    # Without bfloat16, the casts stay and only the float32 pair fuses.
    (plain,) = [n for n in fuse_elementwise(_model()).graph.node if n.domain == DOMAIN]
    assert fused_types(plain) == ([F, F], [F]) and list(plain.input) == ["af", "b"]


def test_the_fused_node_computes_what_the_casts_and_float32_nodes_computed():
    model, feeds = _model(), _feeds()
    fused = fuse_elementwise(model, bfloat16=True)
    (node,) = [n for n in fused.graph.node if n.domain == DOMAIN]
    expected = _run(model, feeds)
    # The NumPy form, from x's bf16 bits (rounded to nearest even by round_bf16_numpy, as
    # onnxruntime's Cast rounds), equals onnxruntime's values bit for bit (NaN where NaN).
    a = round_bf16_numpy(feeds["x"]).T.copy()
    (sb,) = evaluate_numpy(node, [a, feeds["b"]])
    got = (sb.astype(np.uint32) << 16).view(np.float32).T
    np.testing.assert_array_equal(got, expected)
    # onnxruntime running the fused node as its function (Casts and the float32 steps): the same.
    np.testing.assert_array_equal(_run(fused, feeds), expected)


def _scores_model() -> onnx.ModelProto:
    """The attention scores as --precision bf16 writes them: a bf16 product (here a Transpose's
    bf16 output) scaled and causally masked in bf16 (scale and fill are bf16 casts of constants),
    then cast up for the float32 Softmax."""
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=B),
             helper.make_node("Transpose", ["xb"], ["a"], perm=[1, 0]),
             helper.make_node("Constant", [], ["scale"], value_float=0.125),
             helper.make_node("Cast", ["scale"], ["scale_b"], to=B),
             helper.make_node("Constant", [], ["fill"], value_float=-np.inf),
             helper.make_node("Cast", ["fill"], ["fill_b"], to=B),
             helper.make_node("Mul", ["a", "scale_b"], ["s"]),
             helper.make_node("Where", ["m", "s", "fill_b"], ["w"]),
             helper.make_node("Cast", ["w"], ["wf"], to=F),
             helper.make_node("Softmax", ["wf"], ["y"], axis=-1)]
    inputs = [helper.make_tensor_value_info("x", F, ["n", 64]), helper.make_tensor_value_info("m", TensorProto.BOOL, ["n"])]
    return one_graph_model(nodes, inputs, [helper.make_tensor_value_info("y", F, [64, "n"])])


def test_nodes_computing_in_bfloat16_join_as_their_op_then_a_rounding():
    model = _scores_model()
    fused = fuse_elementwise(model, bfloat16=True)
    (node,) = [n for n in fused.graph.node if n.domain == DOMAIN]
    assert list(node.input) == ["a", "scale_b", "m", "fill_b"] and list(node.output) == ["wf"]
    assert fused_types(node) == ([B, B, TensorProto.BOOL, B], [F])
    assert [op for op, _ in fused_steps(node)[0]] == ["Mul", ROUND, "Where", ROUND, WIDEN]
    # Without bfloat16 nothing here is float32 elementwise but the Softmax's input cast: no cluster.
    assert not [n for n in fuse_elementwise(model).graph.node if n.domain == DOMAIN]
    # Values: the graph as the CPU backend computes bf16 (runtime/low_precision.py: each bf16 node in
    # float32, its output rounded once, as the GPU's kernels do), the fused graph run by onnxruntime
    # through the node's function, and the NumPy form: the same bits.
    from runtime.low_precision import lower

    rng = np.random.default_rng(1)
    feeds = {"x": rng.normal(size=(29, 64)).astype(np.float32) * np.float32(7), "m": rng.random(29) < 0.7}
    expected = _run(lower(model), feeds)
    np.testing.assert_array_equal(_run(fused, feeds), expected)
    a = round_bf16_numpy(feeds["x"]).T.copy()
    scale, fill = round_bf16_numpy(np.float32(0.125)), round_bf16_numpy(np.float32(-np.inf))
    (wf,) = evaluate_numpy(node, [a, scale, feeds["m"], fill])
    e = np.exp(wf - wf.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(e / e.sum(axis=-1, keepdims=True), expected, rtol=1e-6, atol=1e-7)


def test_a_bf16_sum_of_more_than_two_joins_rounded_once_as_the_cpu_backend_computes_it():
    """A bf16 Sum of three joins as one step, rounded once: what the CPU backend's lowering
    computes (onnxruntime's own bf16 kernel rounds each partial sum; the inputs here tell the two
    apart)."""
    from runtime.low_precision import lower

    nodes = [helper.make_node("Sum", ["a", "b", "c"], ["s"]), helper.make_node("Cast", ["s"], ["y"], to=F)]
    model = one_graph_model(nodes, [helper.make_tensor_value_info(n, B, ["n", 64]) for n in "abc"],
                            [helper.make_tensor_value_info("y", F, ["n", 64])])
    (node,) = fuse_elementwise(model, bfloat16=True).graph.node
    assert node.domain == DOMAIN and [op for op, _ in fused_steps(node)[0]] == ["Sum", ROUND, WIDEN]
    rng = np.random.default_rng(3)
    bits = [round_bf16_numpy(rng.normal(size=(5, 64)).astype(np.float32)) for _ in "abc"]
    wide = [widen_bf16_numpy(b) for b in bits]
    once = widen_bf16_numpy(round_bf16_numpy(wide[0] + wide[1] + wide[2]))
    partials = widen_bf16_numpy(round_bf16_numpy(widen_bf16_numpy(round_bf16_numpy(wide[0] + wide[1])) + wide[2]))
    assert not np.array_equal(once, partials)
    np.testing.assert_array_equal(_run(lower(model), dict(zip("abc", wide))), once)
    np.testing.assert_array_equal(evaluate_numpy(node, bits)[0], once)


def test_a_float32_attention_s_scale_and_mask_stay_onnxruntime_s():
    """In a float32 graph, Where does not fuse (onnxruntime folds the scale before it into its
    MatMul, which fusing the pair took away: GPT-2-small fp32 +1.26 ms, run h200-s29)."""
    nodes = [helper.make_node("MatMul", ["q", "k"], ["s0"]), helper.make_node("Mul", ["s0", "scale"], ["s"]),
             helper.make_node("Where", ["m", "s", "fill"], ["y"])]
    inputs = [helper.make_tensor_value_info("q", F, ["n", 8]), helper.make_tensor_value_info("k", F, [8, 64]),
              helper.make_tensor_value_info("m", TensorProto.BOOL, [64])]
    inits = [helper.make_tensor("scale", F, [], [0.125]), helper.make_tensor("fill", F, [], [-np.inf])]
    model = one_graph_model(nodes, inputs, [helper.make_tensor_value_info("y", F, ["n", 64])], inits)
    assert [n.op_type for n in fuse_elementwise(model, additions=True, bfloat16=True).graph.node] == ["MatMul", "Mul", "Where"]


@pytest.fixture(scope="module")
def gpt_bf16_train(tmp_path_factory):
    """The built-in small GPT's single-device training graph with --precision bf16, and one step's
    feeds (as conftest's gpt_train)."""
    from conftest import load_data

    import models
    from transpiler import OptimizerConfig, Options, transpile

    tmp = tmp_path_factory.mktemp("gpt_bf16")
    models.generate("gpt", tmp / "model", seed=0, rows=8)
    transpile(tmp / "model" / "model.onnx", tmp / "out", Options(optimizer=OptimizerConfig("adamw"), precision="bf16"))
    model = onnx.load(str(tmp / "out" / "train.onnx"))
    state = _session(onnx.load(str(tmp / "out" / "train_init.onnx"))).run(None, {})
    names = [o.name for o in onnx.load(str(tmp / "out" / "train_init.onnx")).graph.output]
    data = load_data(tmp / "model" / "data.npz")
    feeds = {**{k: v[:4] for k, v in data.items()}, **dict(zip(names, state)), "lr": np.array(1e-3, np.float32)}
    return model, {i.name: feeds[i.name] for i in model.graph.input}


def test_the_bf16_gpt_s_fused_step_computes_what_its_graph_computes(gpt_bf16_train):
    """The whole bf16 GPT training step, fused as the GPU backend fuses it: its fused nodes' ONNX
    functions give every output of the step bit for bit (the CPU backend's bf16 lowering, which
    rounds as the GPU's kernels do), and each fused node's NumPy form (the GPU kernel's reference,
    test below) gives its outputs from its inputs' values: float32 ones within float32 rounding of
    the math functions, bf16 ones bit for bit but for rare one-unit roundings after them."""
    import onnx.inliner

    from runtime.low_precision import lower

    model, feeds = gpt_bf16_train
    fused = fuse_elementwise(model, additions=True, bfloat16=True)
    nodes = [n for n in fused.graph.node if n.domain == DOMAIN]
    assert sum(B in t for n in nodes for t in fused_types(n)) >= 20  # chains reading or writing bf16
    lowered = lower(model)
    # The lowering drops a cast up of a bf16 value (held as the float32 it equals): such a name has
    # no value of its own there, and the nodes reading or writing one are not checked one by one.
    there = {o for n in lowered.graph.node for o in n.output} | set(feeds)
    checked = [n for n in nodes if all(name in there for name in (*n.input, *n.output))]
    assert len(checked) >= len(nodes) // 2 and any(B in fused_types(n)[0] for n in checked)
    names = list(dict.fromkeys(name for n in checked for name in (*n.input, *n.output)))
    known = {o.name for o in lowered.graph.output}
    lowered.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in known | set(feeds))
    session = _session(lowered)
    values = {**feeds, **dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))}
    steps = _session(lower(onnx.inliner.inline_local_functions(fused))).run(None, feeds)
    for name, got in zip([o.name for o in model.graph.output], steps):
        np.testing.assert_array_equal(got, values[name], err_msg=name)
    for node in checked:
        input_types, output_types = fused_types(node)
        inputs = [round_bf16_numpy(values[n]) if t == B else values[n] for n, t in zip(node.input, input_types)]
        for name, t, got in zip(node.output, output_types, evaluate_numpy(node, inputs)):
            if t != B:
                np.testing.assert_allclose(got, values[name], rtol=2e-5, atol=1e-6, err_msg=f"{node.name}: {name}")
                continue
            # A math function's last float bit (NumPy's erf against onnxruntime's erff) may carry
            # a bf16 rounding one unit the other way: rare, and never more than one unit.
            apart = np.abs(got.astype(np.int32) - round_bf16_numpy(values[name]).astype(np.int32))
            assert apart.max() <= 1 and np.count_nonzero(apart) <= 1e-4 * apart.size, f"{node.name}: {name}"


@pytest.mark.gpu
def test_the_cupy_kernels_equal_the_numpy_form_bit_for_bit(cupy_kernels):
    cp = cupy_kernels.cp
    feeds = _feeds()
    rng = np.random.default_rng(1)
    cases = [(_model(), [round_bf16_numpy(feeds["x"]).T.copy(), feeds["b"]]),
             (_scores_model(), [round_bf16_numpy(feeds["x"]).T.copy(), round_bf16_numpy(np.float32(0.125)),
                                rng.random(len(feeds["b"])) < 0.7, round_bf16_numpy(np.float32(-np.inf))])]
    for model, inputs in cases:
        (node,) = [n for n in fuse_elementwise(model, bfloat16=True).graph.node if n.domain == DOMAIN]
        (got,) = cupy_kernels.runner(node).run({n: cp.asarray(v) for n, v in zip(node.input, inputs)})
        expected = evaluate_numpy(node, inputs)[0]
        assert got.dtype == expected.dtype
        got = cp.asnumpy(got)
        # Bit for bit but for NaN's payload: the GPU's NaN * NaN is 0x7fffffff, NumPy's 0x7fc00000
        # (one H200); either is bfloat16's NaN after rounding.
        as_float = (lambda v: widen_bf16_numpy(v)) if got.dtype == np.uint16 else (lambda v: v)
        nan = np.isnan(as_float(expected))
        assert np.array_equal(nan, np.isnan(as_float(got)))
        np.testing.assert_array_equal(got[~nan], expected[~nan])
