"""Optimizer updates emitted as ONNX ops against torch.optim (torch 2.13, foreach=False), step by step.

Tolerance: with exact=True (the default) the ONNX update is bitwise equal to torch's on CPU, so
these tests compare with 0 tolerance. With exact=False (float32 Mul+Add for torch's fused
multiply-adds) the parameters stay within rtol 1e-6 / atol 1e-7 of torch over 10 steps.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from transpiler.errors import TranspileError
from transpiler.optimizer import OptimizerConfig, emit_step_increment, emit_update

STEPS = 10
# 7*13 = 91 elements: torch's vectorized CPU loops run on full vectors and finish with a scalar tail,
# so both code paths are covered.
PARAM_SHAPE = (7, 13)

CASES = {
    "sgd": OptimizerConfig("sgd", lr=0.1),
    "sgd_wd": OptimizerConfig("sgd", lr=0.1, weight_decay=0.05),
    "momentum": OptimizerConfig("momentum", lr=0.05, momentum=0.9),
    "momentum_wd": OptimizerConfig("momentum", lr=0.05, momentum=0.8, weight_decay=0.01),
    "nesterov": OptimizerConfig("momentum", lr=0.05, momentum=0.9, nesterov=True),
    "nesterov_wd": OptimizerConfig("momentum", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.02),
    "adam": OptimizerConfig("adam", lr=1e-3),
    "adam_wd": OptimizerConfig("adam", lr=1e-2, weight_decay=0.1),
    "adam_betas": OptimizerConfig("adam", lr=1e-2, betas=(0.3, 0.95), eps=1e-6),
    "adamw_no_wd": OptimizerConfig("adamw", lr=1e-3, weight_decay=0.0),
    "adamw": OptimizerConfig("adamw", lr=1e-2),  # torch's default weight decay, 0.01
    "adamw_wd": OptimizerConfig("adamw", lr=1e-2, weight_decay=0.3, betas=(0.8, 0.99)),
}


def build_step_model(config: OptimizerConfig, *, exact: bool = True) -> onnx.ModelProto:
    """A graph whose inputs are param, grad, lr, [step], state and whose outputs are their updates."""
    graph = ir.Graph(inputs=[], outputs=[], nodes=[], opset_imports={"": 18}, name="optimizer_step")

    def add_input(name, shape):
        value = ir.val(name, ir.DataType.FLOAT, ir.Shape(shape))
        graph.inputs.append(value)
        return value

    param = add_input("w", PARAM_SHAPE)
    grad = add_input("w.grad", PARAM_SHAPE)
    lr = add_input("lr", [])
    step = add_input("optimizer.step", []) if config.uses_step() else None
    state = {slot: add_input(f"w.{slot}", PARAM_SHAPE) for slot in config.slots()}
    step_next = emit_step_increment(graph, step) if step is not None else None
    new_param, new_state = emit_update(
        graph, config, param=param, grad=grad, lr=lr, step=step_next, state=state, name="w", exact=exact
    )
    graph.outputs.extend([new_param, *(new_state[slot] for slot in config.slots())])
    if step_next is not None:
        graph.outputs.append(step_next)
    model = ir.to_proto(ir.Model(graph, ir_version=10))
    onnx.checker.check_model(model, full_check=True)
    return model


def learning_rates(config: OptimizerConfig) -> list[float]:
    # A schedule changes lr every step: lr is a graph input, fed like data. float32 values, because
    # the graph's lr input is float32; torch gets the same numbers as Python floats.
    return [float(np.float32(config.lr * (1.0 - 0.05 * t))) for t in range(STEPS)]


def torch_optimizer(config: OptimizerConfig, parameter: torch.Tensor) -> torch.optim.Optimizer:
    common = dict(lr=float(np.float32(config.lr)), weight_decay=config.weight_decay, foreach=False)
    if config.name == "sgd":
        return torch.optim.SGD([parameter], **common)
    if config.name == "momentum":
        return torch.optim.SGD([parameter], momentum=config.momentum, nesterov=config.nesterov, **common)
    cls = torch.optim.Adam if config.name == "adam" else torch.optim.AdamW
    return cls([parameter], betas=config.betas, eps=config.eps, **common)


def run_both(config: OptimizerConfig, *, exact: bool, seed: int = 0):
    """Yield (step, onnx param, torch param, onnx state, torch state) after each of STEPS steps."""
    rng = np.random.default_rng(seed)
    initial = rng.standard_normal(PARAM_SHAPE).astype(np.float32)
    # Gradients of varying scale, so the adaptive optimizers see a changing second moment.
    grads = [
        (rng.standard_normal(PARAM_SHAPE) * 10.0 ** rng.uniform(-2, 1)).astype(np.float32)
        for _ in range(STEPS)
    ]

    session = ort.InferenceSession(
        build_step_model(config, exact=exact).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    feeds = {
        "w": initial.copy(),
        **{f"w.{slot}": np.zeros(PARAM_SHAPE, np.float32) for slot in config.slots()},
    }
    if config.uses_step():
        feeds["optimizer.step"] = np.array(0.0, np.float32)
    state_names = ["w", *(f"w.{slot}" for slot in config.slots())] + (
        ["optimizer.step"] if config.uses_step() else []
    )

    parameter = torch.nn.Parameter(torch.from_numpy(initial.copy()))
    optimizer = torch_optimizer(config, parameter)
    torch_slot = {"momentum_buffer": "momentum_buffer", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

    for t, (lr, grad) in enumerate(zip(learning_rates(config), grads)):
        outputs = session.run(None, {**feeds, "w.grad": grad, "lr": np.array(lr, np.float32)})
        feeds = dict(zip(state_names, outputs))

        optimizer.param_groups[0]["lr"] = lr
        parameter.grad = torch.from_numpy(grad.copy())
        optimizer.step()
        torch_state = optimizer.state[parameter]
        yield (
            t,
            feeds["w"],
            parameter.detach().numpy(),
            {slot: feeds[f"w.{slot}"] for slot in config.slots()},
            {slot: torch_state[torch_slot[slot]].numpy() for slot in config.slots()},
        )
        if config.uses_step():
            assert float(feeds["optimizer.step"]) == float(torch_state["step"]) == t + 1


def correctly_rounded_sqrt(self: torch.Tensor) -> torch.Tensor:
    # float64 sqrt rounded to float32 is the correctly rounded float32 sqrt (53 >= 2*24 + 2 bits).
    return torch.sqrt(self.double()).to(self.dtype)


@pytest.mark.parametrize("case", sorted(CASES))
def test_update_is_bitwise_torch(case, monkeypatch):
    """exact=True reproduces torch's rounding; only torch's CPU sqrt (MKL) is swapped for the correctly
    rounded one that ONNX Sqrt and torch on CUDA compute, so the comparison is exact."""
    monkeypatch.setattr(torch.Tensor, "sqrt", correctly_rounded_sqrt)
    config = CASES[case].validate()
    for t, ours, theirs, our_state, their_state in run_both(config, exact=True):
        np.testing.assert_array_equal(ours, theirs, err_msg=f"{case}: parameter after step {t + 1}")
        for slot in config.slots():
            np.testing.assert_array_equal(
                our_state[slot], their_state[slot], err_msg=f"{case}: {slot} at step {t + 1}"
            )


@pytest.mark.parametrize("case", sorted(CASES))
def test_update_matches_stock_torch(case):
    """Against unpatched torch on CPU: SGD/momentum bitwise; Adam/AdamW within one float32 ulp per
    MKL sqrt difference (measured over 20 seeds: at most 6e-8 absolute on parameters of size ~1)."""
    config = CASES[case].validate()
    for t, ours, theirs, our_state, their_state in run_both(config, exact=True):
        if config.uses_step():
            np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7, err_msg=f"{case}: step {t + 1}")
            for slot in config.slots():
                np.testing.assert_allclose(
                    our_state[slot], their_state[slot], rtol=1e-6, atol=1e-7, err_msg=slot
                )
        else:
            np.testing.assert_array_equal(ours, theirs, err_msg=f"{case}: parameter after step {t + 1}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_fma_variant_is_close_to_torch(case, monkeypatch):
    """exact=False rounds torch's fused multiply-adds twice. Measured over 20 seeds and 10 steps: at
    most 9.5e-7 absolute on parameters of size ~1 (momentum/nesterov drift most)."""
    monkeypatch.setattr(torch.Tensor, "sqrt", correctly_rounded_sqrt)
    config = CASES[case].validate()
    for t, ours, theirs, _, _ in run_both(config, exact=False):
        np.testing.assert_allclose(
            ours, theirs, rtol=1e-5, atol=1e-6, err_msg=f"{case}: parameter after step {t + 1}"
        )


def test_graph_is_readable_typed_and_shares_scalars():
    graph = ir.Graph(inputs=[], outputs=[], nodes=[], opset_imports={"": 18})
    lr = ir.val("lr", ir.DataType.FLOAT, ir.Shape([]))
    step = ir.val("optimizer.step", ir.DataType.FLOAT, ir.Shape([]))
    graph.inputs.extend([lr, step])
    step_next = emit_step_increment(graph, step)
    config = OptimizerConfig("adamw").validate()
    for name, shape in (("fc1.weight", ["out", 4]), ("fc1.bias", [3])):
        param = ir.val(name, ir.DataType.FLOAT, ir.Shape(shape))
        grad = ir.val(f"{name}.grad", ir.DataType.FLOAT, ir.Shape(shape))
        state = {
            slot: ir.val(f"{name}.{slot}", ir.DataType.FLOAT, ir.Shape(shape)) for slot in config.slots()
        }
        graph.inputs.extend([param, grad, *state.values()])
        new_param, new_state = emit_update(
            graph, config, param=param, grad=grad, lr=lr, step=step_next, state=state, name=name
        )
        assert new_param.name == f"{name}.next"
        assert {slot: v.name for slot, v in new_state.items()} == {
            s: f"{name}.{s}.next" for s in config.slots()
        }
        for value in (new_param, *new_state.values()):
            assert value.dtype == ir.DataType.FLOAT and list(value.shape) == list(param.shape)

    assert step_next.name == "optimizer.step.next"
    value_names = [out.name for node in graph for out in node.outputs]
    node_names = [node.name for node in graph]
    assert len(set(value_names)) == len(value_names) and len(set(node_names)) == len(node_names)
    assert all(out.dtype is not None and out.shape is not None for node in graph for out in node.outputs)
    # The bias corrections depend only on lr and step: one Pow pair per graph, not per parameter.
    assert sum(node.op_type == "Pow" for node in graph) == 2
    assert any(name.startswith("fc1.bias.adamw.") for name in node_names)


def test_configuration_accessors():
    assert OptimizerConfig("adamw").weight_decay == 0.01
    assert OptimizerConfig("adam").weight_decay == 0.0
    assert OptimizerConfig("sgd").slots() == ()
    assert OptimizerConfig("momentum").slots() == ("momentum_buffer",)
    assert OptimizerConfig("adam").slots() == ("exp_avg", "exp_avg_sq")
    assert OptimizerConfig("adamw").uses_step() and not OptimizerConfig("momentum").uses_step()
    assert OptimizerConfig("adamw", lr=1e-3).to_json() == {
        "name": "adamw", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
        "weight_decay": 0.01, "momentum": 0.0, "nesterov": False, "max_grad_norm": None,
    }  # fmt: skip
    assert OptimizerConfig("momentum", nesterov=True).to_json()["momentum"] == 0.9


@pytest.mark.parametrize(
    ("config", "option"),
    [
        (OptimizerConfig("rmsprop"), "--optimizer"),
        (OptimizerConfig("sgd", lr=-0.1), "--lr"),
        (OptimizerConfig("sgd", lr=float("nan")), "--lr"),
        (OptimizerConfig("adam", betas=(0.9, 1.0)), "--betas"),
        (OptimizerConfig("adam", betas=(-0.1, 0.999)), "--betas"),
        (OptimizerConfig("adam", betas=(0.9,)), "--betas"),
        (OptimizerConfig("sgd", nesterov=True), "--nesterov"),
        (OptimizerConfig("adam", nesterov=True), "--nesterov"),
        (OptimizerConfig("momentum", momentum=0.0), "--momentum"),
        (OptimizerConfig("sgd", max_grad_norm=0.0), "--clip-grad-norm"),
        (OptimizerConfig("adamw", max_grad_norm=float("inf")), "--clip-grad-norm"),
        (OptimizerConfig("momentum", momentum=-0.5), "--momentum"),
        (OptimizerConfig("adamw", weight_decay=-1e-2), "--weight-decay"),
        (OptimizerConfig("adam", eps=-1.0), "--eps"),
    ],
)
def test_validate_rejects_bad_values_in_one_line(config, option):
    with pytest.raises(TranspileError) as caught:
        config.validate()
    message = str(caught.value)
    assert message.startswith(option) and "\n" not in message


def test_non_float32_parameter_is_a_user_error():
    graph = ir.Graph(inputs=[], outputs=[], nodes=[], opset_imports={"": 18})
    param = ir.val("emb", ir.DataType.FLOAT16, ir.Shape([2]))
    lr = ir.val("lr", ir.DataType.FLOAT, ir.Shape([]))
    with pytest.raises(TranspileError, match="'emb'.*float32"):
        emit_update(
            graph, OptimizerConfig("sgd"), param=param, grad=param, lr=lr, step=None, state={}, name="emb"
        )
