"""``transpile run --grad-accumulation K``: gradient accumulation as a run option (HF Trainer's
``gradient_accumulation_steps``), on an OUT transpiled without it (runtime/accumulation.py derives
the accumulate graph and the accumulated step graph from the step graph and plan.json's
``gradients``).

Each run is compared with runs computed independently of the run option: the same OUT's model
transpiled with ``--grad-accumulation K`` (the transpiler's own graphs, tests/test_grad_accumulation.py
checks them against PyTorch) and run without the option, and, for models without BatchNorm, the
plain OUT on the whole batch. A model with BatchNorm shows that the micro-batches really are
K: its statistics, and so its training, differ from the whole batch's.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import child_env, load_data
from onnx import numpy_helper

from graph_transpiler import train
from runtime import simulate
from runtime.collectives import LocalGroup
from runtime.errors import RunError
from runtime.executor import CpuBackend
from runtime.plan import load_plan
from runtime.trainer import Trainer
from transpiler import OptimizerConfig, Options, transpile

K = 4
BATCH = 32  # 2 ranks x 4 micro-batches of 4 rows
STEPS = 6
# Within float32 rounding: the run option computes what the transpiled option computes, in the same
# order (measured: bit for bit, 0.0, on every case here).
SAME = 1e-6
# The run option against the whole batch without accumulation, no BatchNorm: the sums of the
# gradients are taken in another order (measured: at most 6e-8 of a parameter's scale).
ROUNDING = 1e-5


def _out(model: Path, out: Path, *, world: int = 2, **options) -> Path:
    optimizer = options.pop("optimizer", OptimizerConfig("sgd", lr=1e-3))
    transpile(model, out, Options(world_size=world, bucket_mb=0.001, optimizer=optimizer, **options))
    return out


def _max_rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Largest difference of a tensor, relative to the tensor's scale."""
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) / (float(np.max(np.abs(b[k]))) or 1.0)
               for k in b if b[k].size)


def _difference(a, b) -> float:
    """Of two SimResults: the largest relative difference of a loss or of any rank's state."""
    losses = float(np.max(np.abs(np.subtract(a.losses, b.losses)) / np.abs(b.losses)))
    return max([losses] + [_max_rel(x, y) for x, y in zip(a.states, b.states)])


@pytest.fixture(scope="module")
def perceptron(model_dir):
    directory = model_dir("perceptron")
    return directory / "model.onnx", load_data(directory / "data.npz")


@pytest.fixture(scope="module")
def batchnorm(tmp_path_factory):
    """A small ResNet (Conv + BatchNorm) and its data (the model is built with PyTorch)."""
    pytest.importorskip("torch")
    import models

    directory = tmp_path_factory.mktemp("cnn_small")
    models.generate("cnn_small", directory, seed=0, rows=128)
    return directory / "model.onnx", load_data(directory / "data.npz")


OPTIMIZERS = {"sgd": OptimizerConfig("sgd", lr=1e-3), "adamw": OptimizerConfig("adamw", lr=1e-3)}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", ["allreduce", "sharded"])
def test_run_option_equals_the_transpiled_option_and_the_whole_batch(perceptron, strategy, optimizer, tmp_path):
    model, data = perceptron
    plain = _out(model, tmp_path / "plain", strategy=strategy, optimizer=OPTIMIZERS[optimizer])
    transpiled = _out(model, tmp_path / "k", strategy=strategy, optimizer=OPTIMIZERS[optimizer], grad_accumulation=K)
    run = simulate(plain, data, batch=BATCH, steps=STEPS, grad_accumulation=K)
    expected = simulate(transpiled, data, batch=BATCH, steps=STEPS)
    whole = simulate(plain, data, batch=BATCH, steps=STEPS)
    print(f"{strategy}/{optimizer}: run option vs transpiled option {_difference(run, expected):.3g}, "
          f"vs the whole batch {_difference(run, whole):.3g}")
    assert _difference(run, expected) <= SAME
    assert _difference(run, whole) <= ROUNDING
    initial = simulate(plain, data, batch=BATCH, steps=1, lr=0.0).parameters[0]
    assert _max_rel(run.parameters[0], initial) > 1e-4, "training did not move the parameters"


