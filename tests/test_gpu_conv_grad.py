"""ConvWeightGrad on the GPU (cuDNN's backward-filter, runtime/gpu/conv_grad.py) equals the node's
function as the CPU backend runs it (onnxruntime, the Conv form), first call and bound runs, TF32
off; bfloat16 and float16 nodes give the exact gradient of their inputs rounded once, as the CPU
backend's lowering of the function does; and the node's attributes and element types are checked
before anything runs (CPU)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from conftest import first_and_bound_run, spacing
from onnx import TensorProto, helper

from contract.ops import CONV_GRAD_DOMAIN as DOMAIN
from contract.ops import CONV_WEIGHT_GRAD as WEIGHT_GRAD
from runtime.errors import RunError
from runtime.gpu import cuda_available, gpu_count
from runtime.gpu import cudnn as cudnn_api
from runtime.gpu.conv_grad import CUDNN_TYPES, ConvGradRunner
from runtime.low_precision import lower
from runtime.segments import NativeGroup
from transpiler.native_ops import add_op_functions

# (X shape, kernel, strides, dilations, pads): the ResNet shapes (3x3 same, 3x3 stride 2, 1x1
# stride 2) and a dilated, rectangular one.
CASES = [
    ((8, 16, 32, 32), [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
    ((8, 16, 16, 16), [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),
    ((8, 16, 16, 16), [1, 1], [2, 2], [1, 1], [0, 0, 0, 0]),
    ((4, 6, 15, 12), [3, 2], [1, 2], [2, 1], [2, 0, 2, 0]),
]


def _node(kernel, strides, dilations, pads, name="wgrad") -> onnx.NodeProto:
    return helper.make_node(WEIGHT_GRAD, ["x", "dy"], ["dw"], name=name, domain=DOMAIN, kernel_shape=kernel,
                            strides=strides, dilations=dilations, pads=pads)


def _out_size(size, kernel, stride, dilation, pad):
    return (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1


def _arrays(case: int, rng, m: int = 12) -> tuple[np.ndarray, np.ndarray, tuple]:
    """Random X and dY of CASES[case] (dY with ``m`` channels), and its (kernel, strides, dilations, pads)."""
    x_shape, kernel, strides, dilations, pads = CASES[case]
    outs = [_out_size(size, kk, s, d, p) for size, kk, s, d, p in zip(x_shape[2:], kernel, strides, dilations, pads)]
    x = rng.normal(size=x_shape).astype(np.float32)
    dy = rng.normal(size=(x_shape[0], m, *outs)).astype(np.float32)
    return x, dy, (kernel, strides, dilations, pads)


def _float64(x, dy, kernel, strides, dilations, pads) -> np.ndarray:
    """dW[m, c, t] = sum over (n, p) of dY[n, m, p] * Xpad[n, c, p*s + t*d], in float64."""
    x = np.pad(x.astype(np.float64), [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])])
    outs = dy.shape[2:]
    dw = np.zeros((dy.shape[1], x.shape[1], *kernel))
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            top, left = i * dilations[0], j * dilations[1]
            window = x[:, :, top:top + (outs[0] - 1) * strides[0] + 1:strides[0],
                       left:left + (outs[1] - 1) * strides[1] + 1:strides[1]]
            dw[:, :, i, j] = np.einsum("nmhw,nchw->mc", dy.astype(np.float64), window)
    return dw


def _assert_close(actual, x, dy, attrs, tolerance: float = 1e-5) -> None:
    """Within float32 summation error: ``tolerance`` of the sum of the terms' magnitudes (the output
    can be a near-cancelling sum of thousands of terms, so a bound relative to it would test luck)."""
    exact, scale = _float64(x, dy, *attrs), _float64(np.abs(x), np.abs(dy), *attrs)
    assert np.all(np.abs(actual - exact) <= tolerance * scale), float(np.max(np.abs(actual - exact) / scale))


def _expected(x, dy, kernel, strides, dilations, pads, elem: int = TensorProto.FLOAT) -> np.ndarray:
    """The node through its function, on onnxruntime's CPU provider; with ``elem`` bfloat16 or
    float16, X, dY and dW of that type, as the CPU backend runs it (runtime/low_precision.py: the
    function's Conv in float32, rounded once; x and dy float32 holding low-precision numbers)."""
    node = _node(kernel, strides, dilations, pads)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, x.shape),
                                            helper.make_tensor_value_info("dy", elem, dy.shape)],
                              [helper.make_tensor_value_info("dw", elem, None)])
    model = ir.serde.deserialize_model(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18 if elem == TensorProto.FLOAT else 22)]))
    assert add_op_functions(model)
    proto = lower(ir.serde.serialize_model(model))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x, "dy": dy})[0]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1 or not cuda_available(), reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")
