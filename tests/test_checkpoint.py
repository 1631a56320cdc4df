"""Checkpoint and resume: a run stopped at step k and resumed ends exactly where an uninterrupted
run ends (every rank's optimizer state, the step counter and the data stream carry over)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper


def cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "transpiler.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def exported(path):
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["sharded", "zero"])
def test_resumed_run_equals_an_uninterrupted_one(model_dir, tmp_path, strategy):
    src = model_dir("perceptron")
    out = tmp_path / "out"
    assert cli(src / "model.onnx", "--gpus", 2, "--strategy", strategy, "--optimizer", "adamw", "--lr", "0.01",
               "-o", out, cwd=tmp_path).returncode == 0
    common = ["--data", src / "data.npz", "--batch", 32, "--shuffle", "--seed", 3, "--log-every", 0]

    whole = cli("run", out, *common, "--steps", 12, "--export", tmp_path / "whole.onnx", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    first = cli("run", out, *common, "--steps", 5, "--checkpoint", tmp_path / "ckpt", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    saved = tmp_path / "ckpt" / "checkpoint-5"
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["step"] == 5 and meta["world_size"] == 2
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".lock", "checkpoint-5"]
    assert sorted(p.name for p in saved.iterdir()) == ["meta.json", "rank0.npz", "rank1.npz"]
    # Each rank keeps its own optimizer state: sharded, that of the parameters it is root of; zero,
    # its slice of every bucket.
    ranks = [dict(np.load(saved / f"rank{r}.npz")) for r in range(2)]
    if strategy == "sharded":
        assert ranks[0].keys() != ranks[1].keys()
    else:
        assert ranks[0].keys() == ranks[1].keys()
        assert not np.array_equal(ranks[0]["bucket0.slice.exp_avg"], ranks[1]["bucket0.slice.exp_avg"])

    resumed = cli("run", out, *common, "--steps", 12, "--resume", tmp_path / "ckpt", "--export",
                  tmp_path / "resumed.onnx", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    a, b = exported(tmp_path / "whole.onnx"), exported(tmp_path / "resumed.onnx")
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)


def test_resume_errors(model_dir, tmp_path):
    src = model_dir("perceptron")
    for name, gpus in (("a", 1), ("b", 2)):
        assert cli(src / "model.onnx", "--gpus", gpus, "-o", tmp_path / name, cwd=tmp_path).returncode == 0
    common = ["--data", src / "data.npz", "--log-every", 0]
    assert cli("run", tmp_path / "a", *common, "--batch", 8, "--steps", 2, "--checkpoint", tmp_path / "ckpt",
               cwd=tmp_path).returncode == 0

    def error(*args):
        done = cli("run", *args, cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        return done.stderr.strip()

    # Another plan of the same model (here 2 ranks) resumes it (tests/test_checkpoint_resize.py); another
    # data order cannot be mapped.
    assert "no --shuffle" in error(tmp_path / "b", *common, "--batch", 8, "--steps", 4, "--shuffle", "--resume",
                                   tmp_path / "ckpt")
    assert "nothing to do" in error(tmp_path / "a", *common, "--batch", 8, "--steps", 2, "--resume", tmp_path / "ckpt")
    assert "not a checkpoint" in error(tmp_path / "a", *common, "--batch", 8, "--steps", 4, "--resume", tmp_path)