def test_single_device_graphs_take_the_run_option_too(perceptron, tmp_path):
    model, data = perceptron
    plain = _out(model, tmp_path / "plain")
    transpiled = _out(model, tmp_path / "k", grad_accumulation=K)
    run = simulate(plain, data, batch=BATCH, steps=STEPS, single_device=True, grad_accumulation=K)
    expected = simulate(transpiled, data, batch=BATCH, steps=STEPS, single_device=True)
    assert _difference(run, expected) <= SAME


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", ["allreduce", "sharded"])
def test_batchnorm_statistics_move_with_each_micro_batch(batchnorm, strategy, optimizer, tmp_path):
    """A BatchNorm model: equal to the transpiled option (each micro-batch normalizes by its own
    statistics and moves the running ones), and far from the whole batch, which normalizes by
    the statistics of 2x as many rows: the run really cuts K micro-batches."""
    model, data = batchnorm
    k, batch = 2, 16
    plain = _out(model, tmp_path / "plain", strategy=strategy, optimizer=OPTIMIZERS[optimizer])
    transpiled = _out(model, tmp_path / "k", strategy=strategy, optimizer=OPTIMIZERS[optimizer], grad_accumulation=k)
    run = simulate(plain, data, batch=batch, steps=3, grad_accumulation=k)
    expected = simulate(transpiled, data, batch=batch, steps=3)
    whole = simulate(plain, data, batch=batch, steps=3)
    print(f"BatchNorm {strategy}/{optimizer}: run option vs transpiled option {_difference(run, expected):.3g}, "
          f"vs the whole batch {_difference(run, whole):.3g}")
    assert _difference(run, expected) <= SAME
    buffers = [s.input for s in load_plan(plain).ranks[0].state if s.kind == "buffer"]
    assert buffers and _max_rel({b: run.states[0][b] for b in buffers}, {b: whole.states[0][b] for b in buffers}) > 1e-3


@pytest.mark.parametrize("extra", [{"sync_bn": True}, {"grad_dtype": "bf16"}, {"precision": "bf16", "grad_dtype": "bf16"},
                                   {"precision": "fp16", "grad_dtype": "fp16"}],
                         ids=["sync-bn", "grad-dtype-bf16", "bf16", "fp16"])
def test_precision_and_sync_bn_plans(batchnorm, perceptron, extra, tmp_path):
    """The gradient the plan names may be the backward's own bf16/fp16 value (sent as is by
    --grad-dtype): accumulated in float32 and cast back, as the transpiler's graphs do; a
    --sync-bn forward keeps its statistics AllReduce in the accumulate graph."""
    model, data = batchnorm if extra.get("sync_bn") else perceptron
    k, batch = 2, 16
    optimizer = OptimizerConfig("adamw", lr=1e-3, max_grad_norm=1.0)
    plain = _out(model, tmp_path / "plain", strategy="sharded", optimizer=optimizer, **extra)
    transpiled = _out(model, tmp_path / "k", strategy="sharded", optimizer=optimizer, grad_accumulation=k, **extra)
    run = simulate(plain, data, batch=batch, steps=3, grad_accumulation=k)
    expected = simulate(transpiled, data, batch=batch, steps=3)
    assert _difference(run, expected) <= SAME


