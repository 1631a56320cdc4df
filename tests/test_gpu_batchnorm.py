"""The training BatchNorm nodes (transpiler/batchnorm_ops.py): their functions, as the CPU backend
runs them, equal PyTorch's training-mode batch_norm and its gradient (CPU); on the GPU, the
kernels (runtime/gpu/batchnorm.py) equal the functions, first call and bound runs, running
statistics updated in place or into other buffers, with four values an access and without, one
part a channel and many; with bfloat16 X, Y, dY and dX (the nodes batchnorm_casts.py writes) they
equal the functions on the widened values, rounded once; a malformed node is refused naming it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from contract.ops import BATCHNORM_DOMAIN, BATCHNORM_TRAINING, BATCHNORM_TRAINING_GRAD
from runtime.errors import RunError
from runtime.gpu import cuda_available, gpu_count
from runtime.gpu.batchnorm import BatchNormRunner
from runtime.segments import NativeGroup
from transpiler.native_ops import add_op_functions

SHAPES = [(16, 8, 12, 12), (3, 3, 5, 7)]
# (64, 4, 32, 32): 16 parts a channel. Then more values than one grid pass of the elementwise (on a 132-SM GPU)
# kernels covers (their walk carries the channel and offset over the grid stride): a stride of
# 3754 rows of 576 and 384 values, each thread of the statistics three accesses wrapping rows;
# and 4 x 4 planes (ResNet-18's last stage), the stride a whole number of rows.
# (16, 8, 14, 14): rows of a multiple of 4, not of 8 (bf16 at four values an access).
GPU_SHAPES = SHAPES + [(64, 4, 32, 32), (120, 40, 24, 24), (300, 512, 4, 4), (16, 8, 14, 14)]
EPSILON, MOMENTUM = 1e-5, 0.9
FORWARD_IN = ["x", "scale", "bias", "running_mean", "running_var"]
FORWARD_OUT = ["y", "mean_next", "var_next", "saved_mean", "saved_inv_std"]
GRAD_IN = ["dy", "x", "scale", "saved_mean", "saved_inv_std"]
GRAD_OUT = ["dx", "dscale", "dbias"]


def _nodes() -> list[onnx.NodeProto]:
    return [helper.make_node(BATCHNORM_TRAINING, FORWARD_IN, FORWARD_OUT, name="bn", domain=BATCHNORM_DOMAIN,
                             epsilon=EPSILON, momentum=MOMENTUM),
            helper.make_node(BATCHNORM_TRAINING_GRAD, GRAD_IN, GRAD_OUT, name="bn_grad", domain=BATCHNORM_DOMAIN,
                             epsilon=EPSILON)]


def _arrays(shape, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    c = shape[1]
    return {"x": (rng.normal(size=shape) * 2 + 0.5).astype(np.float32),
            "scale": rng.normal(size=c).astype(np.float32), "bias": rng.normal(size=c).astype(np.float32),
            "running_mean": rng.normal(size=c).astype(np.float32),
            "running_var": rng.uniform(0.5, 2, size=c).astype(np.float32),
            "dy": rng.normal(size=shape).astype(np.float32)}


def _functions(arrays) -> dict[str, np.ndarray]:
    """Both nodes through their functions, on onnxruntime's CPU provider."""
    names = ["x", "scale", "bias", "running_mean", "running_var", "dy"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, arrays[n].shape) for n in names]
    shape, channels = arrays["x"].shape, arrays["x"].shape[1:2]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape if n in ("y", "dx") else channels)
               for n in FORWARD_OUT + GRAD_OUT]
    model = ir.serde.deserialize_model(helper.make_model(helper.make_graph(_nodes(), "g", inputs, outputs), ir_version=10,
                                                         opset_imports=[helper.make_opsetid("", 18)]))
    assert add_op_functions(model) == {(BATCHNORM_DOMAIN, BATCHNORM_TRAINING), (BATCHNORM_DOMAIN, BATCHNORM_TRAINING_GRAD)}
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(FORWARD_OUT + GRAD_OUT, session.run(None, {n: arrays[n] for n in names})))


