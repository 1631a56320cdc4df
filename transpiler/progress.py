"""What ``transpile`` shows while it works: one line per stage that took long enough to matter.

    load 4.1 s
    autodiff 3.2 s
    split ranks 1.9 s
    write 2.3 s

A stage faster than ``MIN_SECONDS`` prints nothing, so a tiny model transpiles silently. On a
terminal, for a large job (``large``), a transient rich spinner names the stage while it runs;
piped, or without rich, there are only the plain lines (stderr: stdout stays the one summary line).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import TextIO

MIN_SECONDS = 1.0
LARGE_MODEL_BYTES = 32 << 20  # a model file this large, or
LARGE_WORLD = 64  # this many ranks, gets the live spinner on a terminal


class Progress:
    def __init__(self, stream: TextIO | None = None, *, large: bool = False, min_seconds: float = MIN_SECONDS):
        self.stream = stream if stream is not None else sys.stderr
        self.min_seconds = min_seconds
        self.console = None
        if large and _isatty(self.stream):
            try:  # rich is optional here: without it the plain lines remain
                from rich.console import Console
            except ImportError:
                pass
            else:
                self.console = Console(file=self.stream, highlight=False)

    @contextmanager
    def stage(self, label: str):
        start = time.perf_counter()
        status = self.console.status(f"{label} ...") if self.console is not None else None
        if status is not None:
            status.start()

        def note(detail: str) -> None:
            """How far the stage is (e.g. "37/512 ranks"): shown in the spinner only, never as a line."""
            if status is not None:
                status.update(f"{label} {detail}")

        try:
            yield note
        finally:
            if status is not None:
                status.stop()
        elapsed = time.perf_counter() - start
        if elapsed >= self.min_seconds:
            line = f"{label} {elapsed:.1f} s"
            if self.console is not None:
                self.console.print(f"[dim]transpile:[/dim] {line}")
            else:
                print(f"transpile: {line}", file=self.stream, flush=True)


class Quiet(Progress):
    """No output (the library default: ``transpile()`` called from Python prints nothing)."""

    def __init__(self):
        super().__init__(min_seconds=float("inf"))


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
