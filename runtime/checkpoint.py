"""Checkpoints: every rank's state (parameters, buffers, optimizer state, step counter) after a step.

``--checkpoint DIR`` is a store of checkpoints, one directory per saved step::

    DIR/.lock                       flock'ed by the run that writes DIR: a second run is refused
    DIR/checkpoint-<step>/
        rank{r}.npz                 rank r's state, keyed by its graph's state input names, plus the
                                    step it belongs to (sharded and zero strategies keep different
                                    optimizer state on each rank, so every rank writes its own, in
                                    parallel)
        meta.json                   the manifest, written last: format, step, the plan's hash and
                                    world size, batch, shuffle, seed, the data position (samples),
                                    the learning-rate schedule (lr, schedule, steps), each rank
                                    file's size and sha256, and the state by name (tensors, model)

A checkpoint is written into ``DIR/.partial-<step>/`` and published by ONE atomic rename to
``DIR/checkpoint-<step>`` once every rank's file and the manifest are on disk; only then are older
checkpoints beyond ``--keep-last K`` (and stale partial directories) removed. So at every
instant the store holds its previous complete checkpoints: a crash at any point of a save loses at
most the checkpoint being written. A ``.partial-<step>`` whose manifest is on disk is complete too
(the crash came just before the rename): resume accepts it.

Resuming (``--resume latest`` with ``--checkpoint DIR``, ``--resume DIR`` or ``--resume
DIR/checkpoint-<step>``; runtime/resume.py) takes the newest complete checkpoint, skips incomplete
or corrupt ones (a rank file missing, of another size or hash than the manifest says, or from
another step) with a one-line warning each, and needs the same data order and learning-rate
schedule (unless ``--override-schedule``). On the plan that wrote it each rank loads its own file
as is: the run goes on exactly as if it had not stopped. Any other plan of the same model (another
world size, strategy, --gpus count) reads it by name, whole, and cuts its own share
(runtime/reshard.py): the manifest's ``tensors`` says where every parameter, buffer and optimizer
slot lies in the rank files, its ``model`` what must match (parameters, optimizer, precision;
anything else is refused in one line). The data position is kept in samples: a run resumed with
another global batch reads on from position ``samples`` of the same data stream, and its step
counter and schedule go on from the checkpoint's step (docs/reliability.md). Ranks on several
hosts need DIR on a shared file system.
"""

from __future__ import annotations

import contextlib
import errno as errno_module
import fcntl
import hashlib
import json
import os
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.collectives import Communicator
from runtime.errors import AgreedError, PeerFailed, RunError, os_error_text
from runtime.plan import Plan

FORMAT = "graph-transpiler/checkpoint"
# 3: the manifest records the data position (samples), the state by name (tensors) and the model
# it belongs to (runtime/reshard.py), so another plan (world size, strategy) can resume it.
FORMAT_VERSION = 3
PREFIX = "checkpoint-"
PARTIAL = ".partial-"
REPLACED = ".replaced-"
LOCK = ".lock"
STEP_KEY = "__checkpoint_step__"  # in every rank file: the step it holds
_NAME = re.compile(rf"^(?:{re.escape(PREFIX)}|{re.escape(PARTIAL)})(\d+)$")


@dataclass(frozen=True)
class Meta:
    step: int  # steps completed
    plan_sha256: str
    world_size: int
    batch: int
    shuffle: bool
    seed: int
    # The learning-rate schedule of the run that wrote it (None in format 1 checkpoints).
    lr: float | None = None
    schedule: dict | None = None
    steps: int | None = None
    files: dict = field(default_factory=dict)  # "rank{r}.npz" -> {"bytes": n, "sha256": hex}
    # Format 3 (None in older checkpoints): the data positions consumed (the samples read so far:
    # step * batch unless a resume changed the batch), and runtime/reshard.py's index of the state
    # by name and summary of the model.
    samples: int | None = None
    tensors: dict | None = None
    model: dict | None = None

    def to_json(self) -> dict:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, **self.__dict__}


def rank_file(rank: int) -> str:
    """The file of rank ``rank``'s state in a checkpoint directory."""
    return f"rank{rank}.npz"


def plan_hash(plan: Plan) -> str:
    """plan.json's hash without what says where it was written (``source_model.path``, the model's
    absolute path when transpiled): OUTs transpiled from one model with the same options on two
    hosts, or from two directories, are the same plan (for the ranks' agreement and for --resume)."""
    raw = json.loads(plan.path.read_text())
    raw.get("source_model", {}).pop("path", None)
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


def samples_done(meta: Meta) -> int:
    """The data positions a checkpoint's run consumed: where the data stream goes on."""
    return meta.samples if meta.samples is not None else meta.step * meta.batch


