"""RunConfig: a ``transpile run`` resolved once, and how it reaches the rank processes.

``transpile run`` parses and checks its arguments once (runtime/cli.py ``resolve``); the result is
a RunConfig with absolute paths and every default applied. The ranks we spawn receive it as a JSON
file (``save``/``load``: ``python -m runtime.worker --config FILE``), never as a rebuilt command
line, so a new run option is one field here and one argument in runtime/cli.py. What the parent
tells the ranks it starts (``spawned``, ``parent``, ``run_dir``) travels in the same file, never in
environment variables; under an outside launcher (mpirun, srun, torchrun) those fields keep their
defaults.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import RunError, os_error_text
from runtime.schedule import Schedule

DEFAULT_TIMEOUT_S = 300.0  # --timeout's default


def output_file(option: str, value: str | None) -> Path | None:
    """The resolved path of an output file option (--export, --timings, --metrics), or a one-line
    RunError when it cannot be written there: checked before training starts, so a typo does not
    cost a run its results. A missing parent directory is created (as the HF Trainer's output_dir)."""
    if value is None:
        return None
    path = Path(value).resolve()
    if value.strip() == "" or path.is_dir():
        raise RunError(f"{option} {value}: is a directory; give a file name")
    if not path.parent.is_dir():
        above = next(p for p in path.parents if p.exists())
        if not above.is_dir():
            raise RunError(f"{option} {value}: {above} is a file, not a directory")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunError(f"{option} {value}: cannot create directory {path.parent}: {os_error_text(exc)}") from None
    target = path if path.exists() else path.parent
    if not os.access(target, os.W_OK):
        raise RunError(f"{option} {value}: {'file' if target is path else 'directory ' + str(target)} is not writable")
    return path


def check_timeout(seconds: float) -> float:
    """--timeout: a positive, finite number of seconds (one knob for every watchdog)."""
    if not 0 < seconds < float("inf"):
        raise RunError(f"--timeout must be a positive number of seconds, got {seconds:g}")
    return seconds


# Options of onnxruntime's CUDA execution provider that the runtime owns: the device and stream
# every session must share (the program orders its work by that stream) and CUDA graphs (which
# sessions capture is the program's decision).
RESERVED_EP_OPTIONS = ("device_id", "user_compute_stream", "has_user_compute_stream", "enable_cuda_graph")


def parse_ep_options(entries: list[str] | None) -> dict[str, str]:
    """``--ep-option KEY=VALUE`` entries (repeatable) -> ``{KEY: VALUE}``, the last of a key winning
    as on any command line; a malformed entry or a key the runtime owns is a one-line RunError
    naming it. Keys and values are onnxruntime's CUDA execution provider options (prefer_nhwc,
    cudnn_conv_algo_search, gpu_mem_limit, ...), passed through unchecked beyond that."""
    options: dict[str, str] = {}
    for entry in entries or []:
        key, sep, value = entry.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RunError(f"--ep-option {entry!r} is not KEY=VALUE (an onnxruntime CUDA execution provider "
                           "option, e.g. --ep-option prefer_nhwc=1)")
        if key in RESERVED_EP_OPTIONS:
            raise RunError(f"--ep-option {entry!r}: {key} is set by the runtime and cannot be changed (reserved: "
                           f"{', '.join(RESERVED_EP_OPTIONS)})")
        options[key] = value.strip()
    return options


# Every RunConfig field, decided once: AGREED fields are part of the fingerprint the ranks compare
# in their first exchange, before any training collective (runtime/worker.py ``fingerprint``): they
# change the sequence of collectives (a checkpoint, log or evaluation step runs host agreements),
# the state the replicas hold, or where the ranks' shared files go; ranks started by an outside
# launcher (``mpiexec -n 1 A : -n 1 B``, srun) resolve their own command lines and could differ.
# LOCAL fields may differ between ranks (rank 0 alone reads them, or they describe one process).
# A new field must be added here (tests/test_faults_agreement.py fails otherwise). The second
# element is how the user names the field in the one-line message that refuses a difference.
AGREED, LOCAL = "agreed", "local"
AGREEMENT: dict[str, tuple[str, str]] = {
    "batch": (AGREED, "--batch"),
    "steps": (AGREED, "--steps"),
    "lr": (AGREED, "--lr"),
    "grad_accumulation": (AGREED, "--grad-accumulation"),  # what each step computes (and, --sync-bn, its collectives)
    "shuffle": (AGREED, "--shuffle"),
    "seed": (AGREED, "--seed"),  # compared only with --shuffle (the order does not depend on it otherwise)
    "log_every": (AGREED, "--log-every"),  # losses are read (a host reduction) at log steps
    "export": (AGREED, "--export"),  # the export's outcome and the state check are host agreements
    "outputs": (AGREED, "--outputs"),  # what --export writes (rank 0 writes it; the outcome is agreed)
    "checkpoint": (AGREED, "--checkpoint"),  # every rank writes its file into the same store
    "checkpoint_every": (AGREED, "--checkpoint-every"),  # each save holds three host agreements
    "keep_checkpoints": (LOCAL, "--keep-last"),  # rank 0 alone prunes
    "resume": (AGREED, "--resume"),
    "timings": (AGREED, "--timings"),  # the ranks agree on writing it, rank 0 reads their parts
    "schedule": (AGREED, "the lr schedule"),
    "metrics": (LOCAL, "--metrics"),  # rank 0's file
    "tensorboard": (LOCAL, "--tensorboard"),  # rank 0's event files
    "progress": (LOCAL, "--progress"),  # rank 0's view
    "tty": (LOCAL, "the terminal"),
    "out": (AGREED, "plan"),  # compared as the plan's hash, which covers every rank's collectives
    "data": (AGREED, "data"),  # compared as the arrays' names, shapes and dtypes
    "backend": (AGREED, "backend"),  # resolved on each rank: hosts with and without GPUs must not mix
    "tf32": (AGREED, "--no-tf32"),  # the replicas' arithmetic
    "ep_options": (LOCAL, "--ep-option"),  # a host's onnxruntime tuning (memory limits differ by GPU)
    "timeout": (LOCAL, "--timeout"),  # each rank's own watchdog
    "eval_data": (AGREED, "--eval-data"),  # compared as its arrays' shapes: the evaluation is collective
    "eval_every": (AGREED, "--eval-every"),
    "eval_batch": (AGREED, "--eval-batch"),
    "export_best": (AGREED, "--export-best"),
    "spawned": (LOCAL, "spawned"),  # how this process was started
    "parent": (LOCAL, "parent"),
    "run_dir": (LOCAL, "run directory"),
}


def agreed_fields() -> list[str]:
    """The RunConfig fields every rank must hold the same value of, in declaration order."""
    return [f.name for f in dataclasses.fields(RunConfig) if AGREEMENT[f.name][0] == AGREED]


_PATHS = ("out", "data", "export", "checkpoint", "resume", "timings", "eval_data", "metrics", "tensorboard", "run_dir")


@dataclass(frozen=True)
class RunConfig:
    batch: int  # global batch, over all ranks
    steps: int
    lr: float
    # --grad-accumulation: micro-batches per optimizer step, each rank's shard cut into K equal ones
    # (runtime/accumulation.py); None: the plan's (1 unless transpiled with --grad-accumulation).
    grad_accumulation: int | None = None
    shuffle: bool = False
    seed: int = 0
    log_every: int = 0  # 0: silent
    export: Path | None = None
    outputs: tuple[str, ...] = ()  # --outputs: --export writes the forward up to these values (runtime/inference.py)
    checkpoint: Path | None = None  # written every checkpoint_every steps (0: at the end only)
    checkpoint_every: int = 0
    keep_checkpoints: int = 2  # complete checkpoints kept in the store (older ones are removed)
    resume: Path | None = None  # the checkpoint directory to start from instead of the init graph
    timings: Path | None = None  # measured segment and collective times, for inspect --timings
    schedule: Schedule = Schedule()  # learning rate per step (lr is the schedule's peak)
    metrics: Path | None = None  # --metrics: rank 0's JSON lines (runtime/metrics.py)
    tensorboard: Path | None = None  # --tensorboard: rank 0's event files, the same records (runtime/tensorboard.py)
    progress: str = "lines"  # rank 0's view: "bar", "lines", or "auto" (bar when its stdout is a terminal)
    tty: str | None = None  # the terminal the bar draws on (a spawned rank's stdout is mpiexec's pipe)
    # What a rank process loads (the in-process simulator passes arrays and leaves them None).
    out: Path | None = None  # the transpiler's OUT
    data: Path | None = None  # the .npz, .npy directory or Parquet (runtime/data_sources.py)
    backend: str = "cpu"  # "cpu", "nccl", or "auto" (each rank resolves it: runtime/devices.py)
    tf32: bool = True  # nccl backend: TF32 MatMul/Conv
    ep_options: dict[str, str] = field(default_factory=dict)  # nccl backend: --ep-option, onnxruntime CUDA EP options
    # --timeout: seconds without progress before the job stops, for every watchdog (the rank's,
    # NCCL's) and the torch-style bootstrap's wait for its peers.
    timeout: float = DEFAULT_TIMEOUT_S
    # --eval-data: the held-out .npz (runtime/evaluate.py), evaluated every eval_every steps (0: only
    # after the last step) in global batches of eval_batch rows; export_best: --export writes the
    # parameters of the best evaluation instead of the last step's.
    eval_data: Path | None = None
    eval_every: int = 0
    eval_batch: int = 0
    export_best: bool = False
    # Set by `transpile run` for the ranks it starts itself (runtime/cli.py), unset under an outside
    # launcher: spawned, a failing rank exits non-zero (our mpiexec stops the others) and the parent
    # holds the checkpoint lock; parent, the "<pid>:<start time>" of that `transpile run`, which each
    # rank's watchdog checks (runtime/guard.py); run_dir, a directory private to the run for the
    # ranks' heartbeat files. A run on several hosts leaves parent and run_dir out: they mean
    # nothing on another host.
    spawned: bool = False
    parent: str | None = None
    run_dir: Path | None = None

    def to_json(self) -> dict:
        raw = dataclasses.asdict(self)
        for key in _PATHS:
            raw[key] = None if raw[key] is None else str(raw[key])
        return raw

    @classmethod
    def from_json(cls, raw: dict) -> RunConfig:
        raw = dict(raw)
        for key in _PATHS:
            raw[key] = None if raw.get(key) is None else Path(raw[key])
        raw["schedule"] = Schedule(**raw.get("schedule", {}))
        raw["outputs"] = tuple(raw.get("outputs", ()))
        return cls(**raw)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise RunError(f"{path}: not a run configuration written by 'transpile run' ({exc})".splitlines()[0]) from None
