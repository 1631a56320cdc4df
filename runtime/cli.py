"""``transpile run OUT ...``: train on the graphs in OUT. ``transpile`` (commands/) dispatches here;
``python -m runtime run ...`` runs it directly.

The arguments are parsed and checked once, here (``resolve``); the ranks this process spawns get
the resulting RunConfig as a file, or inline on other hosts (runtime/config.py), and run it in runtime/worker.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from runtime import checkpoint, options_file
from runtime import resume as resumption
from runtime.accumulation import micro_batches
from runtime.collectives import LocalGroup
from runtime.config import DEFAULT_TIMEOUT_S, RunConfig, check_timeout, output_file, parse_ep_options
from runtime.data import Dataset, check_ids, id_bounds, shard_size
from runtime.devices import BACKENDS, check_gpus, resolve_backend
from runtime.errors import PeerFailed, RunError
from runtime.evaluate import eval_batch_size, load_eval_data, make_evaluator
from runtime.executor import CpuBackend
from runtime.guard import alive, parent_token
from runtime.inference import check_outputs, parse_outputs
from runtime.launcher import Host, check_slots, detect_launcher, parse_hostfile, parse_hosts, spawn
from runtime.loop import train
from runtime.plan import Plan, load_plan
from runtime.progress import VIEWS
from runtime.schedule import SCHEDULES, Schedule
from runtime.segments import load_graph
from runtime.tensorboard import tensorboard_dir
from runtime.trainer import Trainer
from runtime.worker import os_error_line, run_as_rank


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", metavar="OUT", help="transpiler output directory (holds plan.json)")
    parser.add_argument("--data", required=True, metavar="DATA",
                        help="arrays named like the model's data inputs: a .npz, a directory of NAME.npy files "
                             "(memory-mapped) or Parquet (a file or directory; a column per input); docs/data.md")
    parser.add_argument("--batch", required=True, type=int, metavar="B", help="global batch size, over all ranks")
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=int, metavar="K", help="number of training steps")
    length.add_argument("--epochs", type=float, metavar="E", help="passes over the data (steps = ceil(E * rows / B))")
    parser.add_argument("--lr", type=float, metavar="X", help="learning rate (default: the plan's optimizer lr)")
    parser.add_argument("--lr-schedule", default="constant", choices=SCHEDULES,
                        help="learning rate over the run, with --lr as its peak (formulas: docs/cli.md; default constant)")
    # default=None: a schedule option given to a schedule that ignores it is an error (Schedule.from_options).
    parser.add_argument("--warmup-steps", type=int, metavar="W", help="linear warmup over the first W steps (any schedule)")
    parser.add_argument("--min-lr", type=float, metavar="X", help="cosine/linear only: the final learning rate (default 0)")
    parser.add_argument("--lr-step-size", type=int, metavar="N", help="step only: decay every N steps (required)")
    parser.add_argument("--lr-gamma", type=float, metavar="G", help="step only: decay factor (default 0.1)")
    parser.add_argument("--grad-accumulation", type=int, metavar="K",
                        help="micro-batches per optimizer step: each rank cuts its share of --batch into K equal "
                             "micro-batches and averages their gradients before the collectives and the update "
                             "(HF's gradient_accumulation_steps; default: the K OUT was transpiled with, else 1)")
    parser.add_argument("--shuffle", action="store_true", help="read each epoch in a seeded random order")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="shuffle seed (default 0)")
    parser.add_argument("--export", metavar="TRAINED.onnx", help="write the user's model with the trained parameters")
    parser.add_argument("--outputs", metavar="NAMES",
                        help="--export writes only the forward up to these values of the model (comma-separated, "
                             "e.g. logits), in inference mode: no loss, no inputs they do not read (labels)")
    parser.add_argument("--log-every", type=int, default=10, metavar="N",
                        help="log every N steps on rank 0 (also the first and last; 0: silent; default 10)")
    parser.add_argument("--metrics", metavar="FILE.jsonl",
                        help="rank 0 writes one JSON object per logged step, then a summary line (keys: docs/cli.md)")
    parser.add_argument("--tensorboard", metavar="DIR",
                        help="rank 0 also writes the --metrics records as TensorBoard event files into DIR "
                             "(needs tensorboardX: pip install tensorboardX)")
    parser.add_argument("--progress", choices=VIEWS, default="auto",
                        help="bar (rich progress bar), lines (a line every --log-every steps) or auto (default: bar "
                             "when stdout is a terminal)")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="save every rank's state at the end into DIR/checkpoint-<step>/ (atomically; DIR is locked)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="also every N steps")
    parser.add_argument("--keep-last", "--keep-checkpoints", dest="keep_checkpoints", type=int, default=2, metavar="K",
                        help="complete checkpoints kept in DIR, newest first (default 2)")
    parser.add_argument("--resume", metavar="latest|DIR",
                        help="continue up to --steps from the newest complete checkpoint of --checkpoint DIR ('latest'), "
                             "of a store DIR, or from DIR/checkpoint-<step>, written by any plan of this model "
                             "(any --gpus or --strategy); same data order and lr schedule")
    parser.add_argument("--override-schedule", action="store_true",
                        help="--resume with this run's --lr and schedule options instead of refusing ones that differ")
    parser.add_argument("--timings", metavar="FILE.json",
                        help="write each rank's median segment and collective times (cpu backend: host clock; nccl: "
                             "CUDA events on each item's stream, with the collectives between the sessions, not inside them "
                             "as by default), for "
                             "'transpile inspect OUT --timeline T.png --timings FILE.json'")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="cpu (onnxruntime CPU, MPI), nccl (one GPU per rank: onnxruntime CUDA, NCCL) or "
                             "auto (default: nccl when GPUs, CuPy and onnxruntime-gpu are there, else cpu)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help="stop the job with one line naming the rank that did not arrive when training makes no "
                             "progress for SECONDS (a collective waiting for a stopped or dead rank); bounds every "
                             "watchdog: the ranks', NCCL's and the torchrun bootstrap's wait for its peers "
                             f"(default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--eval-data", metavar="EVAL",
                        help="held-out arrays named like --data's: report the mean loss on them (eval mode: BatchNorm "
                             "running statistics, no Dropout) after the last step and every --eval-every steps")
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="also evaluate every N steps (default 0: after the last step only)")
    parser.add_argument("--eval-batch", type=int, metavar="B",
                        help="global evaluation batch, over all ranks (default: --batch); a multiple of the ranks")
    parser.add_argument("--export-best", action="store_true",
                        help="--export writes the parameters of the evaluation with the lowest eval loss, not the last "
                             "step's (rank 0 keeps a host copy of them)")
    parser.add_argument("--no-tf32", action="store_true",
                        help="nccl backend: fp32 MatMul/Conv in full fp32 instead of TF32 (for exact comparisons)")
    parser.add_argument("--ep-option", action="append", metavar="KEY=VALUE",
                        help="nccl backend only: an option of onnxruntime's CUDA execution provider for every session "
                             "(e.g. prefer_nhwc=1, cudnn_conv_algo_search=EXHAUSTIVE, gpu_mem_limit=BYTES); repeat "
                             "for several; the device, stream and CUDA graph options are the runtime's")
    # Several hosts, through the same mpiexec (docs/multi-node.md); the slots must add up to the plan's world size.
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("--hostfile", metavar="FILE",
                       help="start the ranks on the hosts of FILE (lines 'host slots=N' or 'host:N'; # comments)")
    hosts.add_argument("--hosts", metavar="H1:N1,H2:N2", help="start the ranks on these hosts, N ranks on each")
    options_file.install(parser)  # --config FILE.json: every option above from a file (runtime/options_file.py)


def resolve(args: argparse.Namespace, dataset: Dataset | None = None) -> tuple[Plan, Dataset, RunConfig]:
    """Everything that can be checked before any rank starts (plan, data, batch and options), once:
    the RunConfig it returns is what every rank runs (runtime/config.py). ``dataset``: arrays given
    in memory (the Python API, in-process ranks only) instead of the file --data names."""
    args = options_file.complete(args)  # a no-op where run_command (or the API) did it
    plan = load_plan(args.out)
    given = dataset is not None
    dataset = dataset if given else Dataset.load(args.data, plan.data_inputs)
    check_ids(dataset, id_bounds(plan.model, plan.data_inputs))
    accumulation = micro_batches(plan, args.grad_accumulation)
    shard_size(args.batch, plan.world_size, accumulation)
    if args.batch > dataset.rows:
        raise RunError(f"--batch {args.batch} is larger than the {dataset.rows} rows of {args.data}: every batch would "
                       "repeat rows")
    if args.steps is not None and args.steps < 1:
        raise RunError(f"--steps must be >= 1, got {args.steps}")
    steps = args.steps if args.steps is not None else dataset.steps_for_epochs(args.epochs, args.batch)
    lr = plan.lr if args.lr is None else args.lr
    if not 0 <= lr < float("inf"):
        raise RunError(f"--lr must be a finite number >= 0, got {lr:g}")
    if args.seed < 0:
        raise RunError(f"--seed must be >= 0, got {args.seed}")
    if args.log_every < 0:
        raise RunError(f"--log-every must be >= 0, got {args.log_every}")
    # Output paths are checked now, not after training: a bad one would lose the run's result.
    export = output_file("--export", args.export)
    if export is not None and not plan.model.is_file():
        raise RunError(f"--export {args.export}: {plan.model} (the user's model in OUT) is missing")
    outputs = parse_outputs(args.outputs)
    if outputs:
        if export is None:
            raise RunError("--outputs needs --export FILE (the model it cuts)")
        check_outputs(load_graph(plan.model), outputs, str(plan.model))
    timings = output_file("--timings", args.timings)
    metrics = output_file("--metrics", args.metrics)
    tensorboard = tensorboard_dir(args.tensorboard)
    ckpt = None if args.checkpoint is None else checkpoint.check_target(Path(args.checkpoint))
    if args.checkpoint_every < 0:
        raise RunError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.checkpoint_every and args.checkpoint is None:
        raise RunError("--checkpoint-every needs --checkpoint DIR")
    if args.keep_checkpoints < 1:
        raise RunError(f"--keep-last must be >= 1, got {args.keep_checkpoints}")
    timeout = check_timeout(args.timeout)
    ep_options = parse_ep_options(args.ep_option)
    eval_data, eval_batch = _check_eval(args, plan, export)
    schedule = Schedule.from_options(args.lr_schedule, args.warmup_steps, min_lr=args.min_lr,
                                     step_size=args.lr_step_size, gamma=args.lr_gamma)
    schedule.validate(steps)
    resume = None
    if args.resume is not None:
        if args.resume == "latest":
            if ckpt is None:
                raise RunError("--resume latest needs --checkpoint DIR (the store to take the newest checkpoint from)")
            where = ckpt
        else:
            where = Path(args.resume).resolve()
        resume, meta = resumption.find_resume(where, plan, shuffle=args.shuffle, seed=args.seed)
        samples = checkpoint.samples_done(meta)
        if args.epochs is not None:  # the steps done, then the rows still to read at this run's batch
            steps = dataset.steps_for_epochs(args.epochs, args.batch, start=meta.step, samples=samples)
            schedule.validate(steps)
        if not args.override_schedule:
            resumption.check_schedule(resume, meta, (lr, dataclasses.asdict(schedule), steps))
        if meta.batch != args.batch:  # the rule of docs/reliability.md: the samples read are kept
            print(f"transpile: warning: --resume {resume}: written with --batch {meta.batch}, this run has --batch "
                  f"{args.batch}: steps {meta.step + 1}.. read {args.batch} samples each from sample {samples} of the "
                  "data stream (where the checkpoint stopped)", file=sys.stderr, flush=True)
        if meta.step > steps or (meta.step == steps and export is None):
            raise RunError(f"--resume {args.resume}: the checkpoint is at step {meta.step}, nothing to do for --steps {steps}"
                           + ("" if meta.step > steps else " (add --export FILE to write its trained model)"))
    config = RunConfig(batch=args.batch, steps=steps, lr=lr, grad_accumulation=accumulation, shuffle=args.shuffle,
                       seed=args.seed, schedule=schedule,
                       log_every=args.log_every, export=export, outputs=outputs,
                       checkpoint=ckpt, checkpoint_every=args.checkpoint_every, resume=resume,
                       keep_checkpoints=args.keep_checkpoints, timeout=timeout, timings=timings,
                       out=plan.out_dir.resolve(), data=None if given else Path(args.data).resolve(), backend=args.backend,
                       tf32=not args.no_tf32, ep_options=ep_options, eval_data=eval_data, eval_every=args.eval_every,
                       eval_batch=eval_batch, export_best=args.export_best, metrics=metrics, tensorboard=tensorboard,
                       progress=args.progress)
    return plan, dataset, config


def _check_eval(args: argparse.Namespace, plan: Plan, export: Path | None) -> tuple[Path | None, int]:
    """The evaluation options, checked (and EVAL.npz read and checked as --data is) before any
    rank starts: the resolved EVAL.npz (or None) and the global evaluation batch."""
    if args.eval_data is None:
        for given, option in ((args.eval_every, "--eval-every"), (args.eval_batch is not None, "--eval-batch"),
                              (args.export_best, "--export-best")):
            if given:
                raise RunError(f"{option} needs --eval-data EVAL.npz")
        return None, 0
    if args.export_best and export is None:
        raise RunError("--export-best needs --export TRAINED.onnx (the file the best parameters go to)")
    if args.eval_every < 0:
        raise RunError(f"--eval-every must be >= 0, got {args.eval_every}")
    batch = args.batch if args.eval_batch is None else args.eval_batch
    eval_batch_size(batch, plan.world_size, "--eval-batch" if args.eval_batch is not None else "--batch")
    load_eval_data(plan, args.eval_data)
    return Path(args.eval_data).resolve(), batch


def _raise(exc: RunError):
    raise exc


def _hosts(args: argparse.Namespace, world_size: int) -> list[Host] | None:
    """The hosts of --hostfile/--hosts (checked against the plan), or None for this host only."""
    if args.hostfile is None and args.hosts is None:
        return None
    hosts = parse_hostfile(args.hostfile) if args.hostfile is not None else parse_hosts(args.hosts)
    check_slots(hosts, world_size, f"--hostfile {args.hostfile}" if args.hostfile is not None else f"--hosts {args.hosts}")
    return hosts


def run_command(args: argparse.Namespace) -> int:
    launch = detect_launcher()
    try:
        args = options_file.complete(args)  # --config FILE and the defaults
    except RunError as exc:
        if launch is None:
            print(f"transpile: error: {exc}", file=sys.stderr)
            return 2
        error = exc
        return run_as_rank(lambda: _raise(error))  # each rank of a launcher's job: one line, through their agreement
    if launch is not None:
        # Already one rank of an mpirun/mpiexec/srun/torchrun job: run as that rank, spawn nothing.
        # Each rank resolves the arguments itself, inside the ranks' agreement on setup errors.
        if args.hostfile is not None or args.hosts is not None:
            print(f"transpile: error: --hostfile/--hosts: this process is already a rank started by {launch.launcher}, "
                  "which chose the hosts; drop the option (or run transpile run outside the launcher)",
                  file=sys.stderr)
            return 2
        # Its timeout is needed before setup (the watchdog, the torchrun bootstrap); an invalid one
        # is reported by resolve, once, through the ranks' agreement.
        try:
            timeout = check_timeout(args.timeout)
        except RunError:
            timeout = DEFAULT_TIMEOUT_S
        return run_as_rank(lambda: resolve(args), timeout=timeout)
    try:
        plan, dataset, config = resolve(args)
        hosts = _hosts(args, plan.world_size)
        # Rank 0 may run on another host, where this terminal's device is not: lines there.
        config = replace(config, **_view(config.progress if hosts is None else "lines"))
        if hosts is None:
            config = replace(config, backend=resolve_backend(config.backend))
            # On other hosts, each rank resolves "auto" and counts its host's GPUs itself (runtime/worker.py).
            if config.backend == "nccl":
                check_gpus(plan.world_size, f"the plan ({plan.world_size} rank(s), transpiled with --gpus {plan.world_size})")
            else:
                warn_oversubscribed(plan.world_size)
        lock = None if config.checkpoint is None else checkpoint.Lock(config.checkpoint)
        try:
            if plan.world_size == 1 and hosts is None:
                return _run_single(plan, dataset, config)
            sweep_run_directories()
            with tempfile.TemporaryDirectory(prefix=RUN_DIR_PREFIX, ignore_cleanup_errors=True) as tmp:
                # What the ranks must know of this process travels in their configuration: that we
                # started them and, on this host only, our token for their watchdogs to check and
                # the directory of their heartbeats (both mean nothing on another host).
                config = replace(config, spawned=True, **({"parent": parent_token(), "run_dir": Path(tmp)}
                                                          if hosts is None else {}))
                path = Path(tmp) / "config.json"  # the ranks read it at start-up, before any step
                (Path(tmp) / OWNER_FILE).write_text(parent_token() + "\n")  # for sweep_run_directories
                config.save(path)
                # Ranks on other hosts cannot read a file in this host's /tmp: they get it inline.
                given = ["--config", str(path)] if hosts is None else ["--config-json", json.dumps(config.to_json())]
                try:
                    return spawn(plan.world_size, given, run_dir=Path(tmp), hosts=hosts, timeout=config.timeout)
                finally:
                    if config.tty is not None:  # a rank killed mid-bar leaves the terminal's cursor hidden
                        print("\x1b[?25h", end="", flush=True)
        finally:
            if lock is not None:
                lock.release()
    except RunError as exc:
        if not isinstance(exc, PeerFailed):
            print(f"transpile: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file of the run (its run directory, OUT, the data) cannot be read or written
        print(f"transpile: error: {os_error_line(exc)}", file=sys.stderr)
        return 2


RUN_DIR_PREFIX = "transpile-run."
OWNER_FILE = "owner"  # in a run directory: the token of the `transpile run` that made it


def sweep_run_directories(temp: Path | None = None) -> None:
    """Remove the run directories ($TMPDIR/transpile-run.*) of earlier ``transpile run``s that
    are gone without removing theirs (kill -9, the OOM killer): only this user's own real
    directories (never through a symlink), whose owner token names a process that no longer runs,
    or that hold no token and are more than a day old (the run died before writing it)."""
    temp = Path(tempfile.gettempdir()) if temp is None else temp
    try:
        entries = [e for e in os.scandir(temp) if e.name.startswith(RUN_DIR_PREFIX)]
    except OSError:
        return
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
                continue
            try:
                token = (Path(entry.path) / OWNER_FILE).read_text().strip()
            except FileNotFoundError:
                token = None
            if token is not None and alive(token):
                continue
            if token is None and time.time() - info.st_mtime < 86400:
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            continue


def _view(progress: str) -> dict:
    """The progress view the ranks use, decided here: a spawned rank's stdout is mpiexec's pipe, so
    for a bar on this terminal rank 0 is given the terminal's device (runtime/progress.py)."""
    if progress == "lines" or (progress == "auto" and not sys.stdout.isatty()):
        return {"progress": "lines"}
    try:
        return {"progress": "bar", "tty": os.ttyname(sys.stdout.fileno())}
    except (OSError, ValueError):  # --progress bar without a terminal: draw into the pipe
        return {"progress": "bar"}


