"""Which checkpoint a run resumes from (or ``transpile export`` reads), and whether it may.

``find_resume`` takes PATH if it is a checkpoint, else the newest complete one of the store PATH
(runtime/checkpoint.py; incomplete or damaged ones are skipped with a warning each). The plan that
wrote it resumes it as is; another plan (another world size, strategy or --gpus count) of the same
model resumes it by name (runtime/reshard.py), and what differs otherwise (parameters, optimizer,
precision) is refused in one line naming it. The data order (--shuffle, --seed) must be the same:
the checkpoint's data position means nothing in another order. ``check_schedule`` compares the
learning-rate schedule (``--override-schedule`` skips it).
"""

from __future__ import annotations

import sys
from pathlib import Path

from runtime import checkpoint, reshard
from runtime.checkpoint import Meta
from runtime.errors import RunError, os_error_text
from runtime.plan import Plan


def find_resume(path: Path, plan: Plan, *, shuffle: bool, seed: int, warn=None, export: bool = False,
                option: str = "--resume") -> tuple[Path, Meta]:
    """The checkpoint to resume from: PATH if it is one, else the newest complete one of the store
    PATH (incomplete or corrupt ones are skipped with a warning each). It must be ``plan``'s, or one
    another plan of the same model and optimizer can read by name (runtime/reshard.py), with the
    same data order (``export``: only its parameters and buffers matter). The learning-rate
    schedule is ``check_schedule``'s."""
    warn = warn or (lambda line: print(f"transpile: warning: {line}", file=sys.stderr, flush=True))
    candidates = checkpoint.candidates(path)
    if not candidates:
        raise RunError(f"{option} {path}: not a checkpoint (no meta.json) and no complete {checkpoint.PREFIX}<step>/ in it")
    skipped: list[tuple[Path, str]] = []
    for directory in candidates:
        try:
            meta = checkpoint.read_meta(directory)
            checkpoint.check_files(directory, meta)
        except (RunError, OSError) as exc:
            reason = str(exc) if isinstance(exc, RunError) else f"{exc.filename or directory}: {os_error_text(exc)}"
            skipped.append((directory, reason))
            continue
        notes = _check_compatible(directory, meta, plan, export=export, option=option)
        if not export and (meta.shuffle, meta.seed if meta.shuffle else 0) != (shuffle, seed if shuffle else 0):
            def order(shuffled: bool, s: int) -> str:
                return f"--shuffle --seed {s}" if shuffled else "no --shuffle"

            raise RunError(f"{option} {directory}: the checkpoint was written with {order(meta.shuffle, meta.seed)}, "
                           f"this run has {order(shuffle, seed)}; its data position cannot be mapped to another data "
                           "order: resume with the same one")
        for other, reason in skipped:
            if not other.name.startswith(checkpoint.PARTIAL):  # an unfinished save is expected after a crash
                warn(f"{option}: skipped {other}, incomplete or damaged: {reason}")
        for line in notes:
            warn(line)
        return directory, meta
    newest = next((reason for other, reason in skipped if not other.name.startswith(checkpoint.PARTIAL)), skipped[0][1])
    if len(candidates) == 1:
        raise RunError(f"{option} {newest}")
    raise RunError(f"{option} {path}: no complete checkpoint among {len(candidates)} (the newest: {newest})")


def _check_compatible(directory: Path, meta: Meta, plan: Plan, *, export: bool, option: str) -> list[str]:
    """Refuse (one line) a checkpoint ``plan`` cannot resume or export; return warnings."""
    if checkpoint.same_plan(meta, plan):
        return []
    if meta.tensors is None or meta.model is None:
        raise RunError(f"{option} {directory}: the checkpoint was written by {meta.world_size} rank(s) of another plan "
                       f"than {plan.path}, before checkpoints recorded their state by name (format 2); resume it with "
                       "the OUT that wrote it")
    refusal, warnings = reshard.differences(meta.model, meta.tensors, plan, parameters_only=export)
    if refusal is not None:
        raise RunError(f"{option} {directory}: {refusal}")
    return [f"{option} {directory}: {line}" for line in warnings]


def check_schedule(directory: Path, meta: Meta, schedule: tuple) -> None:
    """``schedule`` is (lr, schedule dict, steps) of this run: the checkpoint's must be the same
    (``--override-schedule`` skips this), else a one-line RunError naming what differs."""
    if meta.lr is None:
        return  # format 1: not recorded
    lr, sched, steps = schedule
    differs = []
    if meta.lr != lr:
        differs.append(f"--lr {meta.lr:g} (this run: {lr:g})")
    theirs = meta.schedule or {}
    for key, value in sched.items():
        if key in theirs and theirs[key] != value:
            option = {"kind": "--lr-schedule", "warmup_steps": "--warmup-steps", "min_lr": "--min-lr",
                      "step_size": "--lr-step-size", "gamma": "--lr-gamma"}.get(key, key)
            differs.append(f"{option} {theirs[key]} (this run: {value})")
    if sched.get("kind") in ("cosine", "linear") and meta.steps is not None and meta.steps != steps:
        differs.append(f"a {sched['kind']} schedule over --steps {meta.steps} (this run: {steps})")
    if differs:
        raise RunError(f"--resume {directory}: the checkpoint was written with {'; '.join(differs)}; resume with the "
                       "same learning-rate schedule, or pass --override-schedule to use this run's")
