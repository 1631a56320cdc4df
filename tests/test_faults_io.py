"""Faults, third wave (issue 27): I/O errors of ``transpile`` and ``transpile run`` are one line
naming the path (nothing half-written), the rescue checkpoint is out of other users' reach, stale
run directories are swept, a non-finite checkpoint is not resumed, and a checkpoint's publish is
fsync'ed. Full and read-only file systems are real tmpfs mounts (needs root; skipped otherwise)."""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import refresh_manifest
from test_faults import ENV, cli, fill, one_error_line, ranks_alive, small_tmpfs

from runtime import checkpoint
from runtime.cli import OWNER_FILE, RUN_DIR_PREFIX, sweep_run_directories
from runtime.collectives import LocalGroup

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def job(model_dir, tmp_path_factory):
    src = model_dir("perceptron")
    root = tmp_path_factory.mktemp("faults-io")
    assert cli(src / "model.onnx", "--gpus", 2, "-o", root / "out", cwd=root).returncode == 0
    return root / "out", src, ["--data", src / "data.npz", "--batch", 32, "--log-every", 0]




def tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_transpile_onto_a_read_only_or_full_file_system_is_one_line(job, tmp_path):
    _, src, _ = job
    model = src / "model.onnx"
    with small_tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        done = cli(model, "--gpus", 2, "-o", ro / "out", cwd=tmp_path)
        one_error_line(done, f"-o {ro / 'out'}: cannot write {ro / 'out'}", "Read-only file system (EROFS)",
                       "nothing was written")
        assert list(ro.iterdir()) == []
        done = cli(model, "--gpus", 2, "-o", ro / "sub" / "out", cwd=tmp_path)
        one_error_line(done, f"cannot create {ro / 'sub'}", "Read-only file system (EROFS)")
    with small_tmpfs(tmp_path / "full", "1m") as full:
        assert cli(model, "--gpus", 2, "-o", full / "out", cwd=tmp_path).returncode == 0
        before = tree(full / "out")
        fill(full, 4096)
        done = cli(model, "--gpus", 2, "--strategy", "allreduce", "-o", full / "out", cwd=tmp_path)
        line = one_error_line(done, f"-o {full / 'out'}: cannot write {full / 'out'}", "No space left on device (ENOSPC)",
                              "nothing was written; the earlier OUT is unchanged")
        assert ".tmp-" not in line  # the path as it would be in OUT
        assert sorted(p.name for p in full.iterdir()) == ["filler", "out"]  # no temporary left
        assert tree(full / "out") == before


def test_transpile_run_onto_a_read_only_file_system_is_one_line(job, tmp_path):
    out, _, common = job
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        assert cli("run", out, *common, "--steps", 2, "--checkpoint", disk / "ck", cwd=tmp_path).returncode == 0
        before = tree(disk)
        assert subprocess.run(["mount", "-o", "remount,ro", str(disk)]).returncode == 0
        done = cli("run", out, *common, "--steps", 4, "--checkpoint", disk / "ck", "--resume", "latest", cwd=tmp_path)
        one_error_line(done, f"--checkpoint {disk / 'ck'}: cannot create {disk / 'ck' / '.lock'}",
                       "Read-only file system (EROFS)")
        done = cli("run", out, *common, "--steps", 2, "--checkpoint", disk / "ck2", cwd=tmp_path)
        one_error_line(done, f"--checkpoint {disk / 'ck2'}", "Read-only file system (EROFS)")
        assert tree(disk) == before


def test_an_io_error_of_transpile_run_itself_is_one_line(tmp_path, capsys, monkeypatch):
    """Whatever OSError reaches transpile run (here: its run directory on a full /tmp) is one line."""
    import errno

    from test_runtime_launcher import _clean_env
    from test_runtime_outdir import make_data, write_out

    from runtime import cli as run_cli

    _clean_env(monkeypatch)
    out = write_out(tmp_path / "out", 2, "allreduce")
    np.savez(tmp_path / "d.npz", **make_data())

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/tmp/transpile-run.abc")

    monkeypatch.setattr(run_cli.tempfile, "TemporaryDirectory", full)
    assert run_cli.main(["run", str(out), "--data", str(tmp_path / "d.npz"), "--batch", "4", "--steps", "1",
                         "--backend", "cpu"]) == 2
    assert capsys.readouterr().err == ("transpile: error: /tmp/transpile-run.abc: No space left on device (ENOSPC)\n")


