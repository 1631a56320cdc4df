"""What rank 0 tells the user during ``transpile run``, in the manner of the HF Trainer and Lightning:
a banner (what runs), progress (a rich bar on a terminal, plain lines when piped), a summary (how it
went, and where the results are). Its sinks get the same records: ``--metrics`` as JSON lines
(runtime/metrics.py), ``--tensorboard`` as event files (runtime/tensorboard.py).

The training loop (runtime/loop.py) feeds one ``Report``:
- ``start()`` prints the banner;
- ``advance(done)`` after every step (moves the bar; cheap);
- ``log(step, **values)`` for every record: the loop's training records (loss, learning_rate,
  samples_per_second, step_time_ms, grad_norm) and anything else measured at a step. Evaluation
  calls ``report.log(step, eval_loss=x)``: the record goes to the metrics file as it is, the line
  view prints ``step S/T  epoch E  eval loss X``, the bar shows ``eval loss X`` beside the loss;
- ``finish(summary)`` prints the summary and gives it to the sinks (the metrics' summary line).
Ranks other than 0 get a Report with neither view nor sinks: every call is a no-op. A sink has
``write(record)``, ``summary(values)`` and ``close()``.

Views: ``lines`` prints every --log-every steps with today's line format (scripts and tests read the
``step K/T ... loss X`` lines; new fields are appended at the end); ``bar`` is a rich progress bar
with loss, lr, samples/s, step time and ETA. A rank spawned under mpiexec writes to a pipe, so the
parent (runtime/cli.py) decides: on a terminal it passes the bar and the terminal's device, which
rank 0 opens itself (the relay of mpiexec's output is line by line, and a bar redraws one line).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from runtime.metrics import MetricsFile
from runtime.tensorboard import TensorBoardFile

VIEWS = ("auto", "bar", "lines")
# The fields of a training record, in the order the line view prints them (after step and epoch).
_LINE_FIELDS = {"loss": "loss {:.6f}", "mean_loss": "mean loss {:.6f}", "learning_rate": "lr {:g}",
                "step_time_ms": "{:.2f} ms/step", "samples_per_second": "{:.0f} samples/s",
                "grad_norm": "grad norm {:.4g}", "loss_scale": "loss scale {:g}",
                "skipped_steps": "{} skipped"}


@dataclass(frozen=True)
class RunInfo:
    """What the banner says (and the summary's denominators)."""
    model: str  # the user's model file
    ranks: int
    backend: str
    strategy: str
    batch: int  # global
    accumulation: int
    steps: int  # the step the run ends at
    start: int  # the step it starts from (0, or a resumed checkpoint's)
    rows: int  # samples in the data
    data: str
    optimizer: str  # name and hyper-parameters
    schedule: str  # the lr schedule, in words
    parameters: int  # trained elements
    resumed_from: str | None = None
    kernels: str | None = None  # how the backend computes, where it has a choice (Backend.describe)

    def banner(self) -> list[tuple[str, str]]:
        epochs = self.steps * self.batch / self.rows
        per_rank = self.batch // self.ranks
        steps = f"{self.steps:,} steps ({epochs:.2f} epochs)"
        if self.start:
            steps += f", resuming at step {self.start} from {self.resumed_from}"
        micro = f", {self.accumulation} micro-batches" if self.accumulation > 1 else ""
        rows = [("model", f"{self.model} ({self.parameters:,} parameters trained)"),
                ("ranks", f"{self.ranks} on the {self.backend} backend, strategy {self.strategy}")]
        if self.kernels:
            rows.append(("kernels", self.kernels))
        return rows + [("data", f"{self.rows:,} samples ({self.data})"),
                       ("batch", f"{self.batch:,} global ({per_rank:,} per rank{micro})"),
                       ("steps", steps),
                       ("optimizer", self.optimizer),
                       ("lr schedule", self.schedule)]


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.{2 if seconds < 10 else 1}f} s"
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m{s:02d}s" if minutes >= 60 else f"{minutes}m{s:02d}s"