def test_cudnn_weight_gradient_equals_the_function(case):
    import cupy as cp

    from runtime.gpu.device import GpuDevice

    x, dy, attrs = _arrays(case, np.random.default_rng(case))
    expected = _expected(x, dy, *attrs)
    assert expected.shape == (dy.shape[1], x.shape[1], *attrs[0])
    _assert_close(expected, x, dy, attrs)  # the function (onnxruntime, CPU) is right

    device = GpuDevice(0, tf32=False)
    group = NativeGroup(0, 0, 1, (_node(*attrs),), ("x", "dy"), ("dw",))
    runner = ConvGradRunner(group, "test", device)
    feeds = {"x": cp.asarray(x), "dy": cp.asarray(dy)}
    (first,) = runner.run(feeds)
    _assert_close(cp.asnumpy(first), x, dy, attrs)

    out = cp.full(expected.shape, np.nan, dtype=cp.float32)
    runner.prepare(1, {"dw": out})
    for scale in (1.0, -2.0):  # bound runs read the fed buffers' current values
        feeds["dy"][...] = cp.asarray(dy * scale)
        runner.run_bound(1, feeds)
        device.compute.synchronize()
        _assert_close(cp.asnumpy(out), x, dy * scale, attrs)


# Each low-precision type: (ONNX type, NumPy's (ml_dtypes') type, how CuPy holds it, stored mantissa bits).
LOW = {"bfloat16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16, np.uint16, 7),
       "float16": (TensorProto.FLOAT16, np.float16, np.float16, 10)}


@pytest.mark.parametrize("dtype", sorted(LOW))
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1 or not cuda_available(), reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")
def test_low_precision_weight_gradient_is_the_exact_one_rounded_once(case, dtype):
    """bfloat16 / float16 X and dY (bfloat16 as raw bits), dW of the same type: cuDNN's pseudo
    configuration sums the (exact) products in float32 and rounds once, so dW lies within half a
    spacing of the exact (float64) gradient of the rounded inputs, plus float32 summation error
    where that moves it across a rounding boundary; and within one spacing of what the CPU backend
    computes from the node's function. First call and a bound run."""
    import cupy as cp

    from runtime.gpu.device import GpuDevice

    elem, low, view, mantissa = LOW[dtype]
    x, dy, attrs = _arrays(case, np.random.default_rng(case))
    x, dy = (v.astype(low).astype(np.float32) for v in (x, dy))  # the low-precision numbers, held as float32
    exact, scale = _float64(x, dy, *attrs), _float64(np.abs(x), np.abs(dy), *attrs)
    cpu = _expected(x, dy, *attrs, elem=elem)

    def check(raw) -> None:
        dw = cp.asnumpy(raw).view(low).astype(np.float64) if view == np.uint16 else cp.asnumpy(raw).astype(np.float64)
        assert raw.dtype == view and dw.shape == exact.shape
        assert np.all(np.abs(dw - exact) <= 0.5 * spacing(exact, mantissa) + 1e-5 * scale), float(
            np.max(np.abs(dw - exact) / spacing(exact, mantissa)))
        assert np.all(np.abs(dw - cpu) <= spacing(np.maximum(np.abs(dw), np.abs(cpu)), mantissa) + 1e-5 * scale)

    device = GpuDevice(0, tf32=False)
    runner = ConvGradRunner(NativeGroup(0, 0, 1, (_node(*attrs),), ("x", "dy"), ("dw",)), "test", device)
    feeds = {"x": cp.asarray(x.astype(low).view(view)), "dy": cp.asarray(dy.astype(low).view(view))}
    for result in first_and_bound_run(runner, feeds, device):
        check(result)


