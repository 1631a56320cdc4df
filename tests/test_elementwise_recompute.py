"""Recompute instead of store (runtime/gpu/elementwise_recompute.py), on CPU: in a bf16 graph shaped
like GPT's MLP (a bf16 MatMul output, a bias, a GELU forward writing bf16 and the derivative of GELU
clustered into it, read only by the backward's chain), the forward's fused node no longer writes
the float32 derivative, the backward's reads the bf16 input and the bias and computes it, and the
fused graph computes every output bit for bit as the unfused one (plain onnxruntime, the fused
nodes' functions); where the inputs are as large as the output (float32), or where anything else
reads the output, nothing moves."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import pytest
from conftest import one_graph_model
from onnx import TensorProto, helper

from runtime.gpu.elementwise_fusion import fuse_elementwise
from runtime.gpu.elementwise_steps import DOMAIN, fused_steps, fused_types, round_bf16_numpy, widen_bf16_numpy
from runtime.low_precision import lower

F, B = TensorProto.FLOAT, TensorProto.BFLOAT16
ROWS, T, WIDTH = 4, 16, 64  # (rows, T, WIDTH), rows symbolic (as the batch is), so the chains fuse at any size


def _const(name: str, value: float) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, F, [], [value]))


def _model(low: bool = True, derivative_read_outside: bool = False) -> onnx.ModelProto:
    """h = x (+ b); y = GELU(h) (bf16 where ``low``); dy = Transpose(Transpose(y)), so the backward
    chain (dy * 0.5 * d, d the derivative of GELU at h, computed by the forward's nodes) cannot join
    the forward's cluster; dx its result. ``derivative_read_outside``: d is a graph output too."""
    widen = [helper.make_node("Cast", ["x"], ["xw"], to=F)] if low else []
    h_in = "xw" if low else "x"
    nodes = [*widen, _const("c_sqrt2", 1.4142135381698608), _const("c_one", 1.0), _const("c_half", 0.5),
             _const("c_isqrt2", 0.7071067690849304), _const("c_log", -0.2257913500070572),
             helper.make_node("Add", [h_in, "b"], ["h"]),
             helper.make_node("Div", ["h", "c_sqrt2"], ["h1"]), helper.make_node("Erf", ["h1"], ["e"]),
             helper.make_node("Add", ["e", "c_one"], ["e1"]), helper.make_node("Mul", ["h", "e1"], ["g0"]),
             helper.make_node("Mul", ["g0", "c_half"], ["g"]),
             # the derivative, as the autodiff writes GELU's: (1 + erf(h / sqrt 2)) + h * exp(c - (h/sqrt 2)^2)
             helper.make_node("Mul", ["h", "c_isqrt2"], ["u"]), helper.make_node("Erf", ["u"], ["eu"]),
             helper.make_node("Add", ["eu", "c_one"], ["eu1"]), helper.make_node("Mul", ["u", "u"], ["uu"]),
             helper.make_node("Sub", ["c_log", "uu"], ["z"]), helper.make_node("Exp", ["z"], ["ez"]),
             helper.make_node("Mul", ["h", "ez"], ["hz"]), helper.make_node("Add", ["eu1", "hz"], ["d"])]
    if low:
        nodes += [helper.make_node("Cast", ["g"], ["y"], to=B)]
    else:
        nodes += [helper.make_node("Identity", ["g"], ["y"])]
    nodes += [helper.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1]),
              helper.make_node("Transpose", ["yt"], ["dy"], perm=[0, 2, 1])]
    dy = "dy"
    if low:
        nodes.append(helper.make_node("Cast", ["dy"], ["dyw"], to=F))
        dy = "dyw"
    nodes += [helper.make_node("Mul", [dy, "c_half"], ["dh0"]), helper.make_node("Mul", ["dh0", "d"], ["dx32"])]
    if low:
        nodes.append(helper.make_node("Cast", ["dx32"], ["dxb"], to=B))
    last = "dxb" if low else "dx32"
    nodes += [helper.make_node("Cast", [last], ["dx"], to=F), helper.make_node("Cast", ["y"], ["y_out"], to=F)]
    kind = B if low else F
    inputs = [helper.make_tensor_value_info("x", kind, ["rows", T, WIDTH]), helper.make_tensor_value_info("b", F, [WIDTH])]
    outputs = [helper.make_tensor_value_info("y_out", F, ["rows", T, WIDTH]), helper.make_tensor_value_info("dx", F, ["rows", T, WIDTH])]
    if derivative_read_outside:
        outputs.append(helper.make_tensor_value_info("d", F, ["rows", T, WIDTH]))
    return onnx.shape_inference.infer_shapes(one_graph_model(nodes, inputs, outputs))