def test_the_default_path_runs_the_step_graph_as_written(perceptron, tmp_path):
    """No accumulation: no accumulate program and no accumulator input; the run option K > 1
    derives its graphs in memory and leaves OUT's files as they are."""
    model, _ = perceptron
    plain = _out(model, tmp_path / "plain")
    plan = load_plan(plain)
    files = sorted(plain.iterdir())
    digest = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    written = [i.name for i in onnx.load(str(plan.ranks[0].step)).graph.input]
    for given in (None, 1):
        trainer = Trainer(plan, LocalGroup(2).communicator(0), rank=0, backend=CpuBackend(threads=1), accumulation=given)
        assert trainer.accumulation == 1 and not hasattr(trainer, "accum_program")
        assert sorted(trainer.step_program.cut.inputs) == sorted(written)
    trainer = Trainer(plan, LocalGroup(2).communicator(0), rank=0, backend=CpuBackend(threads=1), accumulation=K)
    accumulators = [a.input for a in trainer.accumulators]
    assert trainer.accumulation == K and len(accumulators) == len(plan.parameters)
    assert sorted(trainer.step_program.cut.inputs) == sorted(written + accumulators)
    assert sorted(trainer.accum_program.cut.inputs) == sorted(
        [d.name for d in plan.data_inputs] + [p.name for p in plan.parameters] + accumulators)
    assert not trainer.accum_program.cut.collectives  # no gradient collective, no update
    assert {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(plain.iterdir())} == digest


def test_plan_names_each_gradient_the_step_graph_computes(perceptron, tmp_path):
    model, _ = perceptron
    plan = load_plan(_out(model, tmp_path / "plain", strategy="zero", grad_dtype="bf16"))
    for files in (plan.single, *plan.ranks):
        computed = {o for node in onnx.load(str(files.step)).graph.node for o in node.output}
        assert sorted(g.param for g in files.gradients) == sorted(p.name for p in plan.parameters)
        assert all(g.value in computed for g in files.gradients)


def _run(argv: list[str], capsys) -> tuple[int, list[str], str]:
    """``transpile ARGV`` in this process: its status, its stderr lines and its stdout."""
    from commands.main import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines(), captured.out


def test_errors_are_one_line(perceptron, tmp_path, capsys):
    model, data = perceptron
    plain = _out(model, tmp_path / "plain")
    transpiled = _out(model, tmp_path / "k", grad_accumulation=K)
    np.savez(tmp_path / "d.npz", **data)
    common = ["--data", str(tmp_path / "d.npz"), "--steps", "2", "--backend", "cpu"]
    cases = [
        (["run", str(plain), "--batch", "16", "--grad-accumulation", "3", *common],
         "global batch 16 does not split into 2 rank(s) x 3 micro-batches (--grad-accumulation 3); use a multiple of 6"),
        (["run", str(plain), "--batch", "16", "--grad-accumulation", "0", *common],
         "--grad-accumulation must be an integer >= 1, got 0"),
        (["run", str(transpiled), "--batch", "16", "--grad-accumulation", "2", *common],
         f"--grad-accumulation 2: {transpiled} was transpiled with --grad-accumulation {K}, which its graphs do; give "
         f"{K} or leave the option out (to choose K at run time, transpile without --grad-accumulation)"),
    ]
    for argv, message in cases:
        code, lines, _ = _run(argv, capsys)
        assert (code, lines) == (2, [f"transpile: error: {message}"])
    (tmp_path / "c.json").write_text(json.dumps({"grad-accumulation": "4"}))
    code, lines, _ = _run(["run", str(plain), "--batch", "16", *common, "--config", str(tmp_path / "c.json")], capsys)
    assert code == 2 and lines == [f"transpile: error: --config {tmp_path / 'c.json'}: key 'grad-accumulation' must be "
                                   "an integer, got \"4\" (a string)"]


