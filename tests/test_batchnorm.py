"""BatchNormalization trains with batch statistics (PyTorch's train mode), its running statistics are
state written back by --export, and with --sync-bn N ranks equal one device."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from conftest import assert_replicas_identical, max_rel_error
from onnx import numpy_helper

from runtime import simulate
from transpiler import OptimizerConfig, Options, transpile

STEPS, BATCH, ROWS, LR = 5, 16, 48, 0.05


class TinyBnNet(torch.nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear -> MSE (convolutions are covered by tests/test_models_real.py)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.bn1 = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        h = torch.relu(self.bn1(self.fc1(x)))
        return torch.nn.functional.mse_loss(self.fc2(h), y)


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 6)).astype(np.float32) * 2 + 1
    y = (x[:, :1] * 0.5 - x[:, 1:2]).astype(np.float32)
    return {"x": x, "y": y}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    net = TinyBnNet()
    with torch.no_grad():  # running stats off their defaults, so copying them is visible
        net.bn1.running_mean.uniform_(-0.5, 0.5)
        net.bn1.running_var.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("bn") / "model.onnx"
    data = make_data()
    torch.onnx.export(
        copy.deepcopy(net), (torch.from_numpy(data["x"][:BATCH]), torch.from_numpy(data["y"][:BATCH])), str(path),
        input_names=["x", "y"], output_names=["loss"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
        opset_version=18, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
    )
    # Exporting in training mode runs one forward, which advances the running statistics that the
    # exporter then writes: the reference starts from the exported values, as the transpiled model does.
    exported_values = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in onnx.load(path).graph.initializer}
    net.load_state_dict({**net.state_dict(), **{k: v for k, v in exported_values.items() if k in net.state_dict()}})
    return net, path, data


def torch_train(net, data):
    net = copy.deepcopy(net).train()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        rows = np.arange(step * BATCH, (step + 1) * BATCH) % ROWS
        opt.zero_grad()
        loss = net(torch.from_numpy(data["x"][rows]), torch.from_numpy(data["y"][rows]))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = {k: v.detach().numpy() for k, v in net.state_dict().items() if v.dtype == torch.float32}
    return state, losses


def test_one_device_equals_torch_train_mode(exported, tmp_path):
    net, path, data = exported
    plan = transpile(path, tmp_path / "out", Options(world_size=1, optimizer=OptimizerConfig("sgd", lr=LR)))
    single = plan["graphs"]["single"]["state"]
    assert {s["input"] for s in single if s["kind"] == "buffer"} == {"bn1.running_mean", "bn1.running_var"}
    assert not {"bn1.running_mean", "bn1.running_var"} & {p["name"] for p in plan["parameters"]}
    result = simulate(tmp_path / "out", data, batch=BATCH, steps=STEPS, single_device=True)
    expected, losses = torch_train(net, data)
    assert result.parameters[0].keys() == expected.keys()  # parameters and running statistics
    assert max_rel_error(result.parameters[0], expected) <= 1e-5
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["allreduce", "sharded"])
def test_sync_bn_four_ranks_equal_one_device(exported, tmp_path, strategy):
    _, path, data = exported
    opts = dict(optimizer=OptimizerConfig("momentum", lr=LR))
    transpile(path, tmp_path / "one", Options(world_size=1, **opts))
    plan = transpile(path, tmp_path / "four", Options(world_size=4, strategy=strategy, sync_bn=True, **opts))
    ref = simulate(tmp_path / "one", data, batch=BATCH, steps=STEPS, single_device=True)
    result = simulate(tmp_path / "four", data, batch=BATCH, steps=STEPS)
    assert_replicas_identical(result.parameters)
    assert max_rel_error(result.parameters[0], ref.parameters[0]) <= 1e-5
    np.testing.assert_allclose(result.losses, ref.losses, rtol=1e-5)

    # Mean and variance all-reduced in the forward, and their transposes in the backward.
    rank0 = onnx.load(tmp_path / "four" / "rank0.onnx")
    stats = [n for n in rank0.graph.node if n.domain == "graph_transpiler" and n.op_type == "AllReduce"
             and "grad." not in n.input[0]]
    assert len(stats) == 4
    assert all(c["bytes"] == 8 * 4 for c in plan["collectives"]["step"] if c["bucket"] == -1)


def test_without_sync_bn_each_rank_uses_its_own_statistics(exported, tmp_path):
    _, path, data = exported
    opts = dict(optimizer=OptimizerConfig("sgd", lr=LR))
    transpile(path, tmp_path / "one", Options(world_size=1, **opts))
    transpile(path, tmp_path / "four", Options(world_size=4, **opts))
    ref = simulate(tmp_path / "one", data, batch=BATCH, steps=STEPS, single_device=True)
    result = simulate(tmp_path / "four", data, batch=BATCH, steps=STEPS)
    # Parameters stay identical across ranks (gradients are averaged) ...
    for name in ("fc1.weight", "fc2.weight"):
        np.testing.assert_array_equal(result.parameters[1][name], result.parameters[0][name])
    # ... but shard statistics differ from full-batch statistics, as with PyTorch DDP.
    assert max_rel_error(result.parameters[0], ref.parameters[0]) > 1e-4
    assert not np.array_equal(result.parameters[1]["bn1.running_mean"], result.parameters[0]["bn1.running_mean"])
