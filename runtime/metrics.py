"""``transpile run --metrics FILE.jsonl``: the run's numbers as JSON lines, written by rank 0.

One object per logged step, then one summary line::

    {"step": 10, "epoch": 0.32, "loss": 0.41, "mean_loss": 0.47, "learning_rate": 0.01,
     "samples_per_second": 35100.0, "step_time_ms": 0.91}
    ...
    {"summary": {"steps": 40, "runtime_s": 0.2, "samples_per_second": 6400.0, "final_loss": 0.1, ...}}

``loss`` is that step's global loss (the mean over the global batch, the same number on every rank);
``mean_loss``, ``step_time_ms`` and ``samples_per_second`` are over the steps since the previous
record. ``grad_norm`` is there when the plan clips (``--clip-grad-norm``): that step's global norm
before clipping. Other producers add records through ``Report.log(step, **values)``
(runtime/progress.py): evaluation writes ``{"step": s, "epoch": e, "eval_loss": x}``, the way the HF
Trainer logs evaluation apart from training. Keys are documented in docs/cli.md.

Each record is one ``write`` of a whole line, flushed at once: a reader (``tail -f``, a dashboard)
never sees half a line, and a crash loses at most the line being written. A fresh run truncates the
file; ``--resume`` appends, so the file holds the whole history of a resumed run, with one summary:
before appending, the earlier runs' summary lines (and a half-written last line a crash left) are
dropped, so the file ends with the summary of the last run (its ``steps_run`` counts that run's
steps, ``steps`` where the whole history ends). So are the records of steps after the checkpoint
the run resumes from (an older one than the last, or the last after a crash that logged further):
the file holds each step once, as the run that counts computed it.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import IO

from runtime.errors import RunError, os_error_text


def _plain(value):
    """JSON has no NaN or infinity: such a float is written as null (a loss is checked finite anyway)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


class MetricsFile:
    """The JSON-lines file of one run (rank 0 only)."""

    def __init__(self, path: Path, *, resumed_at: int | None = None):
        """``resumed_at``: the step a ``--resume``d run goes on from (its records are appended)."""
        self.path = path
        self._file: IO[str] | None = None
        append = resumed_at is not None
        try:
            if append and path.is_file():
                _keep_history(path, resumed_at)
            self._file = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise RunError(f"--metrics {path}: {os_error_text(exc)}") from None

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        line = json.dumps({k: _plain(v) for k, v in record.items()}) + "\n"
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as exc:
            # Training goes on: its result (checkpoints, export) matters more than its log.
            print(f"transpile: warning: --metrics {self.path}: {os_error_text(exc)}; no more metrics are written",
                  file=sys.stderr, flush=True)
            self.close()

    def summary(self, values: dict) -> None:
        self.write({"summary": {k: _plain(v) for k, v in values.items()}})

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


def _keep_history(path: Path, step: int) -> None:
    """--resume from ``step``: the file without its summary lines, without the records of steps
    after ``step`` and without a last line missing its newline (a crash mid-write), replaced
    atomically; the earlier records stay as they were."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    kept = [line for line in lines if line.endswith("\n") and not line.startswith('{"summary": ')
            and not _after(line, step)]
    if len(kept) == len(lines):
        return
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text("".join(kept), encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _after(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False  # not ours to judge: kept as it was
    return isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step


def read_metrics(path: str | Path) -> tuple[list[dict], dict | None]:
    """(the step records, the summary or None): what benchmarks and tests read instead of the log.
    The records are every run's in order (a ``--resume``d run's follow the earlier runs'); the
    summary is the last line's, the one summary the file holds (the last run's: earlier ones are
    dropped when ``--resume`` appends). A file written before that rule may hold several: the last
    one is returned."""
    records, summary = [], None
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if "summary" in record:
                summary = record["summary"]
            else:
                records.append(record)
    return records, summary
