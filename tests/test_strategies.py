"""Strategy conformance: every entry of ``transpiler.strategies.STRATEGIES`` must pass every test here.

A new strategy gets these checks by being in the table; nothing below names a strategy. The
``allreduce`` entry is the reference (as DDP's all-reduce comm hook is): the others must match it
bit for bit on the same ranks, and N ranks of any of them must equal one device.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import assert_replicas_identical, load_data, max_rel_error

from runtime import simulate
from transpiler import OptimizerConfig, Options, build, transpile
from transpiler.collectives import collective_nodes
from transpiler.job import reduced_gradient_name
from transpiler.strategies import STRATEGIES
from transpiler.strategies.allreduce import AllReduce
from transpiler.strategies.base import sent_to_reduction

MODEL = "perceptron"
STEPS = 8
BATCH = 24  # divisible by 1, 2 and 3
TOLERANCE = 1e-5  # N ranks vs one device: the mean over shards rounds differently from the full batch
CONFIG = OptimizerConfig("adamw", lr=1e-3, max_grad_norm=50.0)
# Against the reference, bit for bit: without clipping, whose global norm a strategy holding part
# of the gradients sums in another order (one ulp apart).
UNCLIPPED = OptimizerConfig("adamw", lr=1e-3)


def worlds(name: str) -> list[int]:
    """The rank counts a strategy is checked on: 3 does not divide the perceptron's buckets evenly."""
    return [1] if STRATEGIES[name].single_device else [2, 3]


CASES = [(name, world) for name in STRATEGIES for world in worlds(name)]
IDS = [f"{name}-{world}" for name, world in CASES]


def options(name: str, world: int, optimizer: OptimizerConfig = CONFIG, **overrides) -> Options:
    strategy = name if STRATEGIES[name].user_selectable else Options().strategy
    return Options(world_size=world, strategy=strategy, optimizer=optimizer, placement="balanced", bucket_mb=0.002,
                   **overrides)