def test_the_element_types_map_to_cudnns_and_must_agree():
    """cudnnDataType_t (cudnn_graph.h): FLOAT 0, HALF 2, BFLOAT16 9; bfloat16 arrives as uint16 raw
    bits (in_session.VIEWS). X, dY and dW of one type, else the first call refuses them (CPU: the
    checks read only dtypes and shapes)."""
    from runtime.gpu.in_session import VIEWS

    assert (cudnn_api.DATA_FLOAT, cudnn_api.DATA_HALF, cudnn_api.DATA_BFLOAT16) == (0, 2, 9)
    assert {VIEWS[t]: CUDNN_TYPES[VIEWS[t]] for t in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)} \
        == {np.dtype(np.float32): 0, np.dtype(np.float16): 2, np.dtype(np.uint16): 9}

    class _Device:  # the runner reads these before touching the GPU
        cp, tf32, compute = None, False, None

    runner = ConvGradRunner(NativeGroup(0, 0, 1, (_node([3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),), ("x", "dy"), ("dw",)),
                            "rank0.onnx", _Device())
    (op,) = runner.ops
    bits = np.zeros((2, 3, 5, 5), np.uint16)
    runner._check(op, bits, np.zeros((2, 4, 5, 5), np.uint16), np.zeros((4, 3, 3, 3), np.uint16))
    with pytest.raises(RunError, match="X is bfloat16 but dY is float16"):
        runner._check(op, bits, np.zeros((2, 4, 5, 5), np.float16))
    with pytest.raises(RunError, match="X is bfloat16 but dW is float32"):
        runner._check(op, bits, np.zeros((2, 4, 5, 5), np.uint16), np.zeros((4, 3, 3, 3), np.float32))
    with pytest.raises(RunError, match="X must be a contiguous float32, bfloat16 or float16 tensor"):
        runner._check(op, np.zeros((2, 3, 5, 5)), np.zeros((2, 4, 5, 5)))


def test_a_node_without_its_attributes_is_refused_naming_it():
    node = helper.make_node(WEIGHT_GRAD, ["x", "dy"], ["dw"], name="layer1/wgrad", domain=DOMAIN,
                            kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])
    group = NativeGroup(2, 0, 1, (node,), ("x", "dy"), ("dw",))

    class _Device:  # the runner reads these before touching the GPU
        cp, tf32, compute = None, False, None

    with pytest.raises(RunError, match=r"segment 2 stage 1: node 'layer1/wgrad'.*lacks attribute\(s\) dilations"):
        ConvGradRunner(group, "rank0.onnx", _Device())


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1 or not cuda_available(), reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")
@pytest.mark.parametrize("tf32", [False, True])
def test_nodes_of_several_runners_share_one_handle_and_a_workspace_that_fits_them_all(tf32):
    """Every case as one node of one runner, and a second runner on the same device: one cuDNN
    context, its workspace as large as the largest chosen algorithm needs; with TF32 (inputs rounded
    to 10 mantissa bits, 2^-11 relative each) the products are within 2e-3 of the exact ones."""
    import cupy as cp

    from runtime.gpu.device import GpuDevice

    device = GpuDevice(0, tf32=tf32)
    rng = np.random.default_rng(11)
    nodes, feeds, cases = [], {}, []
    for i in range(len(CASES)):
        x, dy, attrs = _arrays(i, rng)
        node = _node(*attrs, name=f"wgrad{i}")
        node.input[:] = [f"x{i}", f"dy{i}"]
        node.output[:] = [f"dw{i}"]
        nodes.append(node)
        feeds.update({f"x{i}": cp.asarray(x), f"dy{i}": cp.asarray(dy)})
        cases.append((x, dy, attrs))
    names = tuple(feeds)
    runner = ConvGradRunner(NativeGroup(0, 0, 1, tuple(nodes), names, tuple(f"dw{i}" for i in range(len(CASES)))),
                            "test", device)
    results = runner.run(feeds)
    device.compute.synchronize()
    for result, (x, dy, attrs) in zip(results, cases):
        _assert_close(cp.asnumpy(result), x, dy, attrs, 2e-3 if tf32 else 1e-5)
    context = device.cudnn()
    assert runner.context is context
    assert context.workspace_bytes >= max(op.workspace_bytes for op in runner.ops)
    other = ConvGradRunner(NativeGroup(1, 0, 1, (nodes[0],), ("x0", "dy0"), ("dw0",)), "test", device)
    (again,) = other.run({"x0": feeds["x0"], "dy0": feeds["dy0"]})
    device.compute.synchronize()
    assert other.context is context
    _assert_close(cp.asnumpy(again), *cases[0][:2], cases[0][2], 2e-3 if tf32 else 1e-5)
