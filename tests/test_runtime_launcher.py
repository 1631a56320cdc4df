"""Launcher detection, the mpiexec command line, the CLI's errors, and one real 2-process MPI run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from test_runtime_outdir import make_data, write_out

from runtime import RunError, simulate
from runtime.cli import main
from runtime.config import RunConfig
from runtime.guard import parent_token
from runtime.launcher import LAUNCHERS, check_world_size, child_environment, mpiexec_command
from runtime.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
LAUNCHER_VARS = tuple(sorted({launcher.rank for launcher in LAUNCHERS}))


def test_world_size_mismatch_is_an_error():
    with pytest.raises(RunError, match="launcher started 3 process.*world_size 2; launch with -n 2"):
        check_world_size(3, 2, "MPICH/Hydra")


def test_mpiexec_flags_by_flavor():
    assert mpiexec_command("mpiexec", "mpich", 2, ["OUT"])[:3] == ["mpiexec", "-n", "2"]
    openmpi = mpiexec_command("mpiexec", "openmpi", 2, ["OUT"])
    assert "--oversubscribe" in openmpi and ("--allow-run-as-root" in openmpi) == (os.geteuid() == 0)
    assert openmpi[openmpi.index("--bind-to") + 1] == "none"  # else 1 or 2 ranks get one core each
    assert openmpi[-4:] == [sys.executable, "-m", "runtime.worker", "OUT"]
    assert child_environment()["NCCL_NVLS_ENABLE"] == "0"
    # What a rank needs of its parent is in its RunConfig: the environment gains no variable of ours.
    assert not [k for k in child_environment() if k.startswith("GRAPH_TRANSPILER_") and k not in os.environ]


def _clean_env(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


def test_cli_errors_are_one_line_with_status_2(tmp_path, capsys, monkeypatch):
    _clean_env(monkeypatch)
    out = write_out(tmp_path / "out", 2, "allreduce")
    np.savez(tmp_path / "d.npz", **make_data())
    assert main(["run", str(out), "--data", str(tmp_path / "d.npz"), "--batch", "5", "--steps", "1"]) == 2
    assert capsys.readouterr().err == "transpile: error: global batch 5 does not split into 2 equal shards " \
                                      "(batch % world_size = 1); use a multiple of 2\n"
    data = make_data()
    np.savez(tmp_path / "d.npz", x=data["x"])
    assert main(["run", str(out), "--data", str(tmp_path / "d.npz"), "--batch", "4", "--steps", "1"]) == 2
    assert "missing input 'y'" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_an_invalid_timeout_is_one_line(tmp_path, capsys, monkeypatch, value):
    _clean_env(monkeypatch)
    out = write_out(tmp_path / "out", 2, "allreduce")
    np.savez(tmp_path / "d.npz", **make_data())
    assert main(["run", str(out), "--data", str(tmp_path / "d.npz"), "--batch", "4", "--steps", "1", "--timeout",
                 value]) == 2
    assert capsys.readouterr().err == f"transpile: error: --timeout must be a positive number of seconds, got {value}\n"


def test_the_ranks_learn_of_their_parent_from_their_run_configuration(tmp_path, capsys, monkeypatch):
    """transpile run tells the ranks it starts that it started them, its token (pid and start time)
    and the directory of their heartbeats in their RunConfig, not in environment variables; on
    several hosts the token and the directory (meaningless there) are left out."""
    _clean_env(monkeypatch)
    out = write_out(tmp_path / "out", 2, "allreduce")
    np.savez(tmp_path / "d.npz", **make_data())
    seen = {}

    def spawn(n, args, run_dir=None, hosts=None, timeout=None):
        option, given = args
        seen["config"] = RunConfig.load(given) if option == "--config" else RunConfig.from_json(json.loads(given))
        seen["run_dir"], seen["hosts"], seen["timeout"] = run_dir, hosts, timeout
        return 0

    monkeypatch.setattr("runtime.cli.spawn", spawn)
    run = ["run", str(out), "--data", str(tmp_path / "d.npz"), "--batch", "4", "--steps", "1", "--backend", "cpu",
           "--timeout", "7"]
    assert main(run) == 0
    config = seen["config"]
    assert config.spawned and config.parent == parent_token() and config.timeout == 7
    assert config.run_dir == seen["run_dir"] and config.run_dir.name.startswith("transpile-run.")
    assert seen["timeout"] == 7  # the parent's own deadlines (runtime/launcher.py) use the same knob
    assert main([*run, "--hosts", "a:1,b:1"]) == 0
    config = seen["config"]
    assert seen["hosts"] and config.spawned and config.parent is None and config.run_dir is None
    capsys.readouterr()


@pytest.mark.mpi
def test_two_mpi_processes_train_like_the_simulator(tmp_path):
    out = write_out(tmp_path / "out", 2, "sharded")
    data = make_data(rows=12)
    np.savez(tmp_path / "d.npz", **data)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = str(REPO)
    command = [sys.executable, "-m", "runtime", "run", str(out), "--data", str(tmp_path / "d.npz"), "--batch", "4",
               "--steps", "3", "--log-every", "1", "--export", str(tmp_path / "trained.onnx"),
               "--metrics", str(tmp_path / "m.jsonl")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]  # rank 0 only, one line per step
    expected = simulate(out, data, batch=4, steps=3)
    records, _ = read_metrics(tmp_path / "m.jsonl")
    assert [r["loss"] for r in records] == pytest.approx(expected.losses, rel=1e-5)
    trained = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "trained.onnx")).graph.initializer}
    for name, value in expected.parameters[0].items():
        np.testing.assert_array_equal(trained[name], value)  # MPI mean == local mean, bit for bit, on 2 ranks

    # A rank that fails mid-training prints one line naming itself; the job exits non-zero, no hang.
    broken = onnx.load(str(out / "rank1.onnx"))
    target = next(t for t in broken.graph.initializer if t.name == "shape31")
    target.CopyFrom(numpy_helper.from_array(np.array([2, 2], np.int64), "shape31"))  # grad.w [3] cannot be [2, 2]
    onnx.save(broken, out / "rank1.onnx")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    assert done.stderr.startswith("transpile: error: rank 1: rank1.onnx: segment 1: onnxruntime failed:")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr

    # An error before training (here: a value with no type) is agreed on by all ranks and printed once.
    broken.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 4
    onnx.save(broken, out / "rank1.onnx")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("transpile: error: rank 1: rank1.onnx: value 'dpred' enters segment 1 but has no type")
    assert done.stderr.count("\n") == 1

