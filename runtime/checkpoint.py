"""Checkpoints: every rank's state (parameters, buffers, optimizer state, step counter) after a step.

    DIR/meta.json      format, the step reached, the plan's hash and world size, batch, shuffle, seed
    DIR/rank{r}.npz    rank r's state, keyed by state input name (sharded and zero strategies keep
                       different optimizer state on each rank, so every rank writes its own)

A checkpoint is written into ``DIR.partial`` and swapped into place by rank 0 once every rank has
written its file, so DIR is always a complete checkpoint (the previous one until the swap). Ranks
on several hosts need DIR on a shared file system. Resuming needs the same plan (same transpile),
world size and global batch, and continues the same data stream: the run goes on exactly as if it
had not stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.collectives import Communicator
from runtime.errors import RunError
from runtime.plan import Plan

FORMAT = "graph-transpiler/checkpoint"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Meta:
    step: int  # steps completed
    plan_sha256: str
    world_size: int
    batch: int
    shuffle: bool
    seed: int

    def to_json(self) -> dict:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, **self.__dict__}


def plan_hash(plan: Plan) -> str:
    return hashlib.sha256(plan.path.read_bytes()).hexdigest()


def check_target(directory: Path) -> Path:
    """The resolved --checkpoint DIR, or a RunError if saving there would destroy something else:
    DIR is replaced as a whole, so it must be new, empty or an earlier checkpoint (meta.json)."""
    directory = directory.resolve()
    blocker = next((a for a in (directory, *directory.parents) if a.exists()), None)
    if blocker is not None and not blocker.is_dir():
        what = "exists and is not a directory" if blocker == directory else f"{blocker} is a file, not a directory"
        raise RunError(f"--checkpoint {directory}: {what}")
    if directory.is_dir() and not (directory / "meta.json").is_file() and any(directory.iterdir()):
        raise RunError(f"--checkpoint {directory}: a non-empty directory that is not a checkpoint (no meta.json); "
                       "it is replaced as a whole, so give a new or empty directory")
    return directory


def save(directory: Path, state: dict[str, np.ndarray], meta: Meta, *, rank: int, comm: Communicator) -> None:
    """Every rank calls this at the same step (it holds two barriers)."""
    partial = directory.with_name(directory.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    comm.barrier()
    np.savez(partial / f"rank{rank}.npz", **state)
    comm.barrier()
    if rank == 0:
        (partial / "meta.json").write_text(json.dumps(meta.to_json(), indent=1) + "\n")
        old = directory.with_name(directory.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if directory.exists():
            os.replace(directory, old)
        os.replace(partial, directory)
        shutil.rmtree(old, ignore_errors=True)


def read_meta(directory: Path, plan: Plan, *, batch: int, shuffle: bool, seed: int) -> Meta:
    """The checkpoint's metadata, checked against this run; one-line errors name what differs."""
    path = directory / "meta.json"
    if not path.is_file():
        raise RunError(f"--resume {directory}: not a checkpoint (no meta.json)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RunError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise RunError(f"{path}: not a graph-transpiler checkpoint")
    missing = [k for k in Meta.__dataclass_fields__ if k not in raw]
    if missing:
        raise RunError(f"{path}: incomplete checkpoint metadata (missing {', '.join(missing)})")
    meta = Meta(**{k: raw[k] for k in Meta.__dataclass_fields__})
    types = {"step": int, "plan_sha256": str, "world_size": int, "batch": int, "shuffle": bool, "seed": int}
    for key, kind in types.items():
        value = getattr(meta, key)
        if type(value) is not kind or (kind is int and value < 0):
            raise RunError(f"{path}: '{key}' is {value!r}, expected {'a non-negative integer' if kind is int else kind.__name__}")
    if meta.plan_sha256 != plan_hash(plan) or meta.world_size != plan.world_size:
        raise RunError(f"--resume {directory}: the checkpoint was written for another plan than {plan.path}"
                       " (transpile again with the same model and options, or start without --resume)")
    if (meta.batch, meta.shuffle, meta.seed if meta.shuffle else 0) != (batch, shuffle, seed if shuffle else 0):
        def order(b: int, shuffled: bool, s: int) -> str:
            return f"--batch {b}" + (f" --shuffle --seed {s}" if shuffled else " without --shuffle")

        raise RunError(f"--resume {directory}: the checkpoint was written with {order(meta.batch, meta.shuffle, meta.seed)}, "
                       f"this run has {order(batch, shuffle, seed)}; resume with the same data order")
    for rank in range(meta.world_size):
        if not (directory / f"rank{rank}.npz").is_file():
            raise RunError(f"--resume {directory}: rank{rank}.npz is missing")
    return meta


def load(directory: Path, rank: int) -> dict[str, np.ndarray]:
    path = directory / f"rank{rank}.npz"
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise RunError(f"--resume {path}: unreadable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                       "the checkpoint is damaged") from None
