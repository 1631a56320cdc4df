"""World-size-free checkpoints (issue 29, item 2): a checkpoint written by 4 ranks resumes on 2 and
on 8 ranks, under any strategy, and the run goes on as an uninterrupted run of that size does
(within 1e-6: the ranks' gradient means round differently); with another global batch it goes on
from the samples already read; another model or optimizer is refused in one line.

The references are computed without the checkpoint code: uninterrupted runs of the new size, or one
device stepping through rows this file computes itself."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import load_data, max_rel_error
from onnx import numpy_helper

from runtime.collectives import LocalGroup
from runtime.config import RunConfig
from runtime.data import Dataset
from runtime.errors import RunError
from runtime.executor import CpuBackend
from runtime.loop import train
from runtime.metrics import read_metrics
from runtime.plan import load_plan
from runtime.resume import find_resume
from runtime.schedule import Schedule
from runtime.simulate import run_threads
from runtime.trainer import Trainer
from transpiler import OptimizerConfig, Options, transpile

STRATEGIES = ("allreduce", "sharded", "zero")
LR = 0.01
BATCH, AT, STEPS, SEED = 32, 3, 6, 3  # global batch; checkpoint step; last step; shuffle seed
TOLERANCE = 1e-6


def cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "transpiler.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def exported(path):
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}


@pytest.fixture(scope="module")
def out(model_dir, tmp_path_factory):
    """``out(gpus, strategy, optimizer="adamw", **options)``: the perceptron transpiled so (cached)."""
    model = model_dir("perceptron") / "model.onnx"
    cache = {}

    def get(gpus: int, strategy: str, optimizer: str = "adamw", **options):
        key = (gpus, strategy, optimizer, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = tmp_path_factory.mktemp(f"out{gpus}_{strategy}")
            transpile(model, cache[key], Options(world_size=gpus, strategy=strategy,
                                                 optimizer=OptimizerConfig(optimizer, lr=LR, **options)))
        return cache[key]

    return get


def run_in_process(out_dir, data, *, steps, batch=BATCH, checkpoint=None, resume=None):
    """Every rank of OUT as a thread (runtime/simulate.py's harness) through the whole loop,
    checkpoints and resume included; rank 0's parameters and the losses."""
    plan = load_plan(out_dir)
    dataset = Dataset(data, plan.data_inputs, "<data>")
    if resume is not None:
        resume, _ = find_resume(resume, plan, shuffle=True, seed=SEED)
    config = RunConfig(batch=batch, steps=steps, lr=LR, shuffle=True, seed=SEED, schedule=Schedule(),
                       checkpoint=checkpoint, resume=resume)
    group = LocalGroup(plan.world_size)
    trainers = [None] * plan.world_size

    def run_rank(r):
        trainers[r] = Trainer(plan, group.communicator(r), rank=r, backend=CpuBackend(threads=1))
        return train(trainers[r], dataset, config)

    losses = run_threads(group, run_rank)
    return trainers[0].parameters(), losses


def one_device(out_dir, data, batches):
    """The single-device graphs stepped through ``batches`` (global batch sizes, in order) from
    position 0 of the shuffled stream, rows computed here: the reference of a run whose global
    batch changed at a resume. Final parameters and losses."""
    plan = load_plan(out_dir)
    rows = len(next(iter(data.values())))
    trainer = Trainer(plan, LocalGroup(1).communicator(0), rank=None, backend=CpuBackend(threads=1))
    trainer.initialize()
    position, losses = 0, []
    for size in batches:
        positions = np.arange(position, position + size)
        epochs, within = positions // rows, positions % rows
        taken = np.array([np.random.default_rng([SEED, int(e)]).permutation(rows)[i] for e, i in zip(epochs, within)])
        losses.append(trainer.step({name: array[taken] for name, array in data.items()}, LR))
        position += size
    return trainer.parameters(), losses


def test_in_process_resume_on_another_size_and_strategy(model_dir, out, tmp_path):
    """Quick form of the MPI test below: each strategy's 4-rank checkpoint resumes on 8 ranks of the
    next strategy and on 2 of the one after, each equal to an uninterrupted run of that plan."""
    data = load_data(model_dir("perceptron") / "data.npz")
    for i, strategy in enumerate(STRATEGIES):
        store = tmp_path / strategy
        run_in_process(out(4, strategy), data, steps=AT, checkpoint=store)
        for gpus, other in ((8, STRATEGIES[(i + 1) % 3]), (2, STRATEGIES[(i + 2) % 3])):
            resumed, resumed_losses = run_in_process(out(gpus, other), data, steps=STEPS, resume=store)
            whole, whole_losses = run_in_process(out(gpus, other), data, steps=STEPS)
            assert max_rel_error(resumed, whole) <= TOLERANCE, (strategy, gpus, other)
            np.testing.assert_allclose(resumed_losses, whole_losses[AT:], rtol=TOLERANCE)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_of_4_ranks_resumes_on_2_and_8(model_dir, out, tmp_path, strategy):
    src = model_dir("perceptron")
    common = ["--data", src / "data.npz", "--batch", BATCH, "--shuffle", "--seed", SEED, "--log-every", 1]
    first = cli("run", out(4, strategy), *common, "--steps", AT, "--checkpoint", tmp_path / "ckpt", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    saved = tmp_path / "ckpt" / f"checkpoint-{AT}"
    assert sorted(p.name for p in saved.iterdir()) == ["meta.json", *(f"rank{r}.npz" for r in range(4))]
    at_checkpoint = exported_from(saved, out(4, strategy), tmp_path / "at.onnx", tmp_path)
    for gpus in (2, 8):
        target = out(gpus, strategy)
        resumed = cli("run", target, *common, "--steps", STEPS, "--resume", tmp_path / "ckpt", "--export",
                      tmp_path / f"resumed{gpus}.onnx", "--metrics", tmp_path / f"resumed{gpus}.jsonl", cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr
        assert "warning: --resume" not in resumed.stderr  # same batch, same model: nothing to warn about
        whole = cli("run", target, *common, "--steps", STEPS, "--export", tmp_path / f"whole{gpus}.onnx",
                    "--metrics", tmp_path / f"whole{gpus}.jsonl", cwd=tmp_path)
        assert whole.returncode == 0, whole.stderr
        a, b = exported(tmp_path / f"resumed{gpus}.onnx"), exported(tmp_path / f"whole{gpus}.onnx")
        assert max_rel_error(a, b) <= TOLERANCE, gpus
        assert max_rel_error(a, at_checkpoint) > 1e-3  # it trained on from the checkpoint
        after = [r["loss"] for r in read_metrics(tmp_path / f"resumed{gpus}.jsonl")[0]]
        losses = [r["loss"] for r in read_metrics(tmp_path / f"whole{gpus}.jsonl")[0]]
        np.testing.assert_allclose(after, losses[AT:], rtol=TOLERANCE)
        # transpile export reads a checkpoint of any world size: the values the writer's OUT gets.
        assert exported_from(saved, target, tmp_path / f"export{gpus}.onnx", tmp_path).keys() == at_checkpoint.keys()
        assert (tmp_path / f"export{gpus}.onnx").read_bytes() == (tmp_path / "at.onnx").read_bytes()


def exported_from(checkpoint, out_dir, path, cwd):
    done = cli("export", out_dir, "--checkpoint", checkpoint, "-o", path, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return exported(path)


@pytest.mark.mpi
def test_another_global_batch_goes_on_from_the_samples_read(model_dir, out, tmp_path):
    """4 ranks x 8 rows per step; resumed on 8 ranks x 8 rows (--batch 64, given as --epochs) and on
    2 x 8 (--batch 16): the step counter (AdamW's bias correction, the schedule) goes on from the
    checkpoint's step and the data stream from the sample it reached, which one device reproduces."""
    src = model_dir("perceptron")
    data = load_data(src / "data.npz")
    common = ["--data", src / "data.npz", "--shuffle", "--seed", SEED, "--log-every", 0]
    first = cli("run", out(4, "zero"), *common, "--batch", BATCH, "--steps", AT, "--checkpoint", tmp_path / "ckpt",
                cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    rows = len(data["X"])
    for gpus, strategy, batch, length in ((8, "sharded", 64, ["--epochs", 1.5]), (2, "allreduce", 16, ["--steps", 7])):
        resumed = cli("run", out(gpus, strategy), *common, "--batch", batch, *length, "--resume", tmp_path / "ckpt",
                      "--export", tmp_path / f"resumed{gpus}.onnx", "--metrics", tmp_path / f"m{gpus}.jsonl",
                      cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr
        assert f"from sample {AT * BATCH} of the data stream" in resumed.stderr
        steps = read_metrics(tmp_path / f"m{gpus}.jsonl")[1]["steps"]
        if length[0] == "--epochs":  # the rows still to read, at the new batch: 1.5 epochs in all
            assert steps == AT + -(-(int(1.5 * rows) - AT * BATCH) // batch)
        expected, _ = one_device(out(1, "allreduce"), data, [BATCH] * AT + [batch] * (steps - AT))
        assert max_rel_error(exported(tmp_path / f"resumed{gpus}.onnx"), expected) <= TOLERANCE, gpus


@pytest.fixture(scope="module")
def one_rank_checkpoint(model_dir, out, tmp_path_factory):
    """A checkpoint of the perceptron (AdamW) written by one rank, at step 2."""
    store = tmp_path_factory.mktemp("one_rank") / "ckpt"
    run_in_process(out(1, "allreduce"), load_data(model_dir("perceptron") / "data.npz"), steps=2, batch=16,
                   checkpoint=store)
    return store


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """OUT of a perceptron with the same parameter names and other shapes (hidden 50, not 100)."""
    from models import perceptron

    tmp = tmp_path_factory.mktemp("narrow")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(perceptron, "HIDDEN", 50)
        onnx.save(perceptron.build(0), tmp / "model.onnx")
    transpile(tmp / "model.onnx", tmp / "out", Options(world_size=2, optimizer=OptimizerConfig("adamw", lr=LR)))
    return tmp / "out"


def refusal(out_dir, checkpoint, *, shuffle=True, export=False):
    with pytest.raises(RunError) as caught:
        find_resume(checkpoint, load_plan(out_dir), shuffle=shuffle, seed=SEED, export=export)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_a_different_model_is_refused(narrow, one_rank_checkpoint):
    expected = "a different model: parameter 'fc2.weight' is [1, 100] float32 in the checkpoint, [1, 50] float32 in this plan"
    assert expected in refusal(narrow, one_rank_checkpoint)
    assert expected in refusal(narrow, one_rank_checkpoint, export=True)  # transpile export needs the parameters only


@pytest.mark.parametrize(("optimizer", "options", "expected"), [
    ("sgd", {}, "a different optimizer: the checkpoint's is adamw, this plan's sgd"),
    ("adamw", {"weight_decay": 0.1}, "a different optimizer: the checkpoint's adamw has weight_decay 0.01, this plan's 0.1"),
])
def test_a_different_optimizer_is_refused(out, one_rank_checkpoint, optimizer, options, expected):
    assert expected in refusal(out(2, "zero", optimizer, **options), one_rank_checkpoint)
    find_resume(one_rank_checkpoint, load_plan(out(2, "zero", optimizer, **options)), shuffle=True, seed=SEED,
                export=True)  # the parameters are the same: it exports


def test_another_data_order_and_an_old_checkpoint_are_refused(out, one_rank_checkpoint, tmp_path):
    assert "cannot be mapped to another data order" in refusal(out(2, "sharded"), one_rank_checkpoint, shuffle=False)
    # A checkpoint of the previous format (no state by name) resumes only on the plan that wrote it.
    old = tmp_path / "old" / "checkpoint-2"
    old.mkdir(parents=True)
    for path in (one_rank_checkpoint / "checkpoint-2").iterdir():
        (old / path.name).write_bytes(path.read_bytes())
    meta = json.loads((old / "meta.json").read_text())
    for key in ("tensors", "model", "samples"):
        del meta[key]
    (old / "meta.json").write_text(json.dumps({**meta, "format_version": 2}))
    assert "before checkpoints recorded their state by name" in refusal(out(2, "sharded"), old)
    assert find_resume(old, load_plan(out(1, "allreduce")), shuffle=True, seed=SEED)[0] == old


@pytest.mark.slow  # starts transpile processes
def test_refusals_are_one_line_on_the_command_line(model_dir, narrow, one_rank_checkpoint, tmp_path):
    data = model_dir("perceptron") / "data.npz"
    for args in (["run", narrow, "--data", data, "--batch", 16, "--steps", 4, "--shuffle", "--seed", SEED,
                  "--resume", one_rank_checkpoint],
                 ["export", narrow, "--checkpoint", one_rank_checkpoint, "-o", tmp_path / "x.onnx"]):
        done = cli(*args, cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "a different model: parameter 'fc2.weight'" in lines[0], lines
