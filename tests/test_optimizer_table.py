"""Optimizer conformance: every entry of ``transpiler.optimizer_table.OPTIMIZER_TABLE`` must pass
every test here (nothing below names an optimizer)."""

from __future__ import annotations

import argparse

import numpy as np
import onnx_ir as ir
import pytest
from conftest import assert_replicas_identical, load_data, max_rel_error

from runtime import simulate
from transpiler import OptimizerConfig, Options, build, transpile
from transpiler.cli import add_arguments, optimizer_config
from transpiler.errors import TranspileError
from transpiler.names import STEP_STATE
from transpiler.optimizer import OPTIMIZERS, emit_step_increment, emit_update
from transpiler.optimizer_table import OPTIMIZER_TABLE
from transpiler.strategies import STRATEGIES

NAMES = list(OPTIMIZER_TABLE)
# The CLI options that belong to some optimizers only, by the OptimizerConfig field they set.
CLI_VALUES = {"momentum": "0.5", "betas": "0.8,0.9", "eps": "1e-6", "weight_decay": "0.1"}


def test_the_optimizer_module_reads_the_table():
    assert OPTIMIZERS == tuple(OPTIMIZER_TABLE)
    assert all(name == spec.name for name, spec in OPTIMIZER_TABLE.items())


@pytest.mark.parametrize("name", NAMES)
def test_config_follows_the_table(name):
    spec = OPTIMIZER_TABLE[name]
    config = OptimizerConfig(name).validate()
    assert config.slots() == spec.slots
    assert config.uses_step() == spec.uses_step
    assert config.weight_decay == spec.default_weight_decay
    assert config.lr == spec.default_lr
    assert set(spec.hyper_parameters) <= set(OptimizerConfig.__dataclass_fields__)


def test_the_default_lr_is_the_documented_one():
    """docs/cli.md: 0.01, 0.001 for adam/adamw (the plan once got 0.01 for adamw, and the built-in
    GPT's loss rose); an explicit lr always wins."""
    assert {name: OptimizerConfig(name).lr for name in NAMES} == {"sgd": 0.01, "momentum": 0.01, "adam": 1e-3,
                                                                  "adamw": 1e-3}
    assert OptimizerConfig("adamw", lr=0.5).lr == 0.5


@pytest.mark.parametrize("name", NAMES)
def test_emit_update_keeps_the_declared_state(name):
    config = OptimizerConfig(name)
    param = ir.val("w", ir.DataType.FLOAT, [3])
    grad = ir.val("g", ir.DataType.FLOAT, [3])
    lr = ir.val("lr", ir.DataType.FLOAT, [])
    counter = ir.val(STEP_STATE, ir.DataType.FLOAT, [])
    state = {slot: ir.val(f"w.{slot}", ir.DataType.FLOAT, [3]) for slot in config.slots()}
    graph = ir.Graph([param, grad, lr, counter, *state.values()], [], nodes=[], opset_imports={"": 18})
    step = emit_step_increment(graph, counter) if config.uses_step() else None
    _, new_state = emit_update(graph, config, param=param, grad=grad, lr=lr, step=step, state=state, name="w")
    assert tuple(new_state) == OPTIMIZER_TABLE[name].slots
    assert [v.name for v in new_state.values()] == [f"w.{slot}.next" for slot in OPTIMIZER_TABLE[name].slots]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_rank_graphs_hold_the_declared_state(name, strategy, model_dir):
    """Each updated parameter has one state entry per slot where its update runs, and the step
    counter exists exactly when the optimizer uses it."""
    spec = STRATEGIES[strategy]
    world = 1 if spec.single_device else 2
    job = build(model_dir("perceptron") / "model.onnx",
                Options(world_size=world, strategy=strategy if spec.user_selectable else Options().strategy,
                        optimizer=OptimizerConfig(name)))
    slots = OPTIMIZER_TABLE[name].slots
    for graphs in job.ranks:
        kinds = [e.kind for e in graphs.state]
        assert kinds.count("step") == (1 if OPTIMIZER_TABLE[name].uses_step else 0)
        optimizer_state = [e for e in graphs.state if e.kind == "optimizer"]
        for p in set(graphs.updates) & {e.param for e in optimizer_state}:
            assert [e.input for e in optimizer_state if e.param == p] == [f"{p}.{slot}" for slot in slots]
        assert len(optimizer_state) % len(slots) == 0 if slots else not optimizer_state


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("field", sorted(CLI_VALUES))
def test_cli_accepts_exactly_the_options_an_optimizer_reads(name, field):
    argv = ["model.onnx", "-o", "out", "--optimizer", name, f"--{field.replace('_', '-')}", CLI_VALUES[field]]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    if field in OPTIMIZER_TABLE[name].hyper_parameters:
        assert optimizer_config(args).validate().name == name
    else:
        with pytest.raises(TranspileError, match=f"--{field}: only used by"):
            optimizer_config(args)


@pytest.mark.parametrize("name", NAMES)
def test_n_ranks_equal_one_device(name, model_dir, tmp_path):
    config = OptimizerConfig(name, lr=1e-3)
    data = load_data(model_dir("perceptron") / "data.npz")
    results = []
    for world in (1, 2):
        out = tmp_path / f"out{world}"
        transpile(model_dir("perceptron") / "model.onnx", out, Options(world_size=world, optimizer=config))
        results.append(simulate(out, data, batch=16, steps=6, single_device=world == 1))
    assert_replicas_identical(results[1].parameters)
    assert max_rel_error(results[1].parameters[0], results[0].parameters[0]) <= 1e-5
    np.testing.assert_allclose(results[1].losses, results[0].losses, rtol=1e-5)

