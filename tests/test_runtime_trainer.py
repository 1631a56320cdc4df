"""Training through the runtime: N ranks == 1 device, state handling, lr, export."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from test_runtime_outdir import INIT, LR, MOMENTUM, make_data, write_out

from runtime import RunError, simulate
from runtime.export import export_model
from runtime.plan import load_plan

# Shards change the order of float32 sums inside the gradient means, so N ranks match one device to
# rounding, not bit for bit; replicas of one run must match bit for bit.
RTOL, ATOL = 2e-6, 1e-6


def _numpy_reference(data, batch, steps, lr):
    """SGD momentum on the full batch, in float64: what every configuration must approximate."""
    w, b = INIT["w"].astype(np.float64), INIT["b"].astype(np.float64)
    vw, vb = np.zeros_like(w), np.zeros_like(b)
    rows = len(data["x"])
    losses = []
    for step in range(steps):
        idx = np.arange(step * batch, (step + 1) * batch) % rows
        x, y = data["x"][idx].astype(np.float64), data["y"][idx].astype(np.float64)
        diff = x @ w + b - y
        losses.append(float(np.mean(diff**2)))
        gw, gb = x.T @ (2 * diff) / batch, np.mean(2 * diff, axis=0)
        vw, vb = MOMENTUM * vw + gw, MOMENTUM * vb + gb
        w, b = w - lr * vw, b - lr * vb
    return losses, {"w": w, "b": b}


@pytest.mark.parametrize("strategy, world", [("allreduce", 2), ("sharded", 2), ("sharded", 3), ("allreduce", 4)])
def test_n_ranks_match_one_device_step_by_step(tmp_path, strategy, world):
    out = write_out(tmp_path, world, strategy)
    data = make_data(rows=24)
    batch = 12
    single = simulate(out, data, batch=batch, steps=6, single_device=True)
    ranks = simulate(out, data, batch=batch, steps=6)
    np.testing.assert_allclose(ranks.losses, single.losses, rtol=RTOL, atol=ATOL)
    for r in range(world):
        for name, value in single.parameters[0].items():
            np.testing.assert_allclose(ranks.parameters[r][name], value, rtol=RTOL, atol=ATOL)
            np.testing.assert_array_equal(ranks.parameters[r][name], ranks.parameters[0][name])  # replicas equal
        assert ranks.states[r]["optimizer.step"] == 6
    losses, params = _numpy_reference(data, batch, 6, LR)
    np.testing.assert_allclose(single.losses, losses, rtol=1e-5)
    for name, value in params.items():
        np.testing.assert_allclose(single.parameters[0][name], value, rtol=1e-5, atol=1e-6)


def test_sharded_optimizer_state_lives_on_the_root_only(tmp_path):
    result = simulate(write_out(tmp_path, 2, "sharded"), make_data(), batch=4, steps=2)
    assert "b.v" in result.states[0] and "w.v" not in result.states[0]
    assert "w.v" in result.states[1] and "b.v" not in result.states[1]


def test_lr_override_and_shuffle_agree_between_ranks_and_one_device(tmp_path):
    out = write_out(tmp_path, 2, "allreduce")
    data = make_data(rows=10)
    kwargs = dict(batch=4, steps=5, lr=0.01, shuffle=True, seed=3)
    single, ranks = simulate(out, data, single_device=True, **kwargs), simulate(out, data, **kwargs)
    np.testing.assert_allclose(ranks.losses, single.losses, rtol=RTOL, atol=ATOL)
    assert simulate(out, data, batch=4, steps=5, lr=0.01).losses[1:] != ranks.losses[1:]  # shuffle changed the batches
    # lr=None means the plan's optimizer lr.
    plan_lr, explicit = simulate(out, data, batch=4, steps=2), simulate(out, data, batch=4, steps=2, lr=LR)
    np.testing.assert_array_equal(plan_lr.parameters[0]["w"], explicit.parameters[0]["w"])
    assert not np.allclose(plan_lr.parameters[0]["w"], simulate(out, data, batch=4, steps=2, lr=0.01).parameters[0]["w"])


def test_simulate_reports_errors_once_with_the_rank(tmp_path):
    out = write_out(tmp_path, 2, "allreduce")
    with pytest.raises(RunError, match="global batch 3 does not split into 2 equal shards"):
        simulate(out, make_data(), batch=3, steps=1)
    broken = onnx.load(str(out / "rank1.onnx"))
    broken.graph.node[-1].input[1] = "nowhere"  # the step counter reads a value nothing produces
    onnx.save(broken, out / "rank1.onnx")
    with pytest.raises(RunError, match=r"^rank 1: rank1.onnx: node 'count' reads 'nowhere', which nothing produces"):
        simulate(out, make_data(), batch=4, steps=1)


def test_export_writes_trained_values_into_the_users_model(tmp_path):
    out = write_out(tmp_path / "out", 2, "sharded")
    result = simulate(out, make_data(), batch=4, steps=3)
    target = tmp_path / "trained.onnx"
    export_model(load_plan(out), result.parameters[0], target)
    model = onnx.load(str(target))
    trained = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for name, value in result.parameters[0].items():
        np.testing.assert_array_equal(trained[name], value)
    assert [n.op_type for n in model.graph.node] == [n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node]
    assert list(tmp_path.glob(".trained.onnx.*")) == []  # no temp file left behind
    with pytest.raises(RunError, match="has no initializer"):
        export_model(load_plan(out), {"nope": np.zeros(1, np.float32)}, target)
