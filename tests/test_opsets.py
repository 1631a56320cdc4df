"""Every opset the PyTorch exporters emit (17-21), from both exporters, transpiles and trains like
PyTorch; GELU arrives as an Erf formula below opset 20 and as the Gelu op from 20 on."""

from __future__ import annotations

import copy

import onnx
import pytest
import torch
from conftest import max_rel_error

from runtime import simulate
from transpiler import OptimizerConfig, Options, transpile

STEPS, LR = 3, 0.1


class LayerNormGelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.fc2(torch.nn.functional.gelu(self.ln(self.fc1(x)))), y)


@pytest.mark.parametrize(
    "opset, dynamo",
    [(17, False), (18, False), (19, False), (20, False), (17, True), (18, True), (19, True), (20, True), (21, True)],
)
def test_exported_opset_trains_like_torch(opset, dynamo, tmp_path):
    torch.manual_seed(0)
    net = LayerNormGelu()
    with torch.no_grad():  # distinct values: exporters merge initializers that are equal
        net.ln.weight.uniform_(0.5, 1.5)
        net.ln.bias.uniform_(-0.5, 0.5)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    path = tmp_path / "m.onnx"
    if dynamo:
        batch = torch.export.Dim("batch")
        kwargs = dict(dynamo=True, optimize=False, dynamic_shapes={"x": {0: batch}, "y": {0: batch}})
    else:
        kwargs = dict(dynamo=False, dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    torch.onnx.export(copy.deepcopy(net), (x, y), str(path), input_names=["x", "y"], output_names=["loss"],
                      opset_version=opset, **kwargs)
    model = onnx.load(path)
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [opset]
    assert ("Gelu" in {n.op_type for n in model.graph.node}) == (opset >= 20)

    transpile(path, tmp_path / "out", Options(world_size=1, optimizer=OptimizerConfig("sgd", lr=LR)))
    result = simulate(tmp_path / "out", {"x": x.numpy(), "y": y.numpy()}, batch=8, steps=STEPS, single_device=True)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        net(x, y).backward()
        opt.step()
    expected = {k: v.detach().numpy() for k, v in net.named_parameters()}
    assert max_rel_error(result.parameters[0], expected) <= 1e-5
