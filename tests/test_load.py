"""Loading exported models: constant subgraphs that exporters leave unfolded still transpile."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

from transpiler import Options, build, transpile


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


def test_model_with_external_data(model_dir, tmp_path):
    """Weights in a separate file: OUT gets a self-contained copy, and training and export work."""
    import onnx
    from conftest import load_data

    from runtime import simulate
    from runtime.export import export_model
    from runtime.plan import load_plan

    model = onnx.load(model_dir("perceptron") / "model.onnx")
    onnx.save_model(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    assert (tmp_path / "m.data").is_file()
    transpile(tmp_path / "m.onnx", tmp_path / "out", Options(world_size=2))
    (tmp_path / "m.data").unlink()  # OUT must not depend on it
    result = simulate(tmp_path / "out", load_data(model_dir("perceptron") / "data.npz"), batch=8, steps=2)
    export_model(load_plan(tmp_path / "out"), result.parameters[0], tmp_path / "trained.onnx")
    trained = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(tmp_path / "trained.onnx").graph.initializer}
    for name, value in result.parameters[0].items():
        np.testing.assert_array_equal(trained[name], value)
