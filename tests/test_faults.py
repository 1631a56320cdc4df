"""Faults (issue 12): non-finite losses, checkpoint locking, damaged and half-written checkpoints,
disk full, ... Each test makes the fault for real (a huge lr, a NaN in the data, a SIGKILL injected
inside a checkpoint save, a full tmpfs) on 2 CPU ranks under mpiexec and checks the one-line error,
the exit status and that no good state was lost."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import refresh_manifest
from onnx import numpy_helper

pytestmark = pytest.mark.mpi

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}


def cli(*args, cwd, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "commands", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env or ENV)


def one_error_line(done, *fragments):
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = [line for line in done.stderr.strip().splitlines() if line]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("transpile: error: ") and "Traceback" not in done.stderr, lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def all_finite(directory: Path) -> bool:
    for path in directory.glob("rank*.npz"):
        with np.load(path) as npz:
            if not all(np.isfinite(npz[k]).all() for k in npz.files if npz[k].dtype.kind == "f"):
                return False
    return True


def exported(path):
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}


@pytest.fixture(scope="module")
def job(model_dir, tmp_path_factory):
    """(directory, OUT, data, common run arguments) for a 2-rank perceptron."""
    src = model_dir("perceptron")
    root = tmp_path_factory.mktemp("faults")
    assert cli(src / "model.onnx", "--gpus", 2, "-o", root / "out", cwd=root).returncode == 0
    return root, root / "out", src / "data.npz", ["--data", src / "data.npz", "--batch", 32, "--log-every", 0]


def test_a_huge_lr_stops_at_the_first_non_finite_loss_and_keeps_the_last_good_checkpoint(job, tmp_path):
    _, out, _, common = job
    ck, trained = tmp_path / "ck", tmp_path / "trained.onnx"
    done = cli("run", out, *common, "--steps", 30, "--lr", "1e6", "--checkpoint", ck, "--checkpoint-every", 2,
               "--export", trained, cwd=tmp_path)
    line = one_error_line(done, "step ", "non-finite", "no checkpoint or export was written")
    step = int(line.split("step ")[1].split(":")[0])
    assert step < 30
    assert not trained.exists()
    saved = sorted(ck.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert saved, "the checkpoints before the blow-up are kept"
    assert int(saved[-1].name.split("-")[1]) < step
    assert all(all_finite(p) for p in saved)
    assert str(saved[-1]) in line  # the message names the last good checkpoint
    assert not list(ck.glob(".partial-*"))


def test_a_nan_in_the_data_stops_the_run_naming_the_step(job, tmp_path):
    _, out, data, _ = job
    with np.load(data) as npz:
        arrays = {k: npz[k].copy() for k in npz.files}
    name = next(k for k, a in arrays.items() if a.dtype.kind == "f" and a.ndim == 2 and a.shape[1] > 1)
    arrays[name][40, 0] = np.nan  # row 40: global batch 1 (batch 32), i.e. step 2
    np.savez(tmp_path / "nan.npz", **arrays)
    done = cli("run", out, "--data", tmp_path / "nan.npz", "--batch", 32, "--log-every", 0, "--steps", 5,
               "--export", tmp_path / "t.onnx", cwd=tmp_path)
    one_error_line(done, "step 2: the loss is nan")
    assert not (tmp_path / "t.onnx").exists()


def test_a_non_finite_gradient_norm_stops_the_run_at_its_step_though_the_loss_is_finite(tmp_path):
    """loss = mean(sqrt(x * w)) is finite for x = 0, its gradient 0/0 is not: with --clip-grad-norm
    the run stops at step 1 naming the gradient norm (without the check, step 2's loss is NaN)."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 1])
    loss = onnx.helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])
    nodes = [onnx.helper.make_node("Mul", ["x", "w"], ["xw"]), onnx.helper.make_node("Sqrt", ["xw"], ["r"]),
             onnx.helper.make_node("ReduceMean", ["r"], ["loss"], keepdims=0)]
    graph = onnx.helper.make_graph(nodes, "sqrt", [x], [loss], [onnx.numpy_helper.from_array(np.ones(1, np.float32), "w")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "model.onnx")
    np.savez(tmp_path / "data.npz", x=np.array([[1.0], [4.0], [0.0], [9.0]] * 4, np.float32))
    assert cli("model.onnx", "--gpus", 2, "--optimizer", "sgd", "--lr", 0.1, "--clip-grad-norm", 1.0, "-o", "out",
               cwd=tmp_path).returncode == 0
    done = cli("run", "out", "--data", "data.npz", "--batch", 4, "--steps", 3, "--export", "t.onnx", cwd=tmp_path)
    one_error_line(done, "step 1: the gradient norm is nan (non-finite)")
    assert not (tmp_path / "t.onnx").exists()


def test_a_second_run_on_a_locked_checkpoint_directory_is_refused(job, tmp_path):
    sys.path.insert(0, ENV["PYTHONPATH"])
    from runtime.checkpoint import Lock

    _, out, _, common = job
    lock = Lock(tmp_path / "ck")  # as another running `transpile run` holds it
    try:
        done = cli("run", out, *common, "--steps", 2, "--checkpoint", tmp_path / "ck", cwd=tmp_path)
        one_error_line(done, f"--checkpoint {tmp_path / 'ck'}: in use by another run (pid {os.getpid()})")
    finally:
        lock.release()
    assert cli("run", out, *common, "--steps", 2, "--checkpoint", tmp_path / "ck", cwd=tmp_path).returncode == 0


def test_keep_checkpoints_keeps_the_newest_k(job, tmp_path):
    _, out, _, common = job
    done = cli("run", out, *common, "--steps", 10, "--checkpoint", tmp_path / "ck", "--checkpoint-every", 2,
               "--keep-last", 3, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".lock", "checkpoint-10", "checkpoint-6",
                                                                   "checkpoint-8"]


def test_a_rank_file_from_another_step_is_skipped_or_refused(job, tmp_path):
    _, out, _, common = job
    ck = tmp_path / "ck"
    assert cli("run", out, *common, "--steps", 4, "--checkpoint", ck, "--checkpoint-every", 2, cwd=tmp_path).returncode == 0
    shutil.copy(ck / "checkpoint-2" / "rank1.npz", ck / "checkpoint-4" / "rank1.npz")
    # The manifest's hash catches it: resume warns and falls back to checkpoint-2.
    done = cli("run", out, *common, "--steps", 6, "--checkpoint", ck, "--resume", "latest", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    warning = done.stderr.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("transpile: warning: --resume: skipped"), done.stderr
    assert "checkpoint-4" in warning[0] and "rank1.npz does not match the manifest" in warning[0]
    # Even with a manifest forged to match, the step recorded in the rank file refuses it.
    shutil.copy(ck / "checkpoint-4" / "rank1.npz", tmp_path / "r4.npz")
    shutil.copy(ck / "checkpoint-6" / "rank1.npz", ck / "checkpoint-4" / "rank1.npz")
    refresh_manifest(ck / "checkpoint-4")
    done = cli("run", out, *common, "--steps", 8, "--resume", ck / "checkpoint-4", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "rank1.npz: holds the state of step 6, the checkpoint is at step 4" in done.stderr


def test_resume_refuses_another_lr_unless_overridden(job, tmp_path):
    _, out, _, common = job
    ck = tmp_path / "ck"
    assert cli("run", out, *common, "--steps", 2, "--checkpoint", ck, cwd=tmp_path).returncode == 0
    done = cli("run", out, *common, "--steps", 4, "--lr", 0.5, "--checkpoint", ck, "--resume", "latest", cwd=tmp_path)
    one_error_line(done, "--lr 0.01 (this run: 0.5)", "--override-schedule")
    done = cli("run", out, *common, "--steps", 4, "--lr-schedule", "cosine", "--resume", ck, cwd=tmp_path)
    one_error_line(done, "--lr-schedule constant (this run: cosine)")
    done = cli("run", out, *common, "--steps", 4, "--lr", 0.5, "--resume", ck, "--override-schedule", cwd=tmp_path)
    assert done.returncode == 0, done.stderr


# Put first on PYTHONPATH (the ranks inherit it), this sitecustomize kills the process that reaches
# POINT of the save of checkpoint STEP with SIGKILL (only rank 0 makes the directory, hashes the rank
# files and renames): through what runtime/checkpoint.py calls to do its work (Path.mkdir, os.replace,
# its _sha256 and _prune), so the product code has no hook for it.
FAULT_HOOK = """
import importlib.abc
import importlib.machinery
import os
import pathlib
import signal
import sys

POINT, STEP = {point!r}, {step!r}
PARTIAL, FINAL = f".partial-{{STEP}}", f"checkpoint-{{STEP}}"
published = []


def die():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


mkdir = pathlib.Path.mkdir


def mkdir_then_die(self, *args, **kwargs):
    mkdir(self, *args, **kwargs)
    if POINT == "mkdir" and self.name == PARTIAL:
        die()


replace = os.replace


def replace_then_die(src, dst, *args, **kwargs):
    replace(src, dst, *args, **kwargs)
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if POINT == "manifest" and dst.name == "meta.json" and dst.parent.name == PARTIAL:
        die()
    if src.name == PARTIAL and dst.name == FINAL:
        published.append(STEP)
        if POINT == "rename":
            die()


def wrap(checkpoint):
    sha256, prune = checkpoint._sha256, checkpoint._prune

    def die_then_sha256(path):  # the first thing rank 0 does once every rank file is on disk
        if POINT == "rank_files" and pathlib.Path(path).parent.name == PARTIAL:
            die()
        return sha256(path)

    def prune_then_die(*args, **kwargs):
        prune(*args, **kwargs)
        if POINT == "prune" and published:
            die()

    checkpoint._sha256, checkpoint._prune = die_then_sha256, prune_then_die


class Wrap(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "runtime.checkpoint":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            wrap(module)

        spec.loader.exec_module = exec_module
        return spec


pathlib.Path.mkdir, os.replace = mkdir_then_die, replace_then_die
sys.meta_path.insert(0, Wrap())
"""


def kill_at(directory: Path, point: str, step: int) -> Path:
    """A directory holding FAULT_HOOK's sitecustomize.py for POINT of the save of STEP."""
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(FAULT_HOOK.format(point=point, step=step))
    return directory


@pytest.mark.parametrize("point", ["mkdir", "rank_files", "manifest", "rename", "prune"])
def test_a_death_inside_a_checkpoint_save_still_resumes(job, tmp_path, point):
    """SIGKILL of rank 0 between the file operations of the save of step 4: the store still
    resumes (from step 4 when its manifest was on disk, else step 2) and ends exactly where an
    uninterrupted run ends."""
    root, out, _, common = job
    whole = root / "whole.onnx"
    if not whole.exists():
        assert cli("run", out, *common, "--steps", 6, "--export", whole, cwd=root).returncode == 0
    ck = tmp_path / "ck"
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(kill_at(tmp_path / "fault", point, 4)), ENV["PYTHONPATH"]])}
    died = cli("run", out, *common, "--steps", 6, "--checkpoint", ck, "--checkpoint-every", 2, cwd=tmp_path, env=env)
    assert died.returncode != 0
    assert (ck / "checkpoint-2").is_dir()  # never deleted before a newer one is complete
    done = cli("run", out, *common, "--steps", 6, "--checkpoint", ck, "--checkpoint-every", 2, "--resume", "latest",
               "--export", tmp_path / "resumed.onnx", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    a, b = exported(whole), exported(tmp_path / "resumed.onnx")
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    # Resumed from checkpoint-4, or from the complete .partial-4 (manifest on disk, not renamed yet);
    # the leftovers are gone once checkpoint-6 is complete.
    left = sorted(p.name for p in ck.iterdir())
    assert left == [".lock", "checkpoint-2" if point == "manifest" else "checkpoint-4", "checkpoint-6"], left


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str, read_only: bool = False):
    """A tmpfs of ``size`` mounted at ``path`` (a full disk), read-only with ``read_only``."""
    path.mkdir()
    options = f"ro,size={size}" if read_only else f"size={size}"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path, leave: int) -> None:
    """Fill the file system of ``directory`` up to ``leave`` free bytes."""
    free = shutil.disk_usage(directory).free
    with open(directory / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def test_disk_full_at_a_checkpoint_and_at_the_export(job, tmp_path):
    _, out, _, common = job
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        ck = disk / "ck"
        assert cli("run", out, *common, "--steps", 2, "--checkpoint", ck, cwd=tmp_path).returncode == 0
        before = {p.name: p.read_bytes() for p in (ck / "checkpoint-2").iterdir()}
        fill(disk, 4096)
        done = cli("run", out, *common, "--steps", 4, "--checkpoint", ck, "--resume", "latest", cwd=tmp_path)
        one_error_line(done, str(ck), "No space left on device (ENOSPC)", "checkpoint-2 is the newest complete")
        assert sorted(p.name for p in ck.iterdir()) == [".lock", "checkpoint-2"]  # partial files removed
        assert {p.name: p.read_bytes() for p in (ck / "checkpoint-2").iterdir()} == before

        # Export: the final checkpoint goes elsewhere, the export onto the full disk.
        ck2 = tmp_path / "ck2"
        done = cli("run", out, *common, "--steps", 3, "--checkpoint", ck2, "--export", disk / "trained.onnx",
                   cwd=tmp_path)
        line = one_error_line(done, f"--export {disk / 'trained.onnx'}: No space left on device (ENOSPC)",
                              str(ck2 / "checkpoint-3"), "transpile export")
        assert sorted(p.name for p in disk.iterdir()) == ["ck", "filler"]  # no partial export left
        # The command the message gives writes the export once there is room.
        (disk / "filler").unlink()
        later = line.split("'")[1].split()[1:]
        done = cli(*later[:-1], disk / "trained.onnx", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert (disk / "trained.onnx").is_file()

        # Without --checkpoint, the final state is kept in a rescue checkpoint under $TMPDIR.
        fill(disk, 4096)
        rescue_tmp = tmp_path / "rescue-tmp"
        rescue_tmp.mkdir()
        done = cli("run", out, *common, "--steps", 3, "--export", disk / "trained2.onnx", cwd=tmp_path,
                   env={**ENV, "TMPDIR": str(rescue_tmp)})
        line = one_error_line(done, f"--export {disk / 'trained2.onnx'}: No space left on device (ENOSPC)",
                              str(rescue_tmp / "transpile-rescue-"), "transpile export")
        rescued = Path(line.split("the trained state is in ")[1].split(":")[0])
        assert rescued.name == "checkpoint-3" and rescued.is_dir()
        done = cli("export", out, "--checkpoint", rescued, "-o", tmp_path / "rescued.onnx", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert cli("run", out, *common, "--steps", 3, "--export", tmp_path / "direct.onnx", cwd=tmp_path).returncode == 0
        assert (tmp_path / "rescued.onnx").read_bytes() == (tmp_path / "direct.onnx").read_bytes()
        (disk / "filler").unlink()

        # --timings onto a full disk: one line, no part files left.
        fill(disk, 0)
        done = cli("run", out, *common, "--steps", 3, "--timings", disk / "t.json", cwd=tmp_path)
        one_error_line(done, f"--timings {disk / 't.json'}", "No space left on device (ENOSPC)")
        assert not list(disk.glob("t.json*"))


@pytest.mark.parametrize("shape", [(100, 10), (4, 512)])
def test_a_short_raw_data_initializer_is_one_line(tmp_path, shape):
    from onnx import TensorProto, helper

    w = numpy_helper.from_array(np.ones(shape, np.float32), "w")
    w.raw_data = w.raw_data[:100]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("ReduceMean", ["h"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", shape[0]])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    (tmp_path / "m.onnx").write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    done = cli(tmp_path / "m.onnx", "--gpus", 2, "-o", tmp_path / "out", cwd=tmp_path)
    one_error_line(done, "m.onnx: initializer 'w' holds 100 bytes of raw_data", f"needs {4 * shape[0] * shape[1]}")
    assert not (tmp_path / "out").exists()


def ranks_alive(marker: str) -> list[str]:
    listed = subprocess.run(["ps", "-ww", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in listed if marker in line and "ps -eo" not in line and " Z" not in line]


def start_long_run(job, tmp_path, *extra):
    """A long 2-rank run whose rank processes carry ``tmp_path`` in their command line (through
    TMPDIR: the run configuration lives in a temporary directory)."""
    _, out, _, common = job
    marker = tmp_path / "tmp"
    marker.mkdir()
    env = {**ENV, "TMPDIR": str(marker)}
    proc = subprocess.Popen([sys.executable, "-m", "commands", "run", str(out), *map(str, common), "--steps", "100000000",
                             *map(str, extra)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path)
    deadline = time.monotonic() + 60

    def training() -> bool:  # both ranks train (their heartbeats say so)
        beats = list(marker.glob("transpile-run.*/rank*.beat"))
        with contextlib.suppress(OSError):
            return len(beats) == 2 and all(b.read_text().split()[2:] == ["step"] for b in beats)
        return False

    while not training():
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.terminate()  # transpile run kills its ranks on SIGTERM
            raise AssertionError(f"the run did not start training: {proc.communicate(timeout=30)}")
        time.sleep(0.2)
    return proc, str(marker)


@pytest.fixture
def stop_runs():
    """Whatever a failing test left running is stopped (SIGTERM to transpile run stops its ranks)."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


def rank_pids(marker: str) -> list[int]:
    return [int(line.split()[0]) for line in ranks_alive(marker) if "runtime.worker" in line and "mpiexec" not in line]


def wait_gone(marker: str, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while (left := ranks_alive(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_no_rank_outlives_a_killed_transpile_run(job, tmp_path, stop_runs, sig):
    proc, marker = start_long_run(job, tmp_path)
    stop_runs.append(proc)
    proc.send_signal(sig)
    proc.communicate(timeout=30)
    assert wait_gone(marker, 10) == []  # mpiexec and every rank, within 10 s


def test_a_stopped_rank_times_out_naming_it(job, tmp_path, stop_runs):
    proc, marker = start_long_run(job, tmp_path, "--timeout", 5)
    stop_runs.append(proc)
    victim = max(rank_pids(marker))
    began = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    assert time.monotonic() - began < 30
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("transpile: error: rank "), err
    assert "collective timeout: no progress for 5 s" in lines[0] and f"(pid {victim}) did not arrive" in lines[0]
    # The rank that waits names the collective it waits in.
    assert re.search(r"in (AllReduce|Reduce|Broadcast|ReduceScatter|AllGather) '[^']+' \(order \d+\) of step \d+", lines[0]), lines[0]
    assert wait_gone(marker, 10) == []


def test_a_killed_rank_is_named_in_one_line(job, tmp_path, stop_runs):
    proc, marker = start_long_run(job, tmp_path)
    stop_runs.append(proc)
    victim = max(rank_pids(marker))
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err
    assert err.strip().splitlines() == [f"transpile: error: rank 1 (pid {victim} on {os.uname().nodename}) was killed by "
                                        "signal 9 (SIGKILL); the other ranks were stopped"], err
    assert "BAD TERMINATION" not in out + err
    assert wait_gone(marker, 10) == []


def test_ranks_that_disagree_are_refused_naming_the_field(job, tmp_path):
    """Under an outside launcher (mpiexec -n 1 A : -n 1 B) each rank resolves its own command line."""
    sys.path.insert(0, ENV["PYTHONPATH"])
    from runtime.launcher import find_mpiexec

    _, out, data, _ = job
    other = tmp_path / "other"
    assert cli(out / "model.onnx", "--gpus", 2, "--lr", 0.5, "-o", other, cwd=tmp_path).returncode == 0
    mpiexec = find_mpiexec()

    def rank(out_dir, *extra):
        return [sys.executable, "-m", "commands", "run", str(out_dir), "--data", str(data), "--batch", "32", "--steps", "5",
                "--log-every", "0", *map(str, extra)]

    for a, b, fragments in (
            (rank(out), rank(other), ["lr (rank 0: 0.01; rank 1: 0.5)", "plan (rank 0: "]),
            (rank(out), rank(out, "--steps", 7), ["steps (rank 0: 5; rank 1: 7)"]),
    ):
        began = time.monotonic()
        done = subprocess.run([mpiexec, "-n", "1", *a, ":", "-n", "1", *b], capture_output=True, text=True, cwd=tmp_path,
                              env=ENV, timeout=120)
        one_error_line(done, "the ranks disagree on", *fragments)
        assert time.monotonic() - began < 60



@pytest.mark.parametrize("model, name, where, value, fragment", [
    ("cnn", "labels", (5,), -1, "outside [0, 10) or ignore_index -100 (SoftmaxCrossEntropyLoss"),
    ("cnn", "labels", (9,), 10, "outside [0, 10)"),
    ("gpt", "targets", (3, 7), -3, "or ignore_index -100 (SoftmaxCrossEntropyLoss"),
    ("gpt", "tokens", (2, 1), 10**6, "(Gather '/wte/Gather' of 'wte.weight')"),
])
def test_out_of_range_ids_are_refused_naming_file_input_and_row(model_dir, tmp_path, model, name, where, value,
                                                                fragment):
    src = model_dir(model)
    assert cli(src / "model.onnx", "--gpus", 2, "-o", tmp_path / "out", cwd=tmp_path).returncode == 0
    with np.load(src / "data.npz") as npz:
        arrays = {k: npz[k].copy() for k in npz.files}
    arrays[name][where] = value
    np.savez(tmp_path / "bad.npz", **arrays)
    done = cli("run", tmp_path / "out", "--data", tmp_path / "bad.npz", "--batch", 8, "--steps", 1, cwd=tmp_path)
    one_error_line(done, f"bad.npz: input '{name}' row {where[0]} holds {value}", fragment)
    assert "step 1/" not in done.stdout
    # ignore_index itself is allowed.
    if name != "tokens":
        arrays[name][where] = -100
        np.savez(tmp_path / "ok.npz", **arrays)
        ok = cli("run", tmp_path / "out", "--data", tmp_path / "ok.npz", "--batch", 8, "--steps", 1, "--log-every", 0,
                 cwd=tmp_path)
        assert ok.returncode == 0, ok.stderr


# SIGKILL of the transpile right after it creates OUT's temporary (a sitecustomize.py on its path):
# the temporary lives only a fraction of a second, too short to catch by polling on a loaded host.
KILL_AFTER_TEMPORARY = """
import os
import pathlib
import signal

mkdir = pathlib.Path.mkdir


def mkdir_then_die(self, *args, **kwargs):
    mkdir(self, *args, **kwargs)
    if self.name.startswith(".out.tmp-"):
        os.kill(os.getpid(), signal.SIGKILL)


pathlib.Path.mkdir = mkdir_then_die
"""


def test_a_killed_transpile_leaves_a_temporary_that_the_next_one_removes(model_dir, tmp_path_factory):
    src = model_dir("gpt")
    tmp_path = tmp_path_factory.mktemp("transpile")
    out = tmp_path / "out"
    hook = tmp_path_factory.mktemp("hook")
    (hook / "sitecustomize.py").write_text(KILL_AFTER_TEMPORARY)
    killed = subprocess.run([sys.executable, "-m", "commands", str(src / "model.onnx"), "--gpus", "2", "-o", str(out)],
                            capture_output=True, cwd=tmp_path, timeout=120,
                            env={**ENV, "PYTHONPATH": f"{hook}{os.pathsep}{ENV['PYTHONPATH']}"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert list(tmp_path.glob(".out.tmp-*")) and not out.exists()
    # Someone else's live temporary (this test's pid) is left alone.
    (tmp_path / f".out.tmp-{os.getpid()}-abcdef012345").mkdir()
    done = cli(src / "model.onnx", "--gpus", 2, "-o", out, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".out.tmp-{os.getpid()}-abcdef012345", "out"]


@pytest.mark.parametrize("strategy", ["sharded", "zero", "allreduce"])
def test_transpile_export_writes_a_checkpoints_model(job, tmp_path, strategy):
    _, out, data, common = job
    mine = tmp_path / "out"
    assert cli(out / "model.onnx", "--gpus", 2, "--strategy", strategy, "--optimizer", "adam", "-o", mine,
               cwd=tmp_path).returncode == 0
    done = cli("run", mine, *common, "--steps", 4, "--checkpoint", tmp_path / "ck", "--checkpoint-every", 2,
               "--export", tmp_path / "a.onnx", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = cli("export", mine, "--checkpoint", tmp_path / "ck", "-o", tmp_path / "b.onnx", cwd=tmp_path)
    assert done.returncode == 0 and "checkpoint-4 (step 4)" in done.stdout, done.stderr
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    done = cli("export", mine, "--checkpoint", tmp_path / "ck" / "checkpoint-2", "-o", tmp_path / "c.onnx", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # Another plan of the same model (another strategy and optimizer) reads its parameters by name:
    # the same file (another model is refused: tests/test_checkpoint_resize.py).
    done = cli("export", out, "--checkpoint", tmp_path / "ck", "-o", tmp_path / "d.onnx", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "d.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()


def test_an_invalid_timeout_under_an_outside_launcher_is_one_line(job, tmp_path):
    """Each rank needs its --timeout before it joins the others (its watchdog, a torchrun bootstrap's
    wait): an invalid one is still refused once, through the ranks' agreement on setup errors."""
    sys.path.insert(0, ENV["PYTHONPATH"])
    from runtime.launcher import find_mpiexec

    _, out, _, common = job
    done = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, "-m", "commands", "run", str(out),
                           *map(str, common), "--steps", "1", "--timeout", "-1"], capture_output=True, text=True,
                          cwd=tmp_path, env=ENV, timeout=120)
    one_error_line(done, "--timeout must be a positive number of seconds, got -1")


def test_a_stopped_rank_under_an_outside_launcher_times_out(job, tmp_path):
    """mpiexec -n 2 transpile run ...: no parent of ours, no heartbeat directory; the watchdog still
    ends the job (MPI_Abort) in bounded time with its one line."""
    sys.path.insert(0, ENV["PYTHONPATH"])
    from runtime.launcher import find_mpiexec

    _, out, data, _ = job
    mine = tmp_path / "marker-data.npz"
    shutil.copy(data, mine)
    proc = subprocess.Popen([find_mpiexec(), "-n", "2", sys.executable, "-m", "commands", "run", str(out), "--data",
                             str(mine), "--batch", "32", "--log-every", "0", "--steps", "100000000", "--timeout", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while len(pids := [int(line.split()[0]) for line in ranks_alive(str(mine))
                           if "commands run" in line and "mpiexec" not in line]) < 2:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        time.sleep(3)  # training
        began = time.monotonic()
        os.kill(max(pids), signal.SIGSTOP)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - began < 30
        assert proc.returncode != 0
        assert "transpile: error: rank 0: collective timeout: no progress for 5 s" in err, err
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