def same_plan(meta: Meta, plan: Plan) -> bool:
    """Whether ``plan`` wrote the checkpoint: then each rank resumes from its own file, as is."""
    # Checkpoints saved before plan_hash left the path out hold the hash of plan.json's bytes.
    return meta.world_size == plan.world_size and meta.plan_sha256 in (
        plan_hash(plan), hashlib.sha256(plan.path.read_bytes()).hexdigest())


def _is_store(directory: Path) -> bool:
    return any(_NAME.match(p.name) or p.name == LOCK for p in directory.iterdir())


def check_target(directory: Path) -> Path:
    """The resolved --checkpoint DIR, or a RunError if saving there would destroy something else:
    DIR must be new, empty or a checkpoint store (it holds checkpoint-<step>/ directories)."""
    directory = directory.resolve()
    blocker = next((a for a in (directory, *directory.parents) if a.exists()), None)
    if blocker is not None and not blocker.is_dir():
        what = "exists and is not a directory" if blocker == directory else f"{blocker} is a file, not a directory"
        raise RunError(f"--checkpoint {directory}: {what}")
    if directory.is_dir() and any(directory.iterdir()) and not _is_store(directory):
        if (directory / "meta.json").is_file():
            raise RunError(f"--checkpoint {directory}: a single checkpoint of the old layout; resume from it with "
                           "--resume and give a new --checkpoint directory")
        raise RunError(f"--checkpoint {directory}: a non-empty directory that is not a checkpoint store (no "
                       f"{PREFIX}<step>/); give a new or empty directory")
    return directory


class Lock:
    """An exclusive flock on DIR/.lock for the life of a run: a second run on DIR is refused.
    The kernel drops it when the holder dies, however it dies."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RunError(f"--checkpoint {directory}: cannot create {self.path}: {os_error_text(exc)}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip()
            os.close(self.fd)
            if exc.errno in (errno_module.EWOULDBLOCK, errno_module.EAGAIN):
                who = f" (pid {holder})" if holder else ""
                raise RunError(f"--checkpoint {directory}: in use by another run{who}; wait for it to end or give "
                               "another directory") from None
            raise RunError(f"--checkpoint {directory}: cannot lock {self.path}: {os_error_text(exc)}") from None
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the flock
            self.fd = -1


def agree(comm: Communicator, error: str | None) -> None:
    """Every rank learns which ranks failed (one host allreduce); the lowest failing rank raises its
    own message, the others PeerFailed (they say nothing: one line for the user, not one per rank)."""
    flags = [0.0] * comm.size
    flags[comm.rank] = 1.0 if error else 0.0
    flags = comm.allreduce_scalars(flags, "sum")
    if not any(flags):
        return
    if error and comm.rank == next(r for r, f in enumerate(flags) if f):
        raise AgreedError(error)
    raise PeerFailed("another rank failed")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the published checkpoints in a store, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name)) and p.name.startswith(PREFIX)]
    return sorted(found)


def save(directory: Path, state: dict[str, np.ndarray], meta: Meta, *, rank: int, comm: Communicator,
         keep: int = 2) -> Path:
    """Every rank calls this at the same step (it holds three host agreements). Returns the
    published checkpoint directory. On an I/O error on any rank the partial files are removed, the
    previous checkpoints stay, and the rank that failed raises a one-line RunError naming the path."""
    step = meta.step
    partial = directory / f"{PARTIAL}{step}"
    final = directory / f"{PREFIX}{step}"
    newest = complete_checkpoints(directory)
    kept = f"{newest[-1][1]} is the newest complete checkpoint" if newest else "no earlier checkpoint exists"
    error = None
    if rank == 0:
        try:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        except OSError as exc:
            error = f"checkpoint {partial}: {os_error_text(exc)}; {kept}"
    agree(comm, error)
    mine = partial / rank_file(rank)
    try:
        with open(mine, "wb") as f:
            np.savez(f, **state, **{STEP_KEY: np.array(step, dtype=np.int64)})
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        with contextlib.suppress(OSError):
            mine.unlink()
        error = f"checkpoint {mine}: {os_error_text(exc)}; partial files removed, {kept}"
    try:
        agree(comm, error)
    except RunError:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if rank == 0:
        try:
            files = {}
            for r in range(comm.size):
                path = partial / rank_file(r)
                files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
            manifest = Meta(**{**meta.__dict__, "files": files})
            tmp = partial / "meta.json.tmp"
            with open(tmp, "w") as f:
                f.write(json.dumps(manifest.to_json(), indent=1) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, partial / "meta.json")
            _fsync_directory(partial)  # the rank files' and the manifest's names are on disk before the publish
            if final.exists():  # the same step saved again (a resumed run): never delete before publishing
                replaced = directory / f"{REPLACED}{step}"
                shutil.rmtree(replaced, ignore_errors=True)
                os.replace(final, replaced)
            os.replace(partial, final)
            _fsync_directory(directory)  # the publish itself survives a power loss
            _prune(directory, keep)
        except OSError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            where = exc.filename or partial
            error = f"checkpoint {where}: {os_error_text(exc)}; partial files removed, {kept}"
    agree(comm, error)
    return final


def _fsync_directory(directory: Path) -> None:
    """fsync a directory: the entries renamed or created in it are durable (power loss)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno_module.EINVAL, errno_module.ENOTSUP):  # a file system without directory fsync
            raise
    finally:
        os.close(fd)


