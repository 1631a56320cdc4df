"""ConvWeightGrad for bfloat16 and float16 Convs (--precision bf16|fp16), on CPU.

- The transpiler writes the node for a low-precision Conv as for a float32 one: X, dY and dW in the
  low dtype, dW read only by the Cast rule's cast back to the float32 parameter's gradient; the
  per-tap GEMM form (one Slice copy of X and one Gemm per kernel tap) is gone.
- The CPU backend (runtime/low_precision.py inlines the node's function where its inputs are low
  precision: its Conv computed in float32 and rounded once) gives the weight gradients the per-tap
  form gave, to one rounding that falls the other way, and every other gradient bit for bit; 2
  ranks train as the per-tap form trained them.
- The node's dW is the exact weight gradient of the bf16 inputs rounded once to bf16 (what cuDNN's
  backward-filter with float accumulation gives) and PyTorch's bf16 one to one rounding.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from conftest import load_data, spacing
from onnx import TensorProto, helper, numpy_helper
from test_gpu_conv_grad import _float64  # dW in float64: the exact gradient of the rounded inputs

from contract.ops import CONV_WEIGHT_GRAD
from runtime import simulate
from runtime.low_precision import lower
from transpiler import OptimizerConfig, Options, build, transpile
from transpiler.autodiff.rules import conv as conv_rules
from transpiler.job import LOSS_SCALE_STATE

LOW = {"bf16": ir.DataType.BFLOAT16, "fp16": ir.DataType.FLOAT16}
NUMPY = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}
MANTISSA = {"bf16": 7, "fp16": 10}  # stored mantissa bits


def _per_tap(monkeypatch) -> None:
    """The weight gradients as they were before the node took low-precision X: per-tap GEMMs."""
    monkeypatch.setattr(conv_rules, "NODE_DTYPES", frozenset({ir.DataType.FLOAT}))
    monkeypatch.setattr(conv_rules, "WEIGHT_GRAD", "gemm")


def _ulp(values: np.ndarray, precision: str) -> np.ndarray:
    """The spacing of the low dtype's numbers at ``values`` (bf16 and fp16 results here are far from
    the subnormals)."""
    return spacing(values, MANTISSA[precision])


def _gradients(path, precision: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every parameter's gradient of one batch: the transpiler's forward + backward, run as the CPU
    backend runs low-precision graphs (runtime/low_precision.py)."""
    job = build(path, Options(precision=precision))
    session = ort.InferenceSession(lower(job.fwd_bwd["single"]).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    names = sorted(job.grad_names)
    feeds = dict(feeds)
    if any(i.name == LOSS_SCALE_STATE for i in session.get_inputs()):  # fp16: the loss scaled by 1
        feeds[LOSS_SCALE_STATE] = np.ones([], np.float32)
    return dict(zip(names, session.run([job.grad_names[n] for n in names], feeds)))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_convs_get_the_weight_gradient_node(precision, model_dir, monkeypatch):
    path = model_dir("cnn_small") / "model.onnx"
    model = build(path, Options(precision=precision)).single.step
    convs = [n for n in model.graph if n.op_type == "Conv"]
    nodes = [n for n in model.graph if n.op_type == CONV_WEIGHT_GRAD]
    assert convs and len(nodes) == len(convs)
    for node in nodes:
        assert [v.dtype for v in node.inputs] == [LOW[precision]] * 2 and node.outputs[0].dtype == LOW[precision]
        # dW goes back to float32 through the Cast rule's one cast (the parameter's gradient).
        (use,) = [u.node for u in node.outputs[0].uses()]
        assert use.op_type == "Cast" and use.outputs[0].dtype == ir.DataType.FLOAT
    assert any(f.name == CONV_WEIGHT_GRAD for f in model.functions.values())
    assert not [n for n in model.graph if n.op_type == "Slice"], "no per-tap copies of X are left"
    _per_tap(monkeypatch)  # before: no node, one Slice per tap
    before = build(path, Options(precision=precision)).single.step
    assert not [n for n in before.graph if n.op_type == CONV_WEIGHT_GRAD]
    assert [n for n in before.graph if n.op_type == "Slice"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cpu_backend_gradients_equal_the_per_tap_forms(precision, model_dir, monkeypatch):
    """Each Conv weight gradient: one float32 sum per element rounded once either way (the per-tap
    Gemm's output, the node's Conv), so the two differ only where the summation order moves the sum
    across a rounding boundary: by at most one spacing of the low dtype, plus float32 summation
    error. Nothing else changes: the input gradients do not read dW."""
    path = model_dir("cnn_small") / "model.onnx"
    data = load_data(model_dir("cnn_small") / "data.npz")
    feeds = {k: v[:32] for k, v in data.items()}
    node = _gradients(path, precision, feeds)
    with monkeypatch.context() as patch:
        _per_tap(patch)
        taps = _gradients(path, precision, feeds)
    model = onnx.load(path)
    conv_weights = {n.input[1] for n in model.graph.node if n.op_type == "Conv"}
    assert conv_weights and conv_weights <= node.keys()
    equal = total = 0
    for name, value in node.items():
        if name not in conv_weights:
            np.testing.assert_array_equal(value, taps[name], err_msg=name)
            continue
        other = taps[name]
        bound = _ulp(np.maximum(np.abs(value), np.abs(other)), precision) + 1e-5 * np.max(np.abs(other))
        assert np.all(np.abs(value - other) <= bound), name
        # Both are low-precision numbers (float32 holding them), and mostly the same ones.
        np.testing.assert_array_equal(value.astype(NUMPY[precision]).astype(np.float32), value)
        equal += int(np.sum(value == other))
        total += value.size
    assert equal >= 0.9 * total, f"only {equal} of {total} weight-gradient elements agree exactly"


def test_bf16_training_on_the_cpu_backend_follows_the_per_tap_form(model_dir, tmp_path, monkeypatch):
    """cnn_small, --precision bf16, 2 ranks, 8 AdamW steps (the CPU backend: runtime.simulate)."""
    path = model_dir("cnn_small") / "model.onnx"
    data = load_data(model_dir("cnn_small") / "data.npz")
    options = dict(world_size=2, optimizer=OptimizerConfig("adamw", lr=1e-3), precision="bf16")
    transpile(path, tmp_path / "node", Options(**options))
    with monkeypatch.context() as patch:
        _per_tap(patch)
        transpile(path, tmp_path / "taps", Options(**options))
    assert any(n.op_type == CONV_WEIGHT_GRAD for n in onnx.load(tmp_path / "node" / "rank0.onnx").graph.node)
    assert not any(n.op_type == CONV_WEIGHT_GRAD for n in onnx.load(tmp_path / "taps" / "rank0.onnx").graph.node)
    node, taps = (simulate(tmp_path / key, data, batch=32, steps=8) for key in ("node", "taps"))
    # test_precision_torch's spread (PyTorch's bf16 against its fp32 over 20 steps) is ~6e-4.
    assert np.max(np.abs(np.array(node.losses) - np.array(taps.losses))) <= 1e-4
    for name, value in node.parameters[0].items():
        np.testing.assert_allclose(value, taps.parameters[0][name], rtol=0, atol=1e-4, err_msg=name)


# (X shape, kernel, strides, dilations, pads) where the node applies: the ResNet shapes and a
# dilated, rectangular one (tests/test_gpu_conv_grad.py's cases).
CASES = [
    ((4, 8, 12, 12), [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
    ((4, 8, 12, 12), [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),
    ((4, 8, 12, 12), [1, 1], [2, 2], [1, 1], [0, 0, 0, 0]),
    ((4, 6, 15, 12), [3, 2], [1, 2], [2, 1], [2, 0, 2, 0]),
]


def _one_conv(tmp_path, case: int, m: int = 6):
    """loss = sum(Conv(x, w) * c) with w a parameter, and a batch of x and c."""
    x_shape, kernel, strides, dilations, pads = CASES[case]
    outs = [(size + 2 * p - d * (kk - 1) - 1) // s + 1
            for size, kk, s, d, p in zip(x_shape[2:], kernel, strides, dilations, pads)]
    rng = np.random.default_rng(case)
    w = rng.normal(size=(m, x_shape[1], *kernel)).astype(np.float32)
    feeds = {"x": rng.normal(size=x_shape).astype(np.float32), "c": rng.normal(size=(x_shape[0], m, *outs)).astype(np.float32)}
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=kernel, strides=strides, dilations=dilations, pads=pads),
         helper.make_node("Mul", ["y", "c"], ["yc"]),
         helper.make_node("ReduceSum", ["yc"], ["loss"], keepdims=0)],
        "conv", [helper.make_tensor_value_info("x", f32, ["batch", *x_shape[1:]]),
                 helper.make_tensor_value_info("c", f32, ["batch", m, *outs])],
        [helper.make_tensor_value_info("loss", f32, [])], initializer=[numpy_helper.from_array(w, "w")])
    path = tmp_path / f"conv{case}.onnx"
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path, w, feeds, (kernel, strides, dilations, pads)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_bf16_node_is_the_exact_gradient_rounded_once_and_torch_bf16s(case, tmp_path):
    path, w, feeds, attrs = _one_conv(tmp_path, case)
    job = build(path, Options(precision="bf16"))
    assert [n for n in job.single.step.graph if n.op_type == CONV_WEIGHT_GRAD]
    ours = _gradients(path, "bf16", feeds)["w"]
    # The Conv reads X in bf16 and its output's gradient is c rounded to bf16 (the Mul is float32).
    low = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in feeds.items()}
    exact = _float64(low["x"], low["c"], *attrs)
    scale = _float64(np.abs(low["x"]), np.abs(low["c"]), *attrs)
    # Rounded to nearest from a float32 sum: within half a spacing of the exact sum, plus the float32
    # summation error (where that moves it across a boundary).
    assert np.all(np.abs(ours - exact) <= 0.5 * _ulp(exact, "bf16") + 1e-6 * scale)
    torch = pytest.importorskip("torch")
    weight = torch.nn.Parameter(torch.from_numpy(w))
    kernel, strides, dilations, pads = attrs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.nn.functional.conv2d(torch.from_numpy(feeds["x"]), weight, stride=strides,
                                       padding=pads[:2], dilation=dilations)
    (y * torch.from_numpy(feeds["c"])).sum().backward()
    theirs = weight.grad.numpy()
    assert np.all(np.abs(ours - theirs) <= _ulp(np.maximum(np.abs(ours), np.abs(theirs)), "bf16") + 1e-6 * scale)