@pytest.fixture(scope="module")
def one_device(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one-device") / "out"
    transpile(model_dir(MODEL) / "model.onnx", out, Options(optimizer=CONFIG))
    return simulate(out, load_data(model_dir(MODEL) / "data.npz"), batch=BATCH, steps=STEPS, single_device=True)


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """The reference strategy on ``world`` ranks."""
    cache = {}

    def get(world: int):
        if world not in cache:
            out = tmp_path_factory.mktemp(f"reference-{world}") / "out"
            transpile(model_dir(MODEL) / "model.onnx", out, options(AllReduce.name, world, UNCLIPPED))
            cache[world] = simulate(out, load_data(model_dir(MODEL) / "data.npz"), batch=BATCH, steps=STEPS)
        return cache[world]

    return get


@pytest.mark.parametrize(("name", "world"), CASES, ids=IDS)
def test_n_ranks_equal_one_device(name, world, model_dir, one_device, reference, tmp_path):
    transpile(model_dir(MODEL) / "model.onnx", tmp_path / "out", options(name, world))
    result = simulate(tmp_path / "out", load_data(model_dir(MODEL) / "data.npz"), batch=BATCH, steps=STEPS)
    assert_replicas_identical(result.parameters)
    assert max_rel_error(result.parameters[0], one_device.parameters[0]) <= TOLERANCE
    np.testing.assert_allclose(result.losses, one_device.losses, rtol=1e-5)


@pytest.mark.parametrize(("name", "world"), [c for c in CASES if c[1] > 1], ids=[i for c, i in zip(CASES, IDS) if c[1] > 1])
def test_equals_the_reference_strategy(name, world, model_dir, reference, tmp_path):
    transpile(model_dir(MODEL) / "model.onnx", tmp_path / "out", options(name, world, UNCLIPPED))
    result = simulate(tmp_path / "out", load_data(model_dir(MODEL) / "data.npz"), batch=BATCH, steps=STEPS)
    assert_replicas_identical(result.parameters)
    tolerance = STRATEGIES[name].reference_tolerance  # 0: bit for bit
    if tolerance == 0:
        for param, value in reference(world).parameters[0].items():
            np.testing.assert_array_equal(result.parameters[0][param], value, err_msg=param)
    else:
        assert max_rel_error(result.parameters[0], reference(world).parameters[0]) <= tolerance


@pytest.fixture(scope="module")
def jobs(model_dir):
    cache = {}

    def get(name: str, world: int, **overrides):
        key = (name, world, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = build(model_dir(MODEL) / "model.onnx", options(name, world, **overrides))
        return cache[key]

    return get


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize(("name", "world"), CASES, ids=IDS)
def test_each_gradient_reduced_as_declared(name, world, accumulation, jobs):
    job = jobs(name, world, grad_accumulation=accumulation)
    expected = STRATEGIES[name].reductions_per_gradient
    assert expected == (0 if world == 1 else 1)
    for graphs in job.ranks:
        sent = sent_to_reduction(graphs.step.graph)
        assert {p: sent[reduced_gradient_name(job, p)] for p in job.problem.params} == dict.fromkeys(
            job.problem.params, expected), f"rank {graphs.rank}"


@pytest.mark.parametrize(("name", "world"), CASES, ids=IDS)
def test_updates_per_parameter_as_declared(name, world, jobs):
    job = jobs(name, world)
    low, high = STRATEGIES[name].updates_per_param(world)
    updates = Counter(p for graphs in job.ranks for p in graphs.updates)
    assert all(low <= updates[p] <= high for p in job.problem.params), updates
    # Every parameter's new value is a state output of every rank: replicas stay equal.
    for graphs in job.ranks:
        assert sorted(e.param for e in graphs.state if e.kind == "param") == sorted(job.problem.params)


@pytest.mark.parametrize(("name", "world"), CASES, ids=IDS)
def test_same_collective_order_on_every_rank(name, world, jobs):
    job = jobs(name, world, grad_accumulation=2)

    def sequence(graph):
        nodes = sorted(collective_nodes(graph), key=lambda n: n.attributes["order"].as_int())
        return [(n.op_type, n.attributes["order"].as_int(), n.attributes["bucket"].as_int(),
                 n.attributes["root"].as_int() if "root" in n.attributes else None,
                 n.attributes["reduction"].value if "reduction" in n.attributes else None) for n in nodes]

    for phase in ("step", "init", "accum"):
        sequences = [sequence(getattr(graphs, phase).graph) for graphs in job.ranks]
        assert all(s == sequences[0] for s in sequences), phase
        assert [order for _, order, *_ in sequences[0]] == list(range(len(sequences[0]))), phase


def test_the_table_lists_one_reference_and_one_single_device_strategy():
    assert AllReduce.name in STRATEGIES
    assert sum(s.single_device for s in STRATEGIES.values()) == 1
    assert all(name == s.name for name, s in STRATEGIES.items())
    assert Options().strategy in STRATEGIES and STRATEGIES[Options().strategy].user_selectable


class _ReducedTwice(AllReduce):
    """A broken strategy: every bucket all-reduced twice."""

    name = "reduced_twice"

    def reduce(self, step, bucket):
        super().reduce(step, bucket)
        return super().reduce(step, bucket)


class _OnlyRankZeroReduces(AllReduce):
    """A broken strategy: rank 1 skips the gradient collectives (a hang at run time)."""

    name = "only_rank_zero_reduces"

    def reduce(self, step, bucket):
        return super().reduce(step, bucket) if step.rank == 0 else [step.grads[p] for p in bucket.params]


@pytest.mark.parametrize(("broken", "message"), [(_ReducedTwice, "reduced 2 times"),
                                                 (_OnlyRankZeroReduces, "collective")])
def test_a_table_entry_that_breaks_an_invariant_is_refused(broken, message, model_dir, monkeypatch):
    """A strategy is checked by being in the table: the pass's ensures runs the checks above."""
    monkeypatch.setitem(STRATEGIES, broken.name, broken())
    with pytest.raises(Exception) as info:
        build(model_dir(MODEL) / "model.onnx", options(broken.name, 2))
    chain, cause = [], info.value
    while cause is not None:  # the PassManager wraps the pass's PostconditionError
        chain.append(str(cause))
        cause = cause.__cause__
    assert message in " ".join(chain), chain