def test_a_plan_without_gradients_is_refused_with_the_option_only(perceptron, tmp_path):
    """An OUT written before plan.json named its gradients runs as before, and refuses the option."""
    model, data = perceptron
    plain = _out(model, tmp_path / "plain")
    raw = json.loads((plain / "plan.json").read_text())
    for entry in [raw["graphs"]["single"], *raw["graphs"]["ranks"]]:
        entry.pop("gradients", None)
    (plain / "plan.json").write_text(json.dumps(raw))
    simulate(plain, data, batch=BATCH, steps=1)
    with pytest.raises(RunError, match=r"--grad-accumulation 2: .*plan.json does not name the step graphs' gradients "
                                       r"\(written by an older transpiler\); transpile the model again"):
        simulate(plain, data, batch=BATCH, steps=1, grad_accumulation=2)


def test_the_reader_checks_the_gradients_field(perceptron, tmp_path):
    from contract.plan import PlanError
    from contract.plan import load_plan as read

    model, _ = perceptron
    plain = _out(model, tmp_path / "plain")
    raw = json.loads((plain / "plan.json").read_text())
    dropped = raw["graphs"]["ranks"][0]["gradients"].pop()
    (plain / "plan.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError, match=rf"field 'graphs.ranks\[0\].gradients' must name each trained parameter of "
                                        rf"'parameters' once; lacks {dropped['param']}$"):
        read(plain)


def test_a_backend_without_accumulation_refuses_the_run_option(perceptron, tmp_path):
    class NotCpu(CpuBackend):
        name = "other"
        runs_grad_accumulation = False

    model, _ = perceptron
    plan = load_plan(_out(model, tmp_path / "plain"))
    with pytest.raises(RunError, match="run with --grad-accumulation 2, which the other backend does not run yet; use "
                                       "--backend cpu, or run without it"):
        Trainer(plan, LocalGroup(2).communicator(0), rank=0, backend=NotCpu(), accumulation=2)
    Trainer(plan, LocalGroup(2).communicator(0), rank=0, backend=NotCpu())  # without it: runs


def test_config_file_and_flags_resolve_the_option(perceptron, tmp_path):
    from commands.main import parse
    from runtime.cli import resolve

    model, data = perceptron
    plain = _out(model, tmp_path / "plain")
    transpiled = _out(model, tmp_path / "k", grad_accumulation=K)
    np.savez(tmp_path / "d.npz", **data)
    (tmp_path / "c.json").write_text(json.dumps({"data": str(tmp_path / "d.npz"), "batch": BATCH, "steps": 2,
                                                 "grad_accumulation": 4}))

    def resolved(out, *flags):
        return resolve(parse(["run", str(out), "--config", str(tmp_path / "c.json"), *flags]))[2].grad_accumulation

    assert resolved(plain) == 4
    assert resolved(plain, "--grad-accumulation", "2") == 2  # the command line over the file
    (tmp_path / "c.json").write_text(json.dumps({"data": str(tmp_path / "d.npz"), "batch": BATCH, "steps": 2}))
    assert resolved(plain) == 1 and resolved(transpiled) == K  # absent: the plan's
    assert resolved(transpiled, "--grad-accumulation", str(K)) == K  # the same K: accepted


