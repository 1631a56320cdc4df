"""Clip's gradient on its bounds, as PyTorch's two conventions for what every exporter writes as Clip.

torch's hardtanh (nn.ReLU6, F.relu6, nn.Hardtanh, F.hardtanh) passes the gradient strictly inside
the bounds; torch.clamp and clamp_min/clamp_max on the closed interval. They differ only where the
input sits exactly on a bound, which happens in real training: a BatchNorm channel that is constant
over the batch normalizes to exactly its bias, 0 at initialization, so ReLU6 sees an exact 0 (see
test_constant_channel_after_batchnorm). Each function here gets inputs on its bounds and a bias
parameter per feature; the bias gradient is the pass-through mask times integer weights, exact in
float32, so ours must equal autograd bit for bit, from both exporters.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")
import onnxruntime as ort  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from models.torch_twins import export_onnx  # noqa: E402

FUNCTIONS = {
    "relu6_module": nn.ReLU6(),
    "relu6_inplace": nn.ReLU6(inplace=True),
    "relu6_functional": F.relu6,
    "hardtanh": nn.Hardtanh(-1.0, 2.0),
    "clamp": lambda x: torch.clamp(x, -1.0, 2.0),
    "clamp_min": lambda x: x.clamp(min=0.0),
    "clamp_0_6": lambda x: torch.clamp(x, 0.0, 6.0),
}
# TorchScript writes F.relu6 as it writes torch.clamp (bounds through Cast): a Clip(0, 6) is taken
# as ReLU6, so torch.clamp(x, 0, 6) gets hardtanh's convention there (dynamo names the aten op).
AMBIGUOUS = {("clamp_0_6", "torchscript")}


class _Clips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.functions = list(FUNCTIONS.values())
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(8)) for _ in FUNCTIONS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.arange(1, 9, dtype=x.dtype)
        return sum((f(x + b) * weights).sum() for f, b in zip(self.functions, self.biases))


def _inputs() -> np.ndarray:
    # Every bound of every function (-1, 0, 2, 6) exactly, and points inside and outside them.
    return np.array([[-1.0, 0.0, 2.0, 6.0, 0.5, -3.0, 7.0, 1.0],
                     [6.0, -1.0, 0.0, 2.0, 3.0, 0.0, 6.0, -1.0]], dtype=np.float32)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_clip_gradient_on_its_bounds_equals_autograd(exporter, tmp_path):
    from transpiler import Options, build

    module = _Clips()
    x = _inputs()
    path = export_onnx(copy.deepcopy(module), (torch.from_numpy(x),), tmp_path / "clips.onnx", input_names=["x"],
                       output_names=["loss"], dynamo=exporter == "dynamo")
    job = build(path, Options(world_size=1))
    fwd_bwd = job.fwd_bwd["single"] if isinstance(job.fwd_bwd, dict) else job.fwd_bwd
    session = ort.InferenceSession(fwd_bwd.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [f"biases.{i}" for i in range(len(FUNCTIONS))]
    ours = dict(zip(names, session.run([job.grad_names[n] for n in names], {"x": x})))

    module(torch.from_numpy(x)).backward()
    for i, function in enumerate(FUNCTIONS):
        expected = module.biases[i].grad.numpy()
        if (function, exporter) in AMBIGUOUS:
            assert not np.array_equal(ours[names[i]], expected)  # documented: read as ReLU6
            continue
        np.testing.assert_array_equal(ours[names[i]], expected, err_msg=f"{function} ({exporter})")


def test_constant_channel_after_batchnorm(tmp_path):
    """Where an exact bound comes from in a real network: a channel that is constant over the batch
    (here a convolution of an all-zero input channel, as a dead channel or zero padding gives)
    leaves BatchNorm as exactly its bias, 0 at initialization; ReLU6 passes no gradient there, so
    that BatchNorm's bias gets none through it."""
    from transpiler import Options, build

    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(2, 2, 1, groups=2, bias=False), nn.BatchNorm2d(2), nn.ReLU6(),
                           nn.Flatten(), nn.Linear(8, 1))
    x = np.random.default_rng(0).standard_normal((2, 2, 2, 2)).astype(np.float32)
    x[:, 1] = 0.0  # channel 1: constant over the batch

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).sum()

    wrapper = Loss()
    path = export_onnx(copy.deepcopy(wrapper), (torch.from_numpy(x),), tmp_path / "bn.onnx", input_names=["x"],
                       output_names=["loss"])
    job = build(path, Options(world_size=1))
    fwd_bwd = job.fwd_bwd["single"] if isinstance(job.fwd_bwd, dict) else job.fwd_bwd
    session = ort.InferenceSession(fwd_bwd.SerializeToString(), providers=["CPUExecutionProvider"])
    ours = session.run([job.grad_names["net.1.bias"]], {"x": x})[0]
    wrapper.train()(torch.from_numpy(x)).backward()
    expected = module[1].bias.grad.numpy()
    assert expected[1] == 0.0  # torch: the constant channel's ReLU6 input is exactly 0
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=0)
