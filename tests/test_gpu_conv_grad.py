"""ConvWeightGrad on the GPU (cuDNN's backward-filter, runtime/gpu/conv_grad.py) equals the node's
function as the CPU backend runs it (onnxruntime, the Conv form), first call and bound runs, TF32
off; and the node's attributes are checked before anything runs (CPU)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from contract.ops import CONV_GRAD_DOMAIN as DOMAIN
from contract.ops import CONV_WEIGHT_GRAD as WEIGHT_GRAD
from runtime.errors import RunError
from runtime.gpu import cuda_available, gpu_count
from runtime.gpu.conv_grad import ConvGradRunner
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


def _expected(x, dy, kernel, strides, dilations, pads) -> np.ndarray:
    """The node through its function, on onnxruntime's CPU provider."""
    node = _node(kernel, strides, dilations, pads)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape),
                                            helper.make_tensor_value_info("dy", TensorProto.FLOAT, dy.shape)],
                              [helper.make_tensor_value_info("dw", TensorProto.FLOAT, None)])
    model = ir.serde.deserialize_model(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)]))
    assert add_op_functions(model)
    proto = ir.serde.serialize_model(model)
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
