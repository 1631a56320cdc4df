"""Loading exported models: constant subgraphs that exporters leave unfolded still transpile."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

from transpiler import Options, build


class SlicedPositions(torch.nn.Module):
    """x + wpe[:, :T]: without constant folding the exporter computes Slice's axes from Constants."""

    def __init__(self):
        super().__init__()
        self.wpe = torch.nn.Parameter(torch.randn(1, 8, 4))
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        h = x + self.wpe[:, : x.shape[1]]
        return ((self.fc(h).squeeze(-1) - y) ** 2).mean()


def test_unfolded_slice_axes_transpile_and_differentiate(tmp_path):
    torch.manual_seed(0)
    net = SlicedPositions()
    x, y = torch.randn(3, 6, 4), torch.randn(3, 6)
    path = tmp_path / "m.onnx"
    torch.onnx.export(net, (x, y), str(path), input_names=["x", "y"], output_names=["loss"],
                      dynamic_axes={"x": {0: "b", 1: "t"}, "y": {0: "b", 1: "t"}}, opset_version=18,
                      dynamo=False, do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING)
    job = build(path, Options(world_size=1))
    assert sorted(job.problem.params) == ["fc.bias", "fc.weight", "wpe"]

    session = ort.InferenceSession(job.fwd_bwd["single"].SerializeToString())
    names = [o.name for o in session.get_outputs()]
    ours = dict(zip(names, session.run(None, {"x": x.numpy(), "y": y.numpy()})))
    net(x, y).backward()
    for name, param in net.named_parameters():
        np.testing.assert_allclose(ours[job.grad_names[name]], param.grad.numpy(), rtol=1e-5, atol=1e-7)
