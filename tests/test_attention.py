"""The fused attention nodes (transpiler/attention.py, transpiler/attention_ops.py) on CPU:

- the functions equal torch's scaled_dot_product_attention, forward and backward, causal or not;
- the rewrite finds the exported pattern (torch.tril's causal mask or none) after --precision bf16,
  leaves what it cannot prove the same alone (another mask, dropout on the probabilities), and the
  graph it writes computes what the pattern computed, as the CPU backend runs bf16;
- --precision fp32 writes none: the float32 step stays as it was.
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from contract.ops import ATTENTION, ATTENTION_DOMAIN, ATTENTION_GRAD
from runtime.low_precision import lower
from transpiler.attention import fuse_attention
from transpiler.native_ops import add_op_functions

torch = pytest.importorskip("torch")

B, S, H, D = 2, 6, 3, 8
BF16, FLOAT = TensorProto.BFLOAT16, TensorProto.FLOAT


def _info(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _functions(causal: int, scale: float, opset: int):
    """Attention then AttentionGrad on float32 (B, S, H, D) heads, through their functions."""
    attrs = {"scale": scale, "causal": causal}
    nodes = [helper.make_node(ATTENTION, ["q", "k", "v"], ["y", "lse"], domain=ATTENTION_DOMAIN, **attrs),
             helper.make_node(ATTENTION_GRAD, ["dy", "q", "k", "v", "y", "lse"], ["dq", "dk", "dv"],
                              domain=ATTENTION_DOMAIN, **attrs)]
    heads = [B, S, H, D]
    graph = helper.make_graph(nodes, "g", [_info(n, FLOAT, heads) for n in ("q", "k", "v", "dy")],
                              [_info("y", FLOAT, heads), _info("lse", FLOAT, [B, H, S, 1]),
                               *(_info(n, FLOAT, heads) for n in ("dq", "dk", "dv"))])
    model = ir.serde.deserialize_model(helper.make_model(graph, ir_version=10,
                                                         opset_imports=[helper.make_opsetid("", opset)]))
    assert add_op_functions(model) == {(ATTENTION_DOMAIN, ATTENTION), (ATTENTION_DOMAIN, ATTENTION_GRAD)}
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto)
    return _session(proto)


@pytest.mark.parametrize("opset", [17, 18])  # ReduceMax's axes: an attribute below 18, an input from it
@pytest.mark.parametrize("causal", [1, 0])
def test_the_functions_equal_torch_sdpa_forward_and_backward(causal, opset):
    rng = np.random.default_rng(causal)
    arrays = {n: rng.normal(size=(B, S, H, D)).astype(np.float32) for n in ("q", "k", "v", "dy")}
    scale = 0.3
    y, lse, dq, dk, dv = _functions(causal, scale, opset).run(None, arrays)
    q, k, v = (torch.tensor(arrays[n], dtype=torch.float64).transpose(1, 2).requires_grad_() for n in "qkv")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), scale=scale)
    ref.backward(torch.tensor(arrays["dy"], dtype=torch.float64).transpose(1, 2))
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(
        torch.ones(S, S, dtype=torch.bool).triu(1) if causal else torch.zeros(S, S, dtype=torch.bool), float("-inf"))
    expected = {"y": ref.transpose(1, 2), "lse": torch.logsumexp(scores, -1, keepdim=True),
                "dq": q.grad.transpose(1, 2), "dk": k.grad.transpose(1, 2), "dv": v.grad.transpose(1, 2)}
    for name, got in zip(("y", "lse", "dq", "dk", "dv"), (y, lse, dq, dk, dv)):
        np.testing.assert_allclose(got, expected[name].detach().numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


def _pattern(mask: str, dropout: bool = False) -> ir.Model:
    """The exported attention after PrecisionPass (bf16 heads, the softmax in float32 between
    casts), on (B, S, H, D) inputs, its output back in that layout: ``mask`` "tril" (torch.tril of
    ones, Not, masked_fill), "none", "triu" (not causal: hides the past) or "additive"."""
    nodes = [helper.make_node("Cast", [n], [f"{n}16"], to=BF16) for n in ("xq", "xk", "xv")]
    nodes += [helper.make_node("Transpose", ["xq16"], ["q"], perm=[0, 2, 1, 3]),
              helper.make_node("Transpose", ["xk16"], ["kt"], perm=[0, 2, 3, 1]),
              helper.make_node("Transpose", ["xv16"], ["v"], perm=[0, 2, 1, 3]),
              helper.make_node("MatMul", ["q", "kt"], ["s"]),
              helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", BF16, [], [0.25])),
              helper.make_node("Mul", ["s", "c"], ["scaled"])]
    last = "scaled"
    if mask in ("tril", "triu"):
        nodes += [helper.make_node("Constant", [], ["size"], value=helper.make_tensor("size", TensorProto.INT64, [2], [S, S])),
                  helper.make_node("ConstantOfShape", ["size"], ["ones"],
                                   value=helper.make_tensor("one", TensorProto.BOOL, [1], [True])),
                  helper.make_node("Trilu", ["ones"], ["tri"], upper=int(mask == "triu")),
                  helper.make_node("Not", ["tri"], ["hide"]),
                  helper.make_node("Constant", [], ["inf"], value=helper.make_tensor("inf", BF16, [], [-np.inf])),
                  helper.make_node("Where", ["hide", "inf", "scaled"], ["masked"])]
        last = "masked"
    elif mask == "additive":
        nodes += [helper.make_node("Constant", [], ["bias"], value=helper.make_tensor("bias", BF16, [], [0.5])),
                  helper.make_node("Add", ["scaled", "bias"], ["masked"])]
        last = "masked"
    nodes += [helper.make_node("Cast", [last], ["wide"], to=FLOAT),
              helper.make_node("Softmax", ["wide"], ["p"], axis=-1)]
    if dropout:
        nodes += [helper.make_node("Dropout", ["p"], ["p_kept"])]
    nodes += [helper.make_node("Cast", ["p_kept" if dropout else "p"], ["p16"], to=BF16),
              helper.make_node("MatMul", ["p16", "v"], ["o"]),
              helper.make_node("Transpose", ["o"], ["o_bshd"], perm=[0, 2, 1, 3]),
              helper.make_node("Cast", ["o_bshd"], ["y"], to=FLOAT)]
    graph = helper.make_graph(nodes, "g", [_info(n, FLOAT, [B, S, H, D]) for n in ("xq", "xk", "xv")],
                              [_info("y", FLOAT, [B, S, H, D])])
    return ir.serde.deserialize_model(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)]))


def _run_lowered(model: ir.Model, arrays) -> np.ndarray:
    """The model as the CPU backend runs bf16 (runtime/low_precision.py)."""
    add_op_functions(model)
    return _session(lower(ir.serde.serialize_model(model))).run(None, arrays)[0]


@pytest.mark.parametrize("mask", ["tril", "none"])
def test_the_pattern_becomes_one_node_that_computes_what_it_computed(mask):
    rng = np.random.default_rng(3)
    arrays = {n: rng.normal(size=(B, S, H, D)).astype(np.float32) for n in ("xq", "xk", "xv")}
    before = _run_lowered(_pattern(mask), arrays)
    model = _pattern(mask)
    assert len(fuse_attention(model.graph)) == 1
    ops = [n.op_type for n in model.graph]
    # The heads' and the output's layout transposes went with the pattern: the node reads the casts.
    assert ops == ["Cast", "Cast", "Cast", ATTENTION, "Cast"], ops
    node = next(n for n in model.graph if n.op_type == ATTENTION)
    assert node.attributes.get_int("causal") == int(mask == "tril")
    assert node.attributes.get_float("scale") == 0.25
    after = _run_lowered(model, arrays)
    # The fused node keeps the scores in float32 where the pattern rounded them (and the scaled
    # ones) to bf16 first: the outputs agree to a few bf16 roundings.
    np.testing.assert_allclose(after, before, rtol=0, atol=4 * 2.0 ** -8 * float(np.max(np.abs(before))))


@pytest.mark.parametrize("mask, dropout", [("triu", False), ("additive", False), ("tril", True)])
def test_what_is_not_provably_the_pattern_is_left_alone(mask, dropout):
    model = _pattern(mask, dropout)
    before = [n.op_type for n in model.graph]
    assert fuse_attention(model.graph) == []
    assert [n.op_type for n in model.graph] == before


def test_only_low_precision_steps_get_the_node(model_dir, tmp_path):
    from transpiler import OptimizerConfig, Options, transpile

    counts = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        transpile(model_dir("gpt") / "model.onnx", out,
                  Options(world_size=2, precision=precision, optimizer=OptimizerConfig("adamw", lr=1e-3)))
        graph = onnx.load(str(out / "rank0.onnx"), load_external_data=False).graph
        counts[precision] = {op: sum(n.op_type == op for n in graph.node) for op in (ATTENTION, ATTENTION_GRAD, "Softmax")}
    assert counts["fp32"] == {ATTENTION: 0, ATTENTION_GRAD: 0, "Softmax": 4}
    assert counts["bf16"] == {ATTENTION: 4, ATTENTION_GRAD: 4, "Softmax": 0}


def test_the_gpu_runner_builds_one_plan_per_shape_and_runs_each_node_on_its_buffers(monkeypatch):
    """runtime/gpu/attention.py without a GPU: cuDNN's frontend stood in for. The first call builds
    a plan per (kind, shape, attributes), shared by equal nodes, reserves its workspace and gives
    each node's outputs; every call executes each node's plan on its own buffers' addresses."""
    from types import SimpleNamespace

    from runtime.gpu import attention
    from runtime.segments import NativeGroup

    class Array:  # what the runner reads of a CuPy array
        count = 0

        def __init__(self, shape, dtype):
            Array.count += 1
            self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)
            self.flags = SimpleNamespace(c_contiguous=True)
            self.data = SimpleNamespace(ptr=256 * Array.count)

    built, executed, reserved = [], [], []

    class Plan:  # attention._Plan's interface, built from the key alone
        def __init__(self, frontend_module, handle, key):
            built.append(key)
            self.tensors = [f"{'grad' if key.grad else 'fwd'}{i}" for i in range(9 if key.grad else 5)]
            self.graph = SimpleNamespace(execute=lambda pointers, workspace, handle: executed.append((pointers, workspace)))
            self.workspace = 1000 if key.grad else 10

    streams = []
    monkeypatch.setitem(sys.modules, attention.MODULE, SimpleNamespace(
        create_handle=lambda: "handle", set_stream=lambda handle, stream: streams.append(stream)))
    monkeypatch.setattr(attention, "_Plan", Plan)
    monkeypatch.setattr(attention, "_FRONTENDS", {})
    cudnn = SimpleNamespace(reserve=reserved.append, pointer=lambda: 4096)
    device = SimpleNamespace(device_id=0, compute=SimpleNamespace(ptr=7), cudnn=lambda: cudnn,
                             cp=SimpleNamespace(empty=lambda shape, dtype: Array(shape, dtype)))
    attrs = {"scale": 0.125, "causal": 1}
    nodes = tuple(helper.make_node(ATTENTION, [f"q{i}", f"k{i}", f"v{i}"], [f"y{i}", f"lse{i}"], name=f"attn{i}",
                                   domain=ATTENTION_DOMAIN, **attrs) for i in range(2))
    nodes += (helper.make_node(ATTENTION_GRAD, ["dy", "q0", "k0", "v0", "y0", "lse0"], ["dq", "dk", "dv"],
                               name="attn0_grad", domain=ATTENTION_DOMAIN, **attrs),)
    runner = attention.AttentionRunner(NativeGroup(0, 0, 1, nodes, (), ()), "rank0.onnx", device)
    values = {f"{n}{i}": Array((2, 16, 4, 64), np.uint16) for n in "qkv" for i in range(2)}
    values["dy"] = Array((2, 16, 4, 64), np.uint16)
    runner.launch(values, allocate=True)
    assert [k.grad for k in built] == [False, True]  # the two forward nodes share one plan
    assert streams == [7]  # one handle, on the compute stream
    assert reserved == [10, 10, 1000]
    assert values["lse1"].shape == (2, 4, 16, 1) and values["lse1"].dtype == np.float32
    assert values["dq"].shape == (2, 16, 4, 64) and values["dq"].dtype == np.uint16
    (first, _), (second, _), (grad, workspace) = executed
    assert first == {f"fwd{i}": values[n].data.ptr for i, n in enumerate(["q0", "k0", "v0", "y0", "lse0"])}
    assert second["fwd0"] == values["q1"].data.ptr and workspace == 4096
    assert grad == {f"grad{i}": values[n].data.ptr
                    for i, n in enumerate(["dy", "q0", "k0", "v0", "y0", "lse0", "dq", "dk", "dv"])}
    values["q1"] = Array((2, 16, 4, 64), np.uint16)  # a bound run: the other parity's buffer
    runner.launch(values, allocate=False)
    assert len(built) == 2 and executed[4][0]["fwd0"] == values["q1"].data.ptr