def _torch(arrays) -> dict[str, np.ndarray]:
    """PyTorch's training-mode BatchNorm2d: output, running statistics (torch momentum = 1 - ONNX's),
    batch statistics, and the gradients of sum(y * dy)."""
    x, scale, bias = (torch.tensor(arrays[n], dtype=torch.float64, requires_grad=True) for n in ("x", "scale", "bias"))
    mean, var = (torch.tensor(arrays[n], dtype=torch.float64) for n in ("running_mean", "running_var"))
    y = torch.nn.functional.batch_norm(x, mean, var, scale, bias, training=True, momentum=1 - MOMENTUM, eps=EPSILON)
    (y * torch.tensor(arrays["dy"], dtype=torch.float64)).sum().backward()
    axes = (0, 2, 3)
    batch_var = x.detach().var(dim=axes, unbiased=False)
    return {"y": y.detach().numpy(), "mean_next": mean.numpy(), "var_next": var.numpy(),
            "saved_mean": x.detach().mean(dim=axes).numpy(), "saved_inv_std": (1 / torch.sqrt(batch_var + EPSILON)).numpy(),
            "dx": x.grad.numpy(), "dscale": scale.grad.numpy(), "dbias": bias.grad.numpy()}


def _assert_close(actual: dict, expected: dict, tolerance: float) -> None:
    for name, value in expected.items():
        scale = max(1.0, float(np.max(np.abs(value))))
        error = float(np.max(np.abs(np.asarray(actual[name], dtype=np.float64) - value)))
        assert error <= tolerance * scale, f"{name}: {error:.3g} > {tolerance * scale:.3g}"


