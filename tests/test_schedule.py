"""Learning-rate schedules: the lr fed each step follows torch.optim.lr_scheduler, and training with a
schedule equals PyTorch with the same scheduler."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import load_data, max_rel_error

from runtime import simulate
from runtime.errors import RunError
from runtime.schedule import Schedule
from transpiler import OptimizerConfig, Options, transpile

STEPS, LR = 20, 0.1


def torch_lrs(make_scheduler, steps: int = STEPS) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=LR)
    scheduler = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize(
    "schedule, make_scheduler",
    [
        (Schedule("cosine", min_lr=0.01), lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS, eta_min=0.01)),
        (Schedule("step", step_size=6, gamma=0.5), lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=6, gamma=0.5)),
        (Schedule("constant", warmup_steps=5),
         lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=1 / 5, end_factor=1.0, total_iters=4)),
    ],
    ids=["cosine", "step", "warmup"],
)
def test_schedules_follow_torch(schedule, make_scheduler):
    ours = [schedule.function(LR, STEPS)(t) for t in range(STEPS)]
    np.testing.assert_allclose(ours, torch_lrs(make_scheduler), rtol=1e-12)


def test_warmup_then_cosine_and_linear_end_at_min_lr():
    for kind in ("cosine", "linear"):
        lr_at = Schedule(kind, warmup_steps=4, min_lr=0.02).function(LR, STEPS)
        assert [lr_at(t) for t in range(4)] == pytest.approx([LR * (t + 1) / 4 for t in range(4)])
        assert lr_at(4) == pytest.approx(LR)
        values = [lr_at(t) for t in range(4, STEPS)]
        assert all(a >= b for a, b in zip(values, values[1:]))  # decays monotonically
        assert values[-1] > 0.02 and lr_at(STEPS) == pytest.approx(0.02)  # reaches min_lr at T


def test_schedule_errors():
    with pytest.raises(RunError, match="--warmup-steps"):
        Schedule("cosine", warmup_steps=20).validate(20)
    with pytest.raises(RunError, match="--lr-step-size"):
        Schedule("step").validate(20)


def test_training_with_a_schedule_equals_torch(model_dir, tmp_path):
    """Single device, cosine schedule: parameters equal PyTorch with CosineAnnealingLR, and 2 ranks equal 1."""
    import models.torch_twins as twins

    src = model_dir("perceptron")
    data = load_data(src / "data.npz")
    transpile(src / "model.onnx", tmp_path / "out", Options(world_size=2, optimizer=OptimizerConfig("momentum")))
    schedule = Schedule("cosine", min_lr=1e-5)
    lr = 1e-3
    one = simulate(tmp_path / "out", data, batch=32, steps=STEPS, lr=lr, single_device=True, schedule=schedule)
    two = simulate(tmp_path / "out", data, batch=32, steps=STEPS, lr=lr, schedule=schedule)
    assert max_rel_error(two.parameters[0], one.parameters[0]) <= 1e-5

    net = twins.twin_for("perceptron", src / "model.onnx")
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, foreach=False)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-5)
    for step in range(STEPS):
        rows = np.arange(step * 32, (step + 1) * 32) % len(data["X"])
        opt.zero_grad()
        net(torch.from_numpy(data["X"][rows]), torch.from_numpy(data["Y"][rows])).backward()
        opt.step()
        scheduler.step()
    expected = {k: v.detach().numpy() for k, v in net.named_parameters()}
    assert max_rel_error(one.parameters[0], expected) <= 1e-5
