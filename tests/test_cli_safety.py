"""What a user's mistakes must not cost: an output option never destroys a directory that is not
ours, output paths are checked before training (not after it), and Ctrl-C or SIGTERM on
``transpile run`` stops every rank at once with one line, leaving no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli_errors import assert_clean_error, transpile_cli


@pytest.fixture
def project(model_dir, tmp_path) -> Path:
    """A user's folder: the perceptron's model and data next to their own files."""
    source = model_dir("perceptron")
    root = tmp_path / "project"
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "todo.txt").write_text("mine\n")
    for name in ("model.onnx", "data.npz"):
        (root / name).write_bytes((source / name).read_bytes())
    return root


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("out", [".", "", "notes", "model.onnx", "model.onnx/sub"])
def test_transpile_never_replaces_a_directory_that_is_not_an_out(project, out):
    before = _files(project)
    done = transpile_cli("model.onnx", "--gpus", "2", "-o", out, cwd=project)
    assert_clean_error(done, "-o")
    assert _files(project) == before


def test_transpile_replaces_an_earlier_out_and_fills_an_empty_directory(project):
    (project / "empty").mkdir()
    for out in ("empty", "empty"):  # new into an empty directory, then over the earlier OUT
        done = transpile_cli("model.onnx", "--gpus", "2", "-o", out, cwd=project)
        assert done.returncode == 0, done.stderr
        assert (project / out / "plan.json").is_file()


def _run(project: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transpiler.cli", "run", "out", "--data", "data.npz", "--batch", "16",
                           "--steps", "2", *extra], capture_output=True, text=True, cwd=project, timeout=300)


@pytest.mark.parametrize("option,value,fragment", [
    ("--checkpoint", "notes", "not a checkpoint"),
    ("--checkpoint", "out", "not a checkpoint"),
    ("--checkpoint", "data.npz", "not a directory"),
    ("--checkpoint", "data.npz/ck", "is a file"),
    ("--timings", "notes", "is a directory"),
    ("--timings", "data.npz/t.json", "is a file, not a directory"),
    ("--export", "notes", "is a directory"),
])
def test_a_bad_output_path_is_refused_before_training(project, option, value, fragment):
    assert transpile_cli("model.onnx", "--gpus", "2", "-o", "out", cwd=project).returncode == 0
    before = _files(project)
    done = _run(project, option, value)
    assert_clean_error(done, option, fragment)
    assert "step 1/" not in done.stdout  # refused before any step ran
    assert _files(project) == before


def test_checkpoint_into_an_earlier_checkpoint_or_an_empty_directory(project):
    assert transpile_cli("model.onnx", "--gpus", "2", "-o", "out", cwd=project).returncode == 0
    (project / "ck").mkdir()
    for _ in range(2):
        done = _run(project, "--checkpoint", "ck")
        assert done.returncode == 0, done.stderr
        assert (project / "ck" / "checkpoint-2" / "meta.json").is_file()


def _alive(marker: str, seconds: float = 10.0) -> list[str]:
    """The live processes whose command line holds ``marker``, once none is left or ``seconds`` have
    passed: a rank SIGKILLed as the job ends may still be exiting when ``transpile run`` returns."""
    deadline = time.monotonic() + seconds
    while True:
        listed = subprocess.run(["ps", "-ww", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
        left = [line for line in listed.splitlines() if marker in line and "ps -ww" not in line and " Z" not in line]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.mark.mpi
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_stops_every_rank(project, sig):
    """Ctrl-C from a terminal reaches the whole foreground process group: so does this test's."""
    out = project / f"out-{sig.name}"
    assert transpile_cli("model.onnx", "--gpus", "2", "-o", out.name, cwd=project).returncode == 0
    job = subprocess.Popen([sys.executable, "-m", "transpiler.cli", "run", str(out), "--data", "data.npz", "--batch",
                            "16", "--steps", "100000000", "--log-every", "1000000"], cwd=project,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = job.stdout.readline()
        while line and not line.startswith("step "):  # the banner comes first
            line = job.stdout.readline()
        assert line.startswith("step 1/")  # the ranks are training
        started = time.monotonic()
        os.killpg(job.pid, sig) if sig == signal.SIGINT else job.send_signal(sig)
        _, err = job.communicate(timeout=60)
        elapsed = time.monotonic() - started
    finally:  # whatever happened, leave nothing of this job running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert job.returncode == 128 + sig, err
    assert err.strip().splitlines() == [f"transpile: interrupted by {sig.name}: the 2 rank(s) were stopped"], err
    assert elapsed < 20
    assert _alive(str(out)) == []  # no mpiexec, proxy or rank left


def test_out_and_export_get_ordinary_permissions(project):
    """Written through private temp files, then given the permissions of any new file (umask)."""
    mask = os.umask(0o022)
    try:
        assert transpile_cli("model.onnx", "--gpus", "2", "-o", "out", cwd=project).returncode == 0
        assert _run(project, "--export", "trained.onnx").returncode == 0
    finally:
        os.umask(mask)
    assert (project / "out").stat().st_mode & 0o777 == 0o755
    assert (project / "trained.onnx").stat().st_mode & 0o777 == 0o644


def test_sigterm_while_writing_out_leaves_nothing_behind(model_dir, tmp_path):
    """OUT is written into a temporary sibling; SIGTERM in the middle removes it and exits 143."""
    source = model_dir("gpt")
    job = subprocess.Popen([sys.executable, "-m", "transpiler.cli", str(source / "model.onnx"), "--gpus", "4", "-o",
                            str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while job.poll() is None and not any(p.name.startswith(".out.") for p in tmp_path.iterdir()):
        assert time.monotonic() < deadline, "the transpile never started writing"
        time.sleep(0.005)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    if job.returncode == 0:
        pytest.skip("the write finished before the signal arrived")
    assert job.returncode == 143, err
    assert err.strip().splitlines()[-1] == "transpile: terminated", err
    assert list(tmp_path.iterdir()) == []  # neither OUT nor its temporary directory