def summary_lines(summary: dict) -> tuple[str, list[tuple[str, str]]]:
    if not summary["steps_run"]:  # resumed at the last step: only evaluated and exported
        head = f"no steps run (resumed at step {summary['steps']:,})"
    else:
        head = (f"{summary['steps_run']:,} steps in {duration(summary['runtime_s'])}: "
                f"{summary['samples_per_second']:.0f} samples/s, {summary['step_time_ms']:.2f} ms/step, "
                f"final loss {summary['final_loss']:.6f}, mean loss over the run {summary['mean_loss']:.6f}")
        if summary.get("loss_scale") is not None:  # --precision fp16
            head += f", loss scale {summary['loss_scale']:g}, {summary['skipped_steps']:,} steps skipped (overflow)"
    if summary.get("eval_loss") is not None:  # the last evaluation's (--eval-data)
        head += f", eval loss {summary['eval_loss']:.6f} (step {summary['eval_step']})"
    where = [(key, str(summary[key])) for key in ("export", "checkpoint", "metrics") if summary.get(key)]
    if summary.get("best_eval_step") is not None:  # --export-best: which evaluation the export holds
        where = [(key, f"{value} (step {summary['best_eval_step']}, best eval loss {summary['best_eval_loss']:.6f})"
                  if key == "export" else value) for key, value in where]
    return head, where


class View:
    """Says nothing (ranks other than 0, --log-every 0)."""

    def start(self, info: RunInfo) -> None: ...

    def advance(self, done: int) -> None: ...

    def show(self, record: dict) -> None: ...

    def finish(self, summary: dict) -> None: ...

    def close(self) -> None: ...


class LineView(View):
    """Plain lines, for a pipe or a log file."""

    def __init__(self, log: Callable[[str], None], steps: int):
        self.log, self.steps = log, steps

    def start(self, info: RunInfo) -> None:
        self.log("transpile run")
        for key, value in info.banner():
            self.log(f"  {key:12s}{value}")

    def show(self, record: dict) -> None:
        parts = [f"step {record['step']}/{self.steps}", f"epoch {record['epoch']:.2f}"]
        parts += [fmt.format(record[key]) for key, fmt in _LINE_FIELDS.items() if record.get(key) is not None]
        parts += [f"{key.replace('_', ' ')} {value:.6g}" if isinstance(value, float) else f"{key.replace('_', ' ')} {value}"
                  for key, value in record.items()
                  if key not in _LINE_FIELDS and key not in ("step", "epoch") and value is not None]
        if "loss" in record and record["step"] < self.steps and record.get("step_time_ms"):
            parts.append(f"eta {duration((self.steps - record['step']) * record['step_time_ms'] / 1e3)}")
        self.log("  ".join(parts))

    def finish(self, summary: dict) -> None:
        head, where = summary_lines(summary)
        self.log(f"done: {head}")
        for key, value in where:
            self.log(f"  {key:12s}{value}")


class BarView(View):
    """A rich progress bar, for a terminal: the bar, then the latest record's numbers on a second line
    (one line would not fit 80 columns)."""

    def __init__(self, console, steps: int):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        class TwoLines(Progress):
            stats = ""

            def get_renderables(self):
                yield self.make_tasks_table(self.tasks)
                if self.stats:
                    yield Text("  " + self.stats)

        self.console, self.steps = console, steps
        self.bar = TwoLines(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(bar_width=None),
                            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console,
                            refresh_per_second=5)
        self.task = None
        self.stats: dict[str, str] = {}

    def start(self, info: RunInfo) -> None:
        from rich.table import Table

        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan")
        grid.add_column()
        for key, value in info.banner():
            grid.add_row(key, value)
        self.console.print("[bold]transpile run[/bold]")
        self.console.print(grid)
        self.task = self.bar.add_task("train", total=self.steps, completed=info.start)
        self.bar.start()

    def advance(self, done: int) -> None:
        self.bar.update(self.task, completed=done)

    def show(self, record: dict) -> None:
        fields = {"loss": "loss {:.4f}", "eval_loss": "eval loss {:.4f}", "learning_rate": "lr {:.3g}",
                  "samples_per_second": "{:.0f} samples/s", "step_time_ms": "{:.2f} ms/step",
                  "grad_norm": "grad norm {:.3g}"}
        self.stats.update({k: fmt.format(record[k]) for k, fmt in fields.items() if record.get(k) is not None})
        self.bar.stats = "  ".join(self.stats[k] for k in fields if k in self.stats)

    def finish(self, summary: dict) -> None:
        self.close()
        head, where = summary_lines(summary)
        self.console.print(f"[bold green]done[/bold green]: {head}", highlight=False)
        for key, value in where:
            self.console.print(f"  [bold cyan]{key:12s}[/bold cyan]{value}", highlight=False)

    def close(self) -> None:
        if self.task is not None:
            self.bar.stop()
            self.task = None


def bar_console(tty: str | None, file: IO[str] | None = None):
    """The console of the bar: the terminal device the parent passed (a rank's stdout is mpiexec's
    pipe), or this process's stdout."""
    from rich.console import Console

    if file is None and tty is not None:
        file = open(tty, "w")  # noqa: SIM115 - lives as long as the process
    return Console(file=file or sys.stdout, force_terminal=True)


