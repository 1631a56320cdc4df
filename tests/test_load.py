"""Loading exported models: constant subgraphs that exporters leave unfolded still transpile."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from transpiler import Options, build, transpile
from transpiler.errors import TranspileError
from transpiler.lazy_weights import read_lazy


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


def test_external_int4_data_is_two_values_per_byte(tmp_path):
    """The lazy loader checks an external tensor's length with the same byte rule as the raw-data
    check: 10 INT4 values are 5 bytes (it used to ask for 10 and call the file truncated)."""
    (tmp_path / "w.bin").write_bytes(b"\x11" * 5)
    w = TensorProto(name="w", data_type=TensorProto.INT4, dims=[10], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", "5")):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    nodes = [helper.make_node("Cast", ["w"], ["wc"], to=TensorProto.FLOAT), helper.make_node("Add", ["x", "wc"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [10])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [10])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "m.onnx")
    read_lazy(tmp_path / "m.onnx", "model.onnx")  # no error
    (tmp_path / "w.bin").write_bytes(b"\x11" * 4)
    with pytest.raises(TranspileError, match=r"initializer 'w'.*truncated or damaged"):
        read_lazy(tmp_path / "m.onnx", "model.onnx")