@pytest.mark.parametrize("shape", SHAPES)
def test_the_functions_equal_torch_training_batch_norm(shape):
    arrays = _arrays(shape, 0)
    _assert_close(_functions(arrays), _torch(arrays), 2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1 or not cuda_available(), reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_the_kernels_equal_the_functions(shape):
    import cupy as cp

    from runtime.gpu.device import GpuDevice

    arrays = _arrays(shape, 1)
    expected = _functions(arrays)
    device = GpuDevice(0, tf32=False)
    forward, backward = _nodes()
    runners = [BatchNormRunner(NativeGroup(0, 0, 1, (forward,), tuple(FORWARD_IN), tuple(FORWARD_OUT)), "test", device),
               BatchNormRunner(NativeGroup(0, 0, 3, (backward,), tuple(GRAD_IN), tuple(GRAD_OUT)), "test", device)]
    env = {name: cp.asarray(value) for name, value in arrays.items()}
    for runner in runners:  # first call: the runners allocate their outputs
        env.update(zip(runner.outputs, runner.run(env)))
    device.compute.synchronize()
    _assert_close({k: cp.asnumpy(v) for k, v in env.items()}, expected, 1e-5)

    # Bound runs: fixed output buffers (NaN-filled: everything is written); the running statistics
    # once into buffers of their own, once in place over their inputs (GpuProgram's aliasing).
    assert runners[0].in_place_pairs() == {"mean_next": "running_mean", "var_next": "running_var"}
    for in_place in (False, True):
        env = {name: cp.asarray(value) for name, value in arrays.items()}
        for parity, runner in enumerate(runners):
            outs = {name: cp.full(expected[name].shape, np.nan, dtype=cp.float32) for name in runner.outputs}
            if in_place and runner is runners[0]:
                outs.update({out: env[src] for out, src in runner.in_place_pairs().items()})
            runner.prepare(parity, outs)
            runner.run_bound(parity, env)
            env.update(outs)
        device.compute.synchronize()
        _assert_close({k: cp.asnumpy(v) for k, v in env.items()}, expected, 1e-5)


def test_a_malformed_node_is_refused_naming_it():
    node = helper.make_node(BATCHNORM_TRAINING_GRAD, GRAD_IN[:4], GRAD_OUT, name="layer1/bn_grad", domain=BATCHNORM_DOMAIN)

    class _Device:  # the runner reads these before touching the GPU
        cp, compute = None, None

    with pytest.raises(RunError, match=r"segment 2 stage 1: node 'layer1/bn_grad'.*BatchNormTrainingGrad \(5 inputs, 3 outputs\)"):
        BatchNormRunner(NativeGroup(2, 0, 1, (node,), tuple(GRAD_IN[:4]), tuple(GRAD_OUT)), "rank0.onnx", _Device())


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1 or not cuda_available(), reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")
def test_a_per_channel_input_of_the_wrong_size_is_refused_before_a_kernel_reads_past_it():
    import cupy as cp

    from runtime.gpu.device import GpuDevice

    arrays = _arrays(SHAPES[1], 2)
    arrays["scale"] = arrays["scale"][:-1]
    runner = BatchNormRunner(NativeGroup(4, 0, 1, (_nodes()[0],), tuple(FORWARD_IN), tuple(FORWARD_OUT)), "rank0.onnx",
                             GpuDevice(0, tf32=False))
    with pytest.raises(RunError, match=r"segment 4 stage 1: 'bn': input 'scale' must be .* shape \(3,\), got float32 \(2,\)"):
        runner.run({name: cp.asarray(value) for name, value in arrays.items()})


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1 or not cuda_available(), reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("relu", [False, True])
def test_bfloat16_activations_equal_the_functions_on_the_widened_values(shape, relu):
    import cupy as cp

    from runtime.gpu.batchnorm_casts import DOMAIN
    from runtime.gpu.device import GpuDevice
    from runtime.gpu.elementwise_steps import round_bf16_numpy, widen_bf16_numpy

    arrays = _arrays(shape, 3)
    bits = {name: round_bf16_numpy(arrays[name]) for name in ("x", "dy")}
    expected = _functions({**arrays, **{name: widen_bf16_numpy(b) for name, b in bits.items()}})
    device = GpuDevice(0, tf32=False)
    forward, backward = _nodes()
    for node in (forward, backward):  # as batchnorm_casts.py writes them
        node.domain, node.op_type = DOMAIN, f"{node.op_type}_0"
    if relu:  # a forward that took its Relu in: Y = max(BatchNorm, 0)
        forward.attribute.append(helper.make_attribute("relu", 1))
        expected["y"] = np.maximum(expected["y"], 0)
    runners = [BatchNormRunner(NativeGroup(0, 0, 1, (forward,), tuple(FORWARD_IN), tuple(FORWARD_OUT)), "test", device),
               BatchNormRunner(NativeGroup(0, 0, 3, (backward,), tuple(GRAD_IN), tuple(GRAD_OUT)), "test", device)]
    env = {name: cp.asarray(bits.get(name, value)) for name, value in arrays.items()}
    for runner in runners:  # Y and dX given in bfloat16, as a session gives them
        env.update({name: cp.empty(shape, dtype=cp.uint16) for name in runner.outputs if name in ("y", "dx")})
        env.update(zip(runner.outputs, runner.run(env)))
    device.compute.synchronize()
    got = {k: cp.asnumpy(v) for k, v in env.items()}
    for name in ("y", "dx"):  # one rounding of the float32 value: at most one bfloat16 unit apart
        assert got[name].dtype == np.uint16
        wide, exact = widen_bf16_numpy(got[name]).astype(np.float64), expected.pop(name).astype(np.float64)
        assert np.all(np.abs(wide - exact) <= np.abs(exact) * 2.0**-7 + 1e-6), name
    _assert_close({k: v for k, v in got.items() if k in expected}, expected, 1e-5)