def _run(model: onnx.ModelProto, rows: tuple[str, ...] = ("b",), seed: int = 0) -> list[np.ndarray]:
    """The model on onnxruntime's CPU provider: the fused nodes as their functions, bf16 values as
    the CPU backend lowers them (the float32 values they equal: x fed rounded to bf16); ``rows``:
    the float32 inputs of WIDTH values."""
    model = lower(onnx.inliner.inline_local_functions(model))
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(ROWS, T, WIDTH)) * 2).astype(np.float32)
    feeds = {"x": widen_bf16_numpy(round_bf16_numpy(x)), **{n: rng.normal(size=WIDTH).astype(np.float32) for n in rows}}
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _fused(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == DOMAIN]


def test_the_backward_recomputes_the_derivative_from_the_bf16_input():
    model = _model()
    fused = fuse_elementwise(model, additions=True, bfloat16=True)
    forward, backward = _fused(fused)
    assert list(forward.output) == ["y", "y_out"] and fused_types(forward)[1] == [B, F]  # GELU (bf16) and its widening
    assert "Exp" not in {op for op, _ in fused_steps(forward)[0]}  # the derivative's steps went with it
    assert set(backward.input) == {"dy", "x", "b"} and "Exp" in {op for op, _ in fused_steps(backward)[0]}
    assert "d" not in {name for n in fused.graph.node for name in [*n.input, *n.output]}
    for got, want in zip(_run(fused), _run(model)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("low, outside", [(False, False), (True, True)])
def test_an_output_as_small_as_its_inputs_or_read_elsewhere_stays(low, outside):
    """float32: the input x is as large as the derivative, so storing it moves no more bytes;
    a derivative that is also a graph output must be written anyway."""
    fused = fuse_elementwise(_model(low, outside), additions=True, bfloat16=True)
    forward = _fused(fused)[0]
    assert "d" in forward.output and any("d" in n.input for n in _fused(fused)[1:])


def test_a_producer_keeps_its_later_inputs_in_order_when_an_earlier_one_goes_with_the_chain():
    """The producer reads x, then k (a row only the moved chain uses), then b: what it keeps reads x
    and b at their new positions, and the step still computes what the graph does."""
    cast = lambda a, b, to: helper.make_node("Cast", [a], [b], to=to)  # noqa: E731
    nodes = [cast("x", "xw", F), helper.make_node("Mul", ["xw", "k"], ["o"]),
             helper.make_node("Add", ["xw", "b"], ["s"]), cast("s", "y", B),
             helper.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["yt"], ["dy"], perm=[0, 2, 1]), cast("dy", "dyw", F),
             helper.make_node("Mul", ["dyw", "o"], ["g"]), cast("g", "gb", B), cast("gb", "out", F)]
    inputs = [helper.make_tensor_value_info("x", B, ["rows", T, WIDTH])]
    inputs += [helper.make_tensor_value_info(n, F, [WIDTH]) for n in ("k", "b")]
    model = onnx.shape_inference.infer_shapes(one_graph_model(
        nodes, inputs, [helper.make_tensor_value_info("out", F, ["rows", T, WIDTH])]))
    fused = fuse_elementwise(model, additions=True, bfloat16=True)
    forward, backward = _fused(fused)
    assert list(forward.input) == ["x", "b"] and list(forward.output) == ["y"]
    assert set(backward.input) == {"dy", "x", "k"}
    np.testing.assert_array_equal(_run(fused, ("k", "b"), seed=2)[0], _run(model, ("k", "b"), seed=2)[0])
