"""The Python API: compile, train and export from a script or a notebook (docs/api.md).

    out = transpile("model.onnx", "out", gpus=2, optimizer="adamw", lr=1e-3)
    result = train(out, "data.npz", batch=64, steps=100, callback=lambda record: print(record))
    export(out, "checkpoints", "served.onnx", outputs="logits")

Each function takes the options of its command (``transpile``, ``transpile run``, ``transpile
export``: docs/cli.md) as keyword arguments named like the long option, dashes as underscores
(``log_every=5``, ``lr_schedule="cosine"``), checked by the same code as the command line and a
``--config`` file (runtime/options_file.py): an unknown name or a wrong type is a one-line error.
Errors are raised (``contract.errors.UserError``: TranspileError, RunError), never printed.

``train`` on the cpu backend runs every rank as a thread of this process (as ``runtime.simulate``
does, with the whole ``transpile run`` loop: export, checkpoints, evaluation, metrics); for GPUs
(the nccl backend), or with ``processes=True``, it starts ``transpile run`` (one process per rank)
and follows its --metrics file. Either way ``callback(record)`` is called on every logged step with
the record --metrics writes (HF Trainer's ``on_log``), and the result holds the records and the
summary. This package sits above transpiler/ and runtime/, as commands/ does.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from runtime import checkpoint as checkpoints
from runtime import cli as run_cli
from runtime import options_file
from runtime.data import Dataset
from runtime.devices import resolve_backend
from runtime.errors import RunError
from runtime.export_cli import export_checkpoint
from runtime.inference import parse_outputs
from runtime.plan import load_plan
from runtime.simulate import run_in_process

Callback = Callable[[dict], None]


@dataclass
class TrainResult:
    """What ``train`` returns: the records of the logged steps (``{"step", "epoch", "loss",
    "mean_loss", "learning_rate", ...}``, and ``eval_loss`` records) and the run's summary, as
    ``transpile run --metrics`` writes them (keys: docs/cli.md)."""

    records: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    @property
    def final_loss(self) -> float | None:
        return self.summary.get("final_loss")


def transpile(model: str | Path, out: str | Path, *, gpus: int = 1, strategy: str | None = None,
              optimizer: str | None = None, verbose: bool = True, **options) -> Path:
    """``transpile MODEL -o OUT --gpus N ...``: write the rank graphs and plan.json of ``model``
    into ``out``; returns ``out`` as a Path. ``options``: the other options of the command
    (``lr``, ``placement``, ``weight_decay``, ``betas=(0.9, 0.95)``, ``grad_accumulation``, ...)."""
    from transpiler import cli as compile_cli

    parser = argparse.ArgumentParser(prog="transpile")
    compile_cli.add_arguments(parser)
    args = parser.parse_args([str(model), "-o", str(out)])
    values = _paths({"gpus": gpus, "strategy": strategy, "optimizer": optimizer, **options})
    chosen = options_file.convert(options_file.option_table(parser), values, "transpile()", "transpile")
    for dest, value in chosen.items():
        setattr(args, dest, value)
    with contextlib.redirect_stdout(sys.stdout if verbose else io.StringIO()):
        compile_cli.execute(args)
    return Path(out)


def train(out: str | Path, data: str | Path | Mapping[str, np.ndarray], *, batch: int, steps: int | None = None,
          epochs: float | None = None, lr: float | None = None, callback: Callback | None = None,
          verbose: bool = True, processes: bool | None = None, **options) -> TrainResult:
    """``transpile run OUT --data DATA --batch B --steps K ...``; returns the run's metrics.

    ``data``: what --data takes (a path), or arrays keyed by the model's data inputs.
    ``callback(record)``: every logged step's record (``log_every``, default 10; the first and last
    step too); an exception it raises stops the run and is raised here. ``verbose``: the banner,
    progress lines and summary on stdout. ``processes``: start ``transpile run`` (True) or run the
    ranks as threads here (False); default: threads on the cpu backend, processes on GPUs.
    ``options``: any other option of ``transpile run`` (``grad_accumulation``, ``export``, ``outputs``,
    ``checkpoint``, ``resume``, ``eval_data``, ``lr_schedule``, ``metrics``, ``backend``, ...)."""
    arrays = dict(data) if isinstance(data, Mapping) else None
    values = _paths({"data": "<arrays>" if arrays is not None else str(data), "batch": batch, "steps": steps,
                     "epochs": epochs, "lr": lr, **options})
    parser = argparse.ArgumentParser(prog="transpile run")
    run_cli.add_run_arguments(parser)
    args = options_file.complete(parser.parse_args([str(out)]), values, "train()")
    remote = args.hostfile is not None or args.hosts is not None
    if processes is None:
        processes = remote or resolve_backend(args.backend) != "cpu"
    if not processes:
        if remote:
            raise RunError("train(): hostfile/hosts start processes on other hosts; pass processes=True")
        return _train_here(args, arrays, callback, verbose)
    if arrays is not None:
        with tempfile.TemporaryDirectory(prefix="transpile-api.") as tmp:
            path = Path(tmp) / "data.npz"
            np.savez(path, **arrays)
            return _train_processes(out, {**values, "data": str(path)}, callback, verbose)
    return _train_processes(out, values, callback, verbose)


def export(out: str | Path, checkpoint: str | Path, output: str | Path, *,
           outputs: str | list[str] | tuple[str, ...] | None = None) -> Path:
    """``transpile export OUT --checkpoint DIR -o OUTPUT [--outputs NAMES]``: the user's model with
    a checkpoint's trained values (``outputs``: only the forward up to those values, for inference);
    returns ``output`` as a Path."""
    names = parse_outputs(outputs if outputs is None or isinstance(outputs, str) else ",".join(outputs))
    export_checkpoint(out, checkpoint, output, names)
    return Path(output)


def _paths(values: dict) -> dict:
    """Path arguments as the strings the command line would hold."""
    return {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in values.items()}


def _plain(record: dict) -> dict:
    """A record as the metrics file holds it (paths as strings, non-finite floats as None)."""
    return {k: _plain(v) if isinstance(v, dict) else str(v) if isinstance(v, Path)
            else None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def _train_here(args: argparse.Namespace, arrays: dict | None, callback: Callback | None, verbose: bool) -> TrainResult:
    """Every rank a thread of this process, on the cpu backend (runtime/simulate.py)."""
    plan = load_plan(args.out)
    dataset = None if arrays is None else Dataset(arrays, plan.data_inputs, "<arrays>")
    plan, dataset, config = run_cli.resolve(args, dataset)
    if resolve_backend(config.backend) != "cpu":
        raise RunError(f"train(): backend {config.backend} runs one process per GPU; pass processes=True")
    config = replace(config, backend="cpu", progress="lines" if not verbose else config.progress)
    result = TrainResult()

    def observe(record: dict) -> None:
        if "summary" in record:
            result.summary = _plain(record["summary"])
            return
        result.records.append(_plain(record))
        if callback is not None:
            callback(result.records[-1])

    lock = None if config.checkpoint is None else checkpoints.Lock(config.checkpoint)
    try:
        run_in_process(plan, dataset, config, log=print if verbose else (lambda line: None), observe=observe)
    finally:
        if lock is not None:
            lock.release()
    return result


def _train_processes(out: str | Path, values: dict, callback: Callback | None, verbose: bool) -> TrainResult:
    """``transpile run OUT --config FILE`` in a child process, its --metrics file followed as it grows."""
    with tempfile.TemporaryDirectory(prefix="transpile-api.") as tmp:
        metrics = Path(values.get("metrics") or Path(tmp) / "metrics.jsonl").resolve()
        config = Path(tmp) / "options.json"
        config.write_text(json.dumps({k: v for k, v in {**values, "metrics": str(metrics)}.items() if v is not None},
                                     default=str))
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)  # this checkout's packages, installed or not
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        command = [sys.executable, "-m", "commands", "run", str(out), "--config", str(config), "--progress", "lines"]
        job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        errors: list[str] = []
        relays = [threading.Thread(target=_relay, args=(job.stdout, sys.stdout if verbose else None, None), daemon=True),
                  threading.Thread(target=_relay, args=(job.stderr, sys.stderr, errors), daemon=True)]
        for relay in relays:
            relay.start()
        result, read = TrainResult(), 0
        try:
            while True:
                done = job.poll() is not None
                read = _follow(metrics, read, result, callback)
                if done:
                    break
                time.sleep(0.2)
        finally:
            if job.poll() is None:  # the callback raised: stop the run
                job.terminate()
                job.wait()
            for relay in relays:
                relay.join(timeout=5)
        if job.returncode != 0:
            line = next((e for e in reversed(errors) if e.startswith("transpile: error: ")), None)
            raise RunError(line[len("transpile: error: "):] if line else f"transpile run exited with status {job.returncode}")
        return result


def _follow(path: Path, offset: int, result: TrainResult, callback: Callback | None) -> int:
    """Read the whole lines ``path`` gained since ``offset`` into ``result``; the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read()
    except FileNotFoundError:
        return offset
    end = text.rfind(b"\n") + 1
    for line in text[:end].decode().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "summary" in record:
            result.summary = record["summary"]
        else:
            result.records.append(record)
            if callback is not None:
                callback(record)
    return offset + end


def _relay(pipe, to, kept: list[str] | None) -> None:
    for line in pipe:
        if to is not None:
            print(line, end="", file=to, flush=True)
        if kept is not None:
            kept.append(line.rstrip("\n"))