def old_rescue_path(temp: Path, out: Path, export: Path, steps: int) -> Path:
    """Where the runtime used to put the rescue checkpoint: a name anyone could compute from ps."""
    key = hashlib.sha256(f"{out.resolve()}|{export.resolve()}|{steps}".encode()).hexdigest()[:12]
    return temp / f"transpile-rescue-{key}"


@pytest.mark.parametrize("attack", ["symlink", "directory"])
def test_the_rescue_checkpoint_cannot_be_aimed_by_another_user(job, tmp_path, attack):
    """Another user plants a symlink to the victim's checkpoint store (or a directory of theirs) at
    the rescue path the runtime used to compute; --export fails onto a full disk. The rescue goes
    into a new private directory; the victim's checkpoints and the planted directory are untouched."""
    out, _, common = job
    victim = tmp_path / "victim-ck"
    assert cli("run", out, *common, "--steps", 10, "--checkpoint", victim, "--checkpoint-every", 5, cwd=tmp_path
               ).returncode == 0
    kept = tree(victim)
    assert {"checkpoint-5", "checkpoint-10"} <= set(kept)
    shared = tmp_path / "shared-tmp"  # a /tmp: world-writable, sticky
    shared.mkdir()
    shared.chmod(0o1777)
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        export = disk / "trained.onnx"
        planted = old_rescue_path(shared, out, export, 3)
        if attack == "symlink":
            planted.symlink_to(victim)
        else:
            planted.mkdir()
            planted.chmod(0o777)
        fill(disk, 4096)
        done = cli("run", out, *common, "--steps", 3, "--export", export, cwd=tmp_path, env={**ENV, "TMPDIR": str(shared)})
        line = one_error_line(done, f"--export {export}: No space left on device (ENOSPC)", "transpile export")
    rescued = Path(line.split("the trained state is in ")[1].split(":")[0])
    store = rescued.parent
    assert rescued.name == "checkpoint-3" and store.parent == shared and store != planted
    info = store.lstat()
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700
    assert tree(victim) == kept  # checkpoint-5 and checkpoint-10, byte for byte
    if attack == "directory":
        assert list(planted.iterdir()) == []
    done = cli("export", out, "--checkpoint", rescued, "-o", tmp_path / "rescued.onnx", cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_pruning_never_follows_a_symlink_in_the_store(tmp_path):
    """A checkpoint-<step> entry that is a symlink (planted, or the user's) is neither followed nor removed."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "checkpoint-1").mkdir(parents=True)
    (elsewhere / "checkpoint-1" / "rank0.npz").write_bytes(b"precious")
    store = tmp_path / "store"
    store.mkdir()
    (store / "checkpoint-1").symlink_to(elsewhere / "checkpoint-1")
    (store / ".partial-2").symlink_to(elsewhere)
    meta = checkpoint.Meta(step=5, plan_sha256="0" * 64, world_size=1, batch=1, shuffle=False, seed=0)
    checkpoint.save(store, {"w": np.ones(2, np.float32)}, meta, rank=0, comm=LocalGroup(1).communicator(0), keep=1)
    assert (elsewhere / "checkpoint-1" / "rank0.npz").read_bytes() == b"precious"
    assert (store / "checkpoint-5" / "meta.json").is_file()


def test_the_publish_of_a_checkpoint_is_fsynced(tmp_path, monkeypatch):
    """The rename that publishes checkpoint-<step> is followed by an fsync of the store directory
    (and the partial directory is fsync'ed before it), so a power loss cannot undo it."""
    events = []
    replace, fsync = os.replace, os.fsync

    def record_replace(src, dst):
        replace(src, dst)
        events.append(("replace", Path(src).name, Path(dst).name))

    def record_fsync(fd):
        fsync(fd)
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    monkeypatch.setattr(os, "replace", record_replace)
    monkeypatch.setattr(os, "fsync", record_fsync)
    store = tmp_path / "store"
    meta = checkpoint.Meta(step=2, plan_sha256="0" * 64, world_size=1, batch=1, shuffle=False, seed=0)
    checkpoint.save(store, {"w": np.ones(2, np.float32)}, meta, rank=0, comm=LocalGroup(1).communicator(0))
    publish = events.index(("replace", ".partial-2", "checkpoint-2"))
    assert ("fsync", str(store / ".partial-2")) in events[:publish]
    assert ("fsync", str(store)) in events[publish:]


def test_a_non_finite_checkpoint_is_not_resumed(job, tmp_path):
    """A checkpoint holding NaN (an older version's, a damaged one) is refused at resume, in one
    line, instead of being resumed and later called the last good checkpoint."""
    out, _, common = job
    ck = tmp_path / "ck"
    assert cli("run", out, *common, "--steps", 2, "--checkpoint", ck, cwd=tmp_path).returncode == 0
    path = ck / "checkpoint-2" / "rank1.npz"
    with np.load(path) as npz:
        arrays = {k: npz[k].copy() for k in npz.files}
    name = next(k for k, a in arrays.items() if a.dtype.kind == "f" and a.size)
    arrays[name].flat[0] = np.nan
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    refresh_manifest(ck / "checkpoint-2")
    done = cli("run", out, *common, "--steps", 4, "--checkpoint", ck, "--resume", "latest", cwd=tmp_path)
    one_error_line(done, f"rank1.npz: '{name}' holds non-finite values; this checkpoint cannot be resumed")
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "checkpoint-2"]


def dead_token() -> str:
    """The token of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "import os; print(os.getpid())"], stdout=subprocess.PIPE, text=True)
    pid = int(child.communicate()[0])
    return f"{pid}:12345"


def test_stale_run_directories_are_swept(tmp_path):
    from runtime.guard import parent_token

    temp = tmp_path / "tmp"
    temp.mkdir()
    dead = temp / f"{RUN_DIR_PREFIX}dead"
    dead.mkdir()
    (dead / OWNER_FILE).write_text(dead_token())
    live = temp / f"{RUN_DIR_PREFIX}live"
    live.mkdir()
    (live / OWNER_FILE).write_text(parent_token())  # this process: still running
    young = temp / f"{RUN_DIR_PREFIX}young"  # no owner yet: a run that is starting
    young.mkdir()
    old = temp / f"{RUN_DIR_PREFIX}old"
    old.mkdir()
    os.utime(old, (time.time() - 3 * 86400,) * 2)
    target = tmp_path / "target"  # a symlink among them is never followed
    target.mkdir()
    (target / OWNER_FILE).write_text(dead_token())
    (temp / f"{RUN_DIR_PREFIX}link").symlink_to(target)
    sweep_run_directories(temp)
    assert sorted(p.name for p in temp.iterdir()) == [f"{RUN_DIR_PREFIX}link", f"{RUN_DIR_PREFIX}live",
                                                     f"{RUN_DIR_PREFIX}young"]
    assert (target / OWNER_FILE).is_file()


def test_the_run_directory_of_a_killed_transpile_run_is_swept_by_the_next(job, tmp_path):
    out, _, common = job
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**ENV, "TMPDIR": str(temp)}
    proc = subprocess.Popen([sys.executable, "-m", "commands", "run", str(out), *map(str, common), "--steps",
                             "100000000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while len(list(temp.glob(f"{RUN_DIR_PREFIX}*/rank*.beat"))) < 2:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while ranks_alive(str(temp)) and time.monotonic() < deadline:
            time.sleep(0.2)
        (stale,) = temp.glob(f"{RUN_DIR_PREFIX}*")  # kill -9 left it
        done = cli("run", out, *common, "--steps", 2, cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr
        assert not stale.exists() and not list(temp.glob(f"{RUN_DIR_PREFIX}*"))
    finally:
        if proc.poll() is None:
            proc.kill()