def warn_oversubscribed(ranks: int) -> None:
    """CPU ranks share this machine's cores: more ranks than cores makes every step slower than on
    fewer ranks (each collective waits for a descheduled rank), which is worth one line."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if ranks > cores:
        print(f"transpile: warning: {ranks} CPU ranks on {cores} core(s) that this process may use: the ranks take "
              f"turns and every step is slower; transpile with --gpus {cores} or fewer for a CPU run",
              file=sys.stderr, flush=True)


def _run_single(plan: Plan, dataset: Dataset, config: RunConfig) -> int:
    """A world of one runs in this process, without MPI."""
    if config.backend == "nccl":
        from runtime.gpu import GpuBackend, NcclCommunicator

        backend = GpuBackend(0, tf32=config.tf32, ep_options=config.ep_options)
        comm = NcclCommunicator(None, 0, timeout=config.timeout)
        trainer = Trainer(plan, comm, rank=0, backend=backend, accumulation=config.grad_accumulation)
        evaluator = make_evaluator(trainer, config)
        comm.connect()
        try:
            train(trainer, dataset, config, evaluator=evaluator)
        finally:
            comm.close()
        return 0
    trainer = Trainer(plan, LocalGroup(1).communicator(0), rank=0, backend=CpuBackend(),
                      accumulation=config.grad_accumulation)
    train(trainer, dataset, config, evaluator=make_evaluator(trainer, config))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime", description="Run transpiled data-parallel training.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_run_arguments(commands.add_parser("run", help="train on the graphs in a transpiler output directory"))
    args = parser.parse_args(argv)
    return run_command(args)


# The ``transpile run`` command (commands/) builds its parser and runs it through these two.
add_arguments = add_run_arguments
execute = run_command