def _weights(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def test_a_run_from_a_config_file_equals_the_transpiled_option(perceptron, tmp_path, capsys):
    """One rank (in this process, no MPI): ``--config`` with ``grad-accumulation`` trains, exports
    and reports what the transpiled option does; the banner says so."""
    model, data = perceptron
    plain = _out(model, tmp_path / "plain", world=1, optimizer=OptimizerConfig("adamw", lr=1e-3))
    transpiled = _out(model, tmp_path / "k", world=1, optimizer=OptimizerConfig("adamw", lr=1e-3), grad_accumulation=K)
    np.savez(tmp_path / "d.npz", **data)
    (tmp_path / "c.json").write_text(json.dumps({"data": str(tmp_path / "d.npz"), "batch": BATCH, "steps": STEPS,
                                                 "grad-accumulation": K, "log-every": 1, "backend": "cpu",
                                                 "export": str(tmp_path / "t.onnx"), "progress": "lines",
                                                 "metrics": str(tmp_path / "m.jsonl")}))
    code, lines, printed = _run(["run", str(plain), "--config", str(tmp_path / "c.json")], capsys)
    assert code == 0, lines
    assert f"{BATCH:,} global ({BATCH:,} per rank, {K} micro-batches)" in printed
    expected = simulate(transpiled, data, batch=BATCH, steps=STEPS)
    from runtime.metrics import read_metrics

    records, _ = read_metrics(tmp_path / "m.jsonl")
    assert [r["loss"] for r in records] == pytest.approx(expected.losses, rel=SAME)
    assert _max_rel(_weights(tmp_path / "t.onnx"), expected.parameters[0]) <= SAME


def test_the_api_takes_the_option_and_resumes_with_it(perceptron, tmp_path):
    """train(..., grad_accumulation=K) on 2 in-process ranks equals the transpiled option step for
    step; checkpointed at step 3 and resumed, it ends where the uninterrupted run ends."""
    model, data = perceptron
    optimizer = OptimizerConfig("adamw", lr=1e-3)
    plain = _out(model, tmp_path / "plain", strategy="sharded", optimizer=optimizer)
    transpiled = _out(model, tmp_path / "k", strategy="sharded", optimizer=optimizer, grad_accumulation=K)
    expected = simulate(transpiled, data, batch=BATCH, steps=STEPS)
    whole = train(plain, data, batch=BATCH, steps=STEPS, grad_accumulation=K, log_every=1, verbose=False,
                  export=tmp_path / "whole.onnx")
    assert [r["loss"] for r in whole.records] == pytest.approx(expected.losses, rel=SAME)
    assert _max_rel(_weights(tmp_path / "whole.onnx"), expected.parameters[0]) <= SAME
    train(plain, data, batch=BATCH, steps=3, grad_accumulation=K, verbose=False, checkpoint=tmp_path / "ck")
    train(plain, data, batch=BATCH, steps=STEPS, grad_accumulation=K, verbose=False, checkpoint=tmp_path / "ck",
          resume="latest", export=tmp_path / "resumed.onnx")
    assert _max_rel(_weights(tmp_path / "resumed.onnx"), _weights(tmp_path / "whole.onnx")) == 0.0
    with pytest.raises(RunError, match="--grad-accumulation must be an integer >= 1, got 0"):
        train(plain, data, batch=BATCH, steps=1, grad_accumulation=0, verbose=False)


@pytest.mark.mpi
def test_transpile_run_on_mpi_ranks(perceptron, tmp_path):
    """``transpile run OUT --grad-accumulation K`` on 2 MPI ranks: the losses logged and the
    exported weights are the transpiled option's."""
    model, data = perceptron
    plain = _out(model, tmp_path / "plain", optimizer=OptimizerConfig("momentum", lr=1e-3))
    transpiled = _out(model, tmp_path / "k", optimizer=OptimizerConfig("momentum", lr=1e-3), grad_accumulation=K)
    np.savez(tmp_path / "d.npz", **data)
    done = subprocess.run([sys.executable, "-m", "commands", "run", str(plain), "--data", str(tmp_path / "d.npz"),
                           "--batch", str(BATCH), "--steps", str(STEPS), "--grad-accumulation", str(K), "--log-every", "1",
                           "--backend", "cpu", "--export", str(tmp_path / "t.onnx"), "--metrics", str(tmp_path / "m.jsonl")],
                          capture_output=True, text=True, timeout=300, env=child_env())
    assert done.returncode == 0, done.stderr
    from runtime.metrics import read_metrics

    expected = simulate(transpiled, data, batch=BATCH, steps=STEPS)
    assert [r["loss"] for r in read_metrics(tmp_path / "m.jsonl")[0]] == pytest.approx(expected.losses, rel=SAME)
    assert _max_rel(_weights(tmp_path / "t.onnx"), expected.parameters[0]) <= SAME