def _prune(directory: Path, keep: int) -> None:
    """Only after a newer checkpoint is complete: drop all but the ``keep`` newest, and leftovers.
    Only the store's own directories: an entry that is a symlink is never followed or removed."""
    complete = [(step, path) for step, path in complete_checkpoints(directory) if not path.is_symlink()]
    for _, path in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
    for path in directory.iterdir():
        if path.name.startswith((PARTIAL, REPLACED)) and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


def _parse_meta(directory: Path) -> Meta:
    path = directory / "meta.json"
    if not path.is_file():
        raise RunError(f"{directory}: not a checkpoint (no meta.json)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunError(f"{path}: not valid JSON ({exc})".splitlines()[0]) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise RunError(f"{path}: not a graph-transpiler checkpoint")
    required = ("step", "plan_sha256", "world_size", "batch", "shuffle", "seed")
    missing = [k for k in required if k not in raw]
    if missing:
        raise RunError(f"{path}: incomplete checkpoint metadata (missing {', '.join(missing)})")
    meta = Meta(**{k: raw[k] for k in Meta.__dataclass_fields__ if k in raw})
    types = {"step": int, "plan_sha256": str, "world_size": int, "batch": int, "shuffle": bool, "seed": int}
    for key, kind in types.items():
        value = getattr(meta, key)
        if type(value) is not kind or (kind is int and value < 0):
            raise RunError(f"{path}: '{key}' is {value!r}, expected {'a non-negative integer' if kind is int else kind.__name__}")
    if not isinstance(meta.files, dict):
        raise RunError(f"{path}: 'files' is not a mapping")
    if meta.samples is not None and (type(meta.samples) is not int or meta.samples < 0):
        raise RunError(f"{path}: 'samples' is {meta.samples!r}, expected a non-negative integer")
    for key in ("tensors", "model"):
        value = getattr(meta, key)
        if value is not None and not (isinstance(value, dict) and all(isinstance(v, (dict, list, str)) or v is None
                                                                     for v in value.values())):
            raise RunError(f"{path}: '{key}' is not a mapping")
    return meta


def check_files(directory: Path, meta: Meta) -> None:
    """Every rank file is there, with the size and hash the manifest records."""
    for rank in range(meta.world_size):
        path = directory / rank_file(rank)
        if not path.is_file():
            raise RunError(f"{path} is missing")
        want = meta.files.get(path.name)
        if want is None:
            if meta.files:
                raise RunError(f"{path} is not in the manifest")
            continue  # format 1: no manifest of files
        if path.stat().st_size != want.get("bytes") or _sha256(path) != want.get("sha256"):
            raise RunError(f"{path} does not match the manifest (size or sha256 differ: copied in from another "
                           "checkpoint, or damaged)")


def candidates(path: Path) -> list[Path]:
    """Checkpoint directories to try, newest first: PATH itself if it is one, else the store's."""
    if (path / "meta.json").is_file():
        return [path]
    if not path.is_dir():
        return []
    found = [(int(m.group(1)), p.name.startswith(PREFIX), p) for p in path.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, _, p in sorted(found, reverse=True)]


def read_meta(directory: Path) -> Meta:
    """The manifest of a checkpoint directory (the one ``find_resume`` chose)."""
    return _parse_meta(directory)


def load(directory: Path, rank: int, step: int | None = None) -> dict[str, np.ndarray]:
    path = directory / rank_file(rank)
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise RunError(f"--resume {path}: unreadable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                       "the checkpoint is damaged") from None
    saved = arrays.pop(STEP_KEY, None)
    if step is not None and saved is not None and int(saved) != step:
        raise RunError(f"--resume {path}: holds the state of step {int(saved)}, the checkpoint is at step {step} "
                       "(a rank file copied in from another checkpoint)")
    return arrays
