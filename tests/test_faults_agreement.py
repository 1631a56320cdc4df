"""The ranks' agreement (issue 27, item 4): every RunConfig field is decided once, in
runtime/config.py ``AGREEMENT``, as agreed (in the fingerprint the ranks compare before any training
collective) or local; a new field without a decision fails here. Under an outside launcher ranks
that differ in an option that changes the sequence of collectives (checkpoint, log, evaluation
cadence) are refused in one line instead of hanging until --timeout."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_faults import ENV, cli, one_error_line
from test_runtime_outdir import make_data, write_out

from runtime.config import AGREED, AGREEMENT, LOCAL, RunConfig, agreed_fields
from runtime.data import Dataset
from runtime.plan import load_plan
from runtime.schedule import Schedule
from runtime.worker import compare_fingerprints, fingerprint


def test_every_run_config_field_is_decided_agreed_or_local():
    """Adding a RunConfig field without a line in AGREEMENT fails here: the ranks' agreement cannot
    silently leave a new option out."""
    fields = [f.name for f in dataclasses.fields(RunConfig)]
    undecided = sorted(set(fields) - set(AGREEMENT))
    assert not undecided, f"RunConfig fields with no AGREEMENT entry in runtime/config.py: {undecided}"
    assert not set(AGREEMENT) - set(fields), "AGREEMENT names fields RunConfig no longer has"
    assert {role for role, _ in AGREEMENT.values()} <= {AGREED, LOCAL}
    labels = [label for _, label in AGREEMENT.values()]
    assert len(labels) == len(set(labels)), "each field is named its own way in the disagreement line"
    # What changes the sequence of collectives is agreed (issue 27's list), and so is what the
    # fingerprint compared before.
    for name in ("batch", "steps", "lr", "schedule", "shuffle", "seed", "log_every", "checkpoint", "checkpoint_every",
                 "eval_data", "eval_every", "eval_batch", "export", "export_best", "timings", "resume", "out", "data",
                 "backend"):
        assert AGREEMENT[name][0] == AGREED, name


def _changed(name: str, value):
    """Another value of the same kind, for field ``name``."""
    if name == "schedule":
        return dataclasses.replace(value, warmup_steps=(value.warmup_steps or 0) + 3)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, dict):
        return {**value, "changed": "1"}
    if isinstance(value, tuple):
        return (*value, "changed")
    if value is None or isinstance(value, Path):
        return Path("/elsewhere") / name
    if isinstance(value, str):
        return value + "-other"
    raise AssertionError(f"no other value for {name}={value!r}")


def test_the_fingerprint_covers_each_agreed_field_and_no_local_one(tmp_path):
    out = write_out(tmp_path / "out", 2, "allreduce")
    plan = load_plan(out)
    np.savez(tmp_path / "d.npz", **make_data())
    dataset = Dataset.load(tmp_path / "d.npz", plan.data_inputs)
    base = RunConfig(batch=4, steps=10, lr=0.1, shuffle=True, seed=3, log_every=5, checkpoint=tmp_path / "ck",
                     checkpoint_every=2, export=tmp_path / "t.onnx", schedule=Schedule(), eval_every=2, eval_batch=4,
                     out=out, data=tmp_path / "d.npz", timeout=30.0, spawned=True, parent="1:2", run_dir=tmp_path)
    mine = fingerprint(plan, dataset, base)
    for f in dataclasses.fields(RunConfig):
        role, label = AGREEMENT[f.name]
        other = dataclasses.replace(base, **{f.name: _changed(f.name, getattr(base, f.name))})
        theirs = fingerprint(plan, dataset, other)
        if role == LOCAL:
            assert theirs == mine, f.name
        elif f.name in ("out", "data"):
            assert theirs == mine, f.name  # compared as the plan's hash and the data's shapes, not the paths
        else:
            assert theirs[label] != mine[label], f.name
            line = compare_fingerprints([mine, theirs])
            assert line.startswith(f"the ranks disagree on {label} (rank 0: "), line
    assert set(mine) == {AGREEMENT[name][1] for name in agreed_fields()} | {"runtime version"}


@pytest.mark.mpi
@pytest.mark.parametrize("a, b, fragment", [
    (["--checkpoint-every", "2"], ["--checkpoint-every", "3"], "--checkpoint-every (rank 0: 2; rank 1: 3)"),
    (["--log-every", "1"], ["--log-every", "2"], "--log-every (rank 0: 1; rank 1: 2)"),
    (["--eval-every", "1"], ["--eval-every", "2"], "--eval-every (rank 0: 1; rank 1: 2)"),
])
def test_ranks_with_another_cadence_are_refused_in_one_line(model_dir, tmp_path, a, b, fragment):
    """mpiexec -n 1 A : -n 1 B, each rank resolving its own command line: the cadences that decide
    when host collectives run are compared before the first one (they hung until --timeout)."""
    from runtime.launcher import find_mpiexec

    src = model_dir("perceptron")
    out = tmp_path / "out"
    assert cli(src / "model.onnx", "--gpus", 2, "-o", out, cwd=tmp_path).returncode == 0

    def rank(*extra):
        return [sys.executable, "-m", "commands", "run", str(out), "--data", str(src / "data.npz"), "--batch", "32",
                "--steps", "6", "--log-every", "0", "--checkpoint", str(tmp_path / "ck"), "--eval-data",
                str(src / "data.npz"), "--timeout", "60", *extra]

    began = time.monotonic()
    done = subprocess.run([find_mpiexec(), "-n", "1", *rank(*a), ":", "-n", "1", *rank(*b)], capture_output=True,
                          text=True, cwd=tmp_path, env=ENV, timeout=120)
    took = time.monotonic() - began
    one_error_line(done, "the ranks disagree on", fragment, "refused before any training collective")
    assert took < 55, took  # before the 60 s --timeout: the refusal, not the watchdog, ended it
    assert not list((tmp_path / "ck").glob("checkpoint-*"))