class Sink(Protocol):
    """Where records go besides the view: MetricsFile (--metrics), TensorBoardFile (--tensorboard)."""

    def write(self, record: dict) -> None: ...

    def summary(self, values: dict) -> None: ...

    def close(self) -> None: ...


class Report:
    """Rank 0's records: to the view and to the sinks (see the module docstring)."""

    def __init__(self, view: View, sinks: list[Sink] | tuple[Sink, ...] = (), *, steps: int, batch: int, rows: int,
                 observe: Callable[[dict], None] | None = None):
        self.view, self.sinks, self.observe = view, list(sinks), observe
        self.steps, self.batch, self.rows = steps, batch, rows

    def start(self, info: RunInfo) -> None:
        self.view.start(info)

    def advance(self, done: int) -> None:
        self.view.advance(done)

    def log(self, step: int, **values) -> None:
        """One record at ``step`` (the number of steps done): ``step`` and ``epoch`` first, then ``values``."""
        record = {"step": step, "epoch": round(step * self.batch / self.rows, 4), **values}
        for sink in self.sinks:
            sink.write(record)
        self.view.show(record)
        if self.observe is not None:
            self.observe(record)

    def finish(self, **summary) -> None:
        for sink in self.sinks:
            sink.summary(summary)
        self.view.finish(summary)
        if self.observe is not None:
            self.observe({"summary": summary})

    def close(self) -> None:
        self.view.close()
        for sink in self.sinks:
            sink.close()


def make_report(trainer, dataset, config, log: Callable[[str], None],
                observe: Callable[[dict], None] | None = None, resumed_at: int | None = None) -> Report:
    """Rank 0's Report (its view, its --metrics file and --tensorboard events); a silent one on the other ranks. ``trainer``,
    ``dataset`` and ``config``: the loop's Trainer, Dataset and RunConfig. ``observe`` (rank 0) gets
    every record as the metrics file does, the summary as ``{"summary": {...}}`` (the Python API's callback).
    ``resumed_at``: the checkpoint's step where the run resumes (the sinks keep the history before it)."""
    if trainer.comm.rank != 0:
        return Report(View(), (), steps=config.steps, batch=config.batch, rows=dataset.rows)
    if not config.log_every:
        view = View()
    else:
        view = LineView(log, config.steps)
        if config.progress == "bar" or (config.progress == "auto" and sys.stdout.isatty()):
            try:
                view = BarView(bar_console(config.tty), config.steps)
            except OSError:  # the terminal went away (or is not ours to open): lines then
                pass
    sinks: list[Sink] = []
    if config.metrics is not None:
        sinks.append(MetricsFile(config.metrics, resumed_at=resumed_at))
    if config.tensorboard is not None:
        sinks.append(TensorBoardFile(config.tensorboard, resumed_at=resumed_at))
    return Report(view, sinks, steps=config.steps, batch=config.batch, rows=dataset.rows, observe=observe)


def run_info(trainer, dataset, config, start: int) -> RunInfo:
    """The banner's facts: the plan's, the run configuration's and the data's."""
    plan = trainer.plan
    opt = plan.optimizer
    name = str(opt.get("name", "?"))
    hyper = [f"lr {config.lr:g}"]
    if opt.get("momentum"):
        hyper.append(f"momentum {opt['momentum']:g}" + (" nesterov" if opt.get("nesterov") else ""))
    if name in ("adam", "adamw"):
        hyper.append(f"betas {','.join(f'{b:g}' for b in opt.get('betas', ()))}, eps {opt.get('eps', 0):g}")
    if opt.get("weight_decay"):
        hyper.append(f"weight decay {opt['weight_decay']:g}")
    if opt.get("max_grad_norm") is not None:
        hyper.append(f"clip grad norm {opt['max_grad_norm']:g}")
    source = plan.raw.get("source_model")
    model = source.get("file") if isinstance(source, dict) and source.get("file") else plan.model.name
    return RunInfo(model=model, ranks=trainer.comm.size, backend=trainer.backend.name, strategy=plan.strategy,
                   batch=config.batch, accumulation=trainer.accumulation, steps=config.steps, start=start,
                   rows=dataset.rows, data=Path(dataset.source).name, optimizer=f"{name} ({', '.join(hyper)})",
                   schedule=config.schedule.describe(), parameters=sum(math.prod(p.shape) for p in plan.parameters),
                   resumed_from=None if config.resume is None else str(config.resume),
                   kernels=trainer.backend.describe())
