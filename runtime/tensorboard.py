"""``transpile run --tensorboard DIR``: the records ``--metrics`` gets, as TensorBoard event files.

A second sink of ``Report`` (runtime/progress.py) beside ``MetricsFile`` (runtime/metrics.py), with
the same three calls: ``write(record)`` adds every number of a record (loss, mean_loss,
learning_rate, samples_per_second, step_time_ms, grad_norm, eval_loss, loss_scale, epoch, ...) as a
scalar of that name at the record's step; ``summary(values)`` adds the summary as one text entry
(``summary``, JSON); ``close()`` flushes and closes. Rank 0 alone writes it; ``Report.close`` runs
in the loop's ``finally``, so a failing run still flushes what it logged. The files are written by
tensorboardX (a maintained writer of the event format, the optional extra ``tensorboard``), one
``events.out.tfevents.*`` file per run in DIR: a ``--resume``d run adds its own, and TensorBoard
joins them by step.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import sys
from pathlib import Path

from runtime.errors import RunError, os_error_text

INSTALL = "pip install tensorboardX (or graph-transpiler[tensorboard])"


def check_available() -> None:
    """--tensorboard without tensorboardX: a one-line RunError, before training."""
    if importlib.util.find_spec("tensorboardX") is None:
        raise RunError(f"--tensorboard needs the tensorboardX package: {INSTALL}")


def tensorboard_dir(value: str | None) -> Path | None:
    """The resolved --tensorboard DIR, created where missing, or a one-line RunError."""
    if value is None:
        return None
    check_available()
    path = Path(value).resolve()
    if path.exists() and not path.is_dir():
        raise RunError(f"--tensorboard {value}: is a file; give a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunError(f"--tensorboard {value}: {os_error_text(exc)}") from None
    return path


_WRITERS = itertools.count()  # event files this process opened


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


class TensorBoardFile:
    """The event file of one run in DIR (rank 0 only)."""

    def __init__(self, directory: Path, *, resumed_at: int | None = None):
        """``resumed_at``: the step a ``--resume``d run goes on from. Its first event then tells
        TensorBoard to drop what earlier runs wrote for later steps (tensorboardX's ``purge_step``),
        as the metrics file drops their records."""
        from tensorboardX import SummaryWriter

        self.directory = directory
        self._writer = None
        try:
            # The file name is tensorboardX's (the second, the host) plus the pid and a count: a
            # resume started within the same second as the run it resumes (or in the same process:
            # the Python API) would otherwise truncate that run's file.
            self._writer = SummaryWriter(logdir=str(directory), flush_secs=10,
                                         filename_suffix=f".{os.getpid()}.{next(_WRITERS)}",
                                         purge_step=None if resumed_at is None else resumed_at + 1)
        except OSError as exc:
            raise RunError(f"--tensorboard {directory}: {os_error_text(exc)}") from None

    def write(self, record: dict) -> None:
        if self._writer is None:
            return
        step = record["step"]
        try:
            for key, value in record.items():
                number = _number(value)
                if key != "step" and number is not None:
                    self._writer.add_scalar(key, number, global_step=step)
        except OSError as exc:
            self._failed(exc)

    def summary(self, values: dict) -> None:
        if self._writer is None:
            return
        text = json.dumps({k: str(v) if isinstance(v, Path) else _number(v) if isinstance(v, float) else v
                           for k, v in values.items()})
        try:
            self._writer.add_text("summary", text, global_step=values.get("steps"))
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        # As --metrics: training goes on, its result matters more than its log.
        print(f"transpile: warning: --tensorboard {self.directory}: {os_error_text(exc)}; no more events are written",
              file=sys.stderr, flush=True)
        self.close()

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.close()
            except OSError:
                pass
