"""The LayerNormGrad node (transpiler/layernorm_ops.py): its function, as the CPU backend runs it,
equals PyTorch's layer_norm gradient (CPU); the autodiff writes it only where its contract holds;
on the GPU, the kernels (runtime/gpu/layernorm.py) equal the function, first call and bound runs,
bit-identical from run to run; a malformed node or a short input is refused naming it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from conftest import spacing
from onnx import TensorProto, helper

from contract.ops import LAYERNORM_DOMAIN, LAYERNORM_GRAD
from runtime.errors import RunError
from runtime.gpu import cuda_available, gpu_count
from runtime.gpu.column_sums import row_parts
from runtime.gpu.layernorm import LayerNormRunner, row_threads
from runtime.segments import NativeGroup
from transpiler.autodiff import build_gradients
from transpiler.native_ops import add_op_functions

# (..., C): GPT-like rows, a width that is no multiple of the 4 elements a thread takes or of a warp,
# one of a single row, one wider than a block's 512 threads take in one sweep, GPT-2-small's (the
# rows cut into runs for the parameter gradients, the last run shorter), runs over an odd width, and
# a row too wide for a warp's registers of no multiple of 4 (the forward's block kernel, its tails).
SHAPES = [(4, 16, 96), (7, 37), (1, 5), (3, 2100), (2, 2048, 768), (1000, 37), (3, 1027)]
EPSILON = 1e-5
INPUTS = ["dy", "x", "scale", "mean", "inv"]
OUTPUTS = ["dx", "dscale", "dbias"]


def _node(inputs=INPUTS, name: str = "ln_grad") -> onnx.NodeProto:
    return helper.make_node(LAYERNORM_GRAD, list(inputs), OUTPUTS, name=name, domain=LAYERNORM_DOMAIN)


def _arrays(shape, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=shape) * 3 + 1).astype(np.float32)
    mean = x.astype(np.float64).mean(axis=-1, keepdims=True)
    var = x.astype(np.float64).var(axis=-1, keepdims=True)
    return {"dy": rng.normal(size=shape).astype(np.float32), "x": x,
            "scale": rng.normal(size=shape[-1]).astype(np.float32), "bias": rng.normal(size=shape[-1]).astype(np.float32),
            "mean": mean.astype(np.float32), "inv": (1 / np.sqrt(var + EPSILON)).astype(np.float32)}


def _function(arrays, opset: int = 18) -> dict[str, np.ndarray]:
    """The node through its function (for the model's default-domain ``opset``), on onnxruntime's CPU provider."""
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, arrays[n].shape) for n in INPUTS]
    shape = arrays["x"].shape
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape if n == "dx" else shape[-1:]) for n in OUTPUTS]
    model = ir.serde.deserialize_model(helper.make_model(helper.make_graph([_node()], "g", inputs, outputs), ir_version=10,
                                                         opset_imports=[helper.make_opsetid("", opset)]))
    assert add_op_functions(model) == {(LAYERNORM_DOMAIN, LAYERNORM_GRAD)}
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(OUTPUTS, session.run(None, {n: arrays[n] for n in INPUTS})))


def _torch(arrays) -> dict[str, np.ndarray]:
    """The gradients of sum(layer_norm(x) * dy) over the last axis, in float64."""
    x, scale, bias = (torch.tensor(arrays[n], dtype=torch.float64, requires_grad=True) for n in ("x", "scale", "bias"))
    y = torch.nn.functional.layer_norm(x, (x.shape[-1],), scale, bias, eps=EPSILON)
    (y * torch.tensor(arrays["dy"], dtype=torch.float64)).sum().backward()
    return {"dx": x.grad.numpy(), "dscale": scale.grad.numpy(), "dbias": bias.grad.numpy()}


def _assert_close(actual: dict, expected: dict, tolerance: float) -> None:
    for name, value in expected.items():
        scale = max(1.0, float(np.max(np.abs(value))))
        error = float(np.max(np.abs(np.asarray(actual[name], dtype=np.float64) - value)))
        assert error <= tolerance * scale, f"{name}: {error:.3g} > {tolerance * scale:.3g}"


@pytest.mark.parametrize("opset", [17, 18])  # row means by ReduceSum / count below opset 18, ReduceMean from it
@pytest.mark.parametrize("shape", SHAPES)
def test_the_function_equals_torch_layer_norm_backward(shape, opset):
    arrays = _arrays(shape, 0)
    _assert_close(_function(arrays, opset), _torch(arrays), 2e-5)


def _gradient_ops(dtype: int, axis: int, shape=(4, 6, 8), bias_shape=None) -> tuple[list[str], list[str], list]:
    """(op types, function names, the bias gradient's shape) of the gradient of
    sum(LayerNormalization(x, w, b)) in x, w and b (b shaped like w unless ``bias_shape``)."""
    width = list(shape[axis:])
    graph = helper.make_graph(
        [helper.make_node("LayerNormalization", ["x", "w", "b"], ["y"], axis=axis, epsilon=EPSILON),
         helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "ln",
        [helper.make_tensor_value_info("x", dtype, shape), helper.make_tensor_value_info("w", dtype, width),
         helper.make_tensor_value_info("b", dtype, width if bias_shape is None else list(bias_shape))],
        [helper.make_tensor_value_info("loss", dtype, [])])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                                                ir_version=10), strict_mode=True)
    ir_model = ir.serde.deserialize_model(model)
    inputs = list(ir_model.graph.inputs)
    grads = build_gradients(ir_model.graph, ir_model.graph.outputs[0], inputs).grads
    add_op_functions(ir_model)
    bias_grad = grads[inputs[2]]
    return ([n.op_type for n in ir_model.graph], [f.name for f in ir_model.functions.values()],
            None if bias_grad.shape is None else list(bias_grad.shape))


@pytest.mark.parametrize("dtype, axis, node", [(TensorProto.FLOAT, -1, True), (TensorProto.FLOAT, 2, True),
                                               (TensorProto.FLOAT, 1, False), (TensorProto.DOUBLE, -1, False)])
def test_the_autodiff_writes_the_node_only_over_the_last_axis_in_float32(dtype, axis, node):
    ops, functions, _ = _gradient_ops(dtype, axis)
    assert (LAYERNORM_GRAD in ops) is node, ops
    assert (LAYERNORM_GRAD in functions) is node


@pytest.mark.parametrize("bias_shape, node", [((8,), True), ((1,), False), ((), False)])
def test_a_bias_that_broadcasts_keeps_its_own_gradient_shape(bias_shape, node):
    """The node's dB is (C,): a bias of shape (1,) or () (ONNX lets it broadcast) keeps the
    standard-op gradient, summed to its own shape."""
    ops, _, bias_grad_shape = _gradient_ops(TensorProto.FLOAT, -1, bias_shape=bias_shape)
    assert (LAYERNORM_GRAD in ops) is node, ops
    assert bias_grad_shape == list(bias_shape)


def test_the_rows_are_cut_into_runs_only_where_there_are_many():
    assert row_parts(64, 96) == 1 and row_parts(1, 5) == 1
    assert row_parts(4096, 768) == 22  # 24 column blocks x 22 runs: about 512 blocks
    assert row_parts(1000, 37) == 15  # every run at least 64 rows
    for rows, width in [(4096, 768), (1000, 37), (130, 100_000)]:
        assert -(-rows // row_parts(rows, width)) >= 64


def test_row_threads_cover_a_row_in_whole_warps():
    for width in (1, 5, 96, 768, 1000, 2048, 100_000):
        threads = row_threads(width)
        assert threads % 32 == 0 and 32 <= threads <= 512
        assert threads * 4 >= width or threads == 512


def test_a_malformed_node_is_refused_naming_it():
    node = _node(INPUTS[:4], name="blocks.3/ln_2_grad")

    class _Device:  # the runner reads these before touching the GPU
        cp, compute = None, None

    with pytest.raises(RunError, match=r"segment 2 stage 1: node 'blocks.3/ln_2_grad'.*LayerNormGrad node \(5 inputs, 3 outputs\)"):
        LayerNormRunner(NativeGroup(2, 0, 1, (node,), tuple(INPUTS[:4]), tuple(OUTPUTS)), "rank0.onnx", _Device())


needs_gpu = pytest.mark.skipif(gpu_count() < 1 or not cuda_available(), reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernels_equal_the_function(shape):
    import cupy as cp

    from runtime.gpu.device import GpuDevice

    arrays = _arrays(shape, 1)
    expected = _function(arrays)
    device = GpuDevice(0, tf32=False)
    runner = LayerNormRunner(NativeGroup(0, 0, 3, (_node(),), tuple(INPUTS), tuple(OUTPUTS)), "test", device)
    env = {name: cp.asarray(arrays[name]) for name in INPUTS}
    first = dict(zip(runner.outputs, runner.run(env)))  # first call: the runner allocates its outputs
    device.compute.synchronize()
    _assert_close({k: cp.asnumpy(v) for k, v in first.items()}, expected, 1e-5)

    # Bound runs into NaN-filled buffers (everything is written), twice: the same bits each time.
    results = []
    for parity in (0, 1):
        outs = {name: cp.full(expected[name].shape, np.nan, dtype=cp.float32) for name in OUTPUTS}
        runner.prepare(parity, outs)
        runner.run_bound(parity, env)
        device.compute.synchronize()
        results.append({k: cp.asnumpy(v) for k, v in outs.items()})
    _assert_close(results[0], expected, 1e-5)
    for name in OUTPUTS:
        assert np.array_equal(results[0][name], results[1][name]), name
        assert np.array_equal(results[0][name], cp.asnumpy(first[name])), name


@pytest.mark.gpu
@needs_gpu
def test_a_statistic_of_the_wrong_size_is_refused_before_a_kernel_reads_past_it():
    import cupy as cp

    from runtime.gpu.device import GpuDevice

    arrays = _arrays(SHAPES[0], 2)
    arrays["inv"] = arrays["inv"][:-1]
    runner = LayerNormRunner(NativeGroup(4, 0, 1, (_node(),), tuple(INPUTS), tuple(OUTPUTS)), "rank0.onnx",
                             GpuDevice(0, tf32=False))
    with pytest.raises(RunError, match=r"segment 4 stage 1: 'ln_grad': input 'inv' must be contiguous float32 of 64 elements"):
        runner.run({name: cp.asarray(arrays[name]) for name in INPUTS})


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("y_type", ["float32", "bfloat16"])
def test_the_forward_kernel_equals_a_float64_layernorm(shape, y_type):
    """layernorm_casts.py's node: Y (float32, or bfloat16 within one rounding), mean and
    inv_std_dev of a float64 LayerNorm; with and without B; every output written (NaN-filled
    buffers), the same bits from call to call."""
    import cupy as cp

    from runtime.gpu.device import GpuDevice
    from runtime.gpu.elementwise_steps import widen_bf16_numpy
    from runtime.gpu.layernorm_casts import DOMAIN

    arrays = _arrays(shape, 3)
    x = arrays["x"].astype(np.float64)
    mean, var = x.mean(axis=-1, keepdims=True), x.var(axis=-1, keepdims=True)
    inv = 1 / np.sqrt(var + EPSILON)
    device = GpuDevice(0, tf32=False)
    for bias in (True, False):
        inputs = ["x", "scale", "bias"][:3 if bias else 2]
        expected = (x - mean) * inv * arrays["scale"] + (arrays["bias"] if bias else 0)
        node = helper.make_node("LayerNormalization_0", inputs, ["y", "mean", "inv"], name="ln", domain=DOMAIN,
                                axis=-1, epsilon=EPSILON)
        runner = LayerNormRunner(NativeGroup(0, 0, 1, (node,), tuple(inputs), ("y", "mean", "inv")), "test", device)
        env = {name: cp.asarray(arrays[name]) for name in inputs}
        results = []
        for call in range(2):
            env["y"] = cp.full(shape, np.nan, np.float32) if y_type == "float32" else cp.full(shape, 0x7FC1, np.uint16)
            env["mean"], env["inv"] = (cp.full((*shape[:-1], 1), np.nan, np.float32) for _ in range(2))
            runner.launch(env, allocate=call == 0)
            device.compute.synchronize()
            results.append({name: cp.asnumpy(env[name]) for name in ("y", "mean", "inv")})
        got = results[0]
        np.testing.assert_allclose(got["mean"], mean, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["inv"], inv, rtol=1e-5)
        y = got["y"] if y_type == "float32" else widen_bf16_numpy(got["y"])
        slack = 1e-5 * max(1.0, float(np.max(np.abs(expected))))
        if y_type == "bfloat16":
            slack = slack + spacing(expected, 7)  # one rounding to bfloat16
        assert np.all(np.abs(y - expected) <= slack), f"bias {bias}: {np.max(np.abs(y - expected)):.3g}"
        for name in ("y", "mean", "inv"):
            np.testing.assert_array_equal(results[1][name], got[name])
