"""`python -m benchmarks compare`: PyTorch eager vs graph-transpiler's runtime on the same models.

    python -m benchmarks compare [--models gpt2_small,resnet18,perceptron] [--gpus 1]
        [--variants eager,fused,sdpa] [--ours-variants default,allreduce] [--ours-path DIR]
        [--steps N] [--windows 6] [--warmup N] [--work DIR] [--device auto|cuda|cpu]
    python -m benchmarks prepare ...same options...   # export + transpile only (CPU), fills --work
    python -m benchmarks render [JSONL ...] [--run ID] # re-render docs/benchmarks.md from results

Every (system, variant, model, world size) runs in its own process (clean device memory, its own
profiler, its own PYTHONPATH); each appends one JSON line to benchmarks/results/<date>-<host>.jsonl.
docs/benchmarks.md describes what is measured and how.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import bench_lib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "bench_worker.py"
DEFAULT_DOC = ROOT / "docs" / "benchmarks.md"
DEFAULT_IMAGE = ROOT / "docs" / "images" / "benchmarks.png"

# name -> kind, default config, per-GPU batch, optimizer (torch.optim and transpile get the same),
# steps per timed window. The defaults are the ("One GPU as fast as PyTorch").
MODELS = {
    "gpt2_small": {"kind": "gpt", "config": {"layers": 12, "width": 768, "heads": 12, "vocab": 50304, "seq": 512},
                   "batch": 8, "optimizer": {"name": "adamw", "lr": 1e-4, "weight_decay": 0.01},
                   "steps": 5, "warmup": 8},
    "resnet18": {"kind": "cnn", "config": {"width": 64, "depth": [2, 2, 2, 2], "image_size": 32},
                 "batch": 256, "optimizer": {"name": "momentum", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4},
                 "steps": 5, "warmup": 10},
    "perceptron": {"kind": "perceptron", "config": {}, "batch": 1000,
                   "optimizer": {"name": "momentum", "lr": 1e-4, "momentum": 0.9},
                   "steps": 50, "warmup": 20},
}
TORCH_VARIANTS = {
    "eager": "the module models/ exports, torch.optim defaults (foreach)",
    "fused": "the same module, optimizer fused=True",
    "sdpa": "GPT only: fused QKV + scaled_dot_product_attention (causal), fused AdamW",
    "compile": "torch.compile(module), fused optimizer (slow to start; not in the defaults)",
    "sdpa-compile": "GPT only: sdpa + torch.compile (not in the defaults)",
    "fused-bf16": "fused under torch.autocast(bfloat16): the match of ours with --precision bf16",
    "sdpa-bf16": "GPT only: sdpa under torch.autocast(bfloat16)",
    "cl-bf16": "CNN only: fused, channels-last module and images under torch.autocast(bfloat16): NVIDIA's AMP recipe",
    "sdpa-compile-bf16": "GPT only: sdpa-bf16 with torch.compile (not in the defaults)",
    "cl-compile-bf16": "CNN only: cl-bf16 with torch.compile (not in the defaults)",
}
GPT_ONLY = ("sdpa", "sdpa-compile", "sdpa-bf16", "sdpa-compile-bf16")
CNN_ONLY = ("cl-bf16", "cl-compile-bf16")
OURS_PRESETS = {
    "default": [],
    "allreduce": ["--strategy", "allreduce"],
    "sharded": ["--strategy", "sharded"],
    "zero": ["--strategy", "zero"],
    "hash": ["--strategy", "sharded", "--placement", "hash"],  # sharded's roots as before balanced became the default
    "bf16": ["--precision", "bf16"],
}


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- options ----------------------------------------------------------------------------------

ENV_FLAG = re.compile(r"[A-Z][A-Z0-9_]*=")  # an ours variant's flag that is an environment variable


def parse_ours_variant(spec: str, default_path: str | None) -> dict:
    """``LABEL``, ``LABEL=FLAGS`` or ``LABEL[=FLAGS]@DIR``: transpile flags (space-separated) and
    the source tree whose transpiler and runtime run it (DIR is put first on PYTHONPATH). A flag
    ``NAME=VALUE`` with an upper-case NAME is an environment variable of the row's processes
    (``cumem0=NCCL_CUMEM_ENABLE=0``), so one call A/Bs a setting of NCCL's or the runtime's; the
    row records it in ``env``, and its OUT is the one its transpile flags make.
    A preset label (default, allreduce, sharded, zero, hash, bf16) needs no flags; so does any
    label with @DIR (that tree's defaults)."""
    spec = original = spec.strip()
    path = default_path
    if "@" in spec:
        spec, path = spec.rsplit("@", 1)
    if "=" in spec:
        label, flags = spec.split("=", 1)
        flags = flags.split()
    else:
        label = spec
        if label not in OURS_PRESETS and "@" not in original:
            raise ValueError(f"--ours-variants: unknown preset {label!r} (presets: {', '.join(OURS_PRESETS)}; "
                             "or LABEL=--transpile-flags[@DIR])")
        flags = OURS_PRESETS.get(label, [])  # LABEL@DIR: that tree with no extra flags
    if not label:
        raise ValueError(f"--ours-variants: empty label in {spec!r}")
    env = dict(flag.split("=", 1) for flag in flags if ENV_FLAG.match(flag))
    flags = [flag for flag in flags if not ENV_FLAG.match(flag)]
    if path:
        tree = Path(path).expanduser().resolve()
        if not (tree / "runtime").is_dir() or not (tree / "transpiler").is_dir():
            raise ValueError(f"--ours-path {path}: not a graph-transpiler source tree (no runtime/ and transpiler/)")
        path = str(tree)
    return {"label": label, "flags": list(flags), "path": path, "env": env}


def model_settings(name: str, args) -> dict:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} (models: {', '.join(MODELS)})")
    m = json.loads(json.dumps(MODELS[name]))  # deep copy
    cfg = m["config"]
    if m["kind"] == "gpt":
        for key in ("layers", "width", "heads", "vocab", "seq"):
            if getattr(args, key) is not None:
                cfg[key] = getattr(args, key)
    if m["kind"] == "cnn":
        if args.cnn_width is not None:
            cfg["width"] = args.cnn_width
        if args.cnn_depth is not None:
            cfg["depth"] = [int(d) for d in args.cnn_depth.split(",")]
        if args.image_size is not None:
            cfg["image_size"] = args.image_size
    if args.batch is not None:
        m["batch"] = args.batch
    for key in ("steps", "warmup"):
        if getattr(args, key) is not None:
            m[key] = getattr(args, key)
    m["name"] = name
    return m


def describe(m: dict) -> str:
    c, o = m["config"], m["optimizer"]
    if m["kind"] == "gpt":
        shape = f"GPT {c['layers']}x{c['width']}, {c['heads']} heads, vocab {c['vocab']}, seq {c['seq']}"
    elif m["kind"] == "cnn":
        shape = f"ResNet width {c['width']}, blocks {c['depth']}, {c['image_size']}x{c['image_size']} images"
    else:
        shape = "perceptron 10-100-1, MSE"
    opt = ("AdamW" if o["name"] == "adamw" else "SGD") + f" lr {o['lr']:g}"
    opt += f" momentum {o['momentum']:g}" if o.get("momentum") else ""
    opt += f" wd {o['weight_decay']:g}" if o.get("weight_decay") else ""
    return f"{shape}; batch {m['batch']} per rank; {opt}; {m['windows']} windows x {m['steps']} steps after {m['warmup']} warm-up"


def transpile_flags(opt: dict) -> list[str]:
    flags = ["--optimizer", opt["name"], "--lr", repr(opt["lr"])]
    if opt["name"] == "momentum":
        flags += ["--momentum", repr(opt["momentum"])]
    if opt.get("weight_decay") is not None:
        flags += ["--weight-decay", repr(opt["weight_decay"])]
    return flags


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:10]


SOURCE_DIRS = ("transpiler", "runtime", "contract")  # the code an ours row runs (a prev@DIR tree holds these)


def source_digest(tree: Path) -> str:
    """A digest of the code an ours row runs: every .py under SOURCE_DIRS of ``tree``, by relative
    path and content. A commit alone does not name it: a copy of a working tree may carry stale git
    metadata (the GPU host's copy did: every row said the session's first commit, "-dirty") or
    uncommitted edits. ``git archive C transpiler runtime contract`` of a commit C has C's digest."""
    h = hashlib.sha256()
    for sub in SOURCE_DIRS:
        for path in sorted((tree / sub).rglob("*.py")):
            h.update(path.relative_to(tree).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def git_commit(tree: Path) -> str | None:
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def run_env() -> dict[str, str]:
    """The variables a row ran under that may change what it measures (NCCL's, the runtime's own),
    but those every row sets alike: an experiment's rows (``NCCL_MAX_CTAS=8``) say so themselves."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(("NCCL_", "GRAPH_TRANSPILER_", "CUBLAS_")) and k != "NCCL_NVLS_ENABLE"}


def child_env(tree: str | None, device: str, extra: dict[str, str] | None = None) -> dict:
    env = {**os.environ, **(extra or {})}
    env["NCCL_NVLS_ENABLE"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    first = tree or str(ROOT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (first, env.get("PYTHONPATH", "")) if p)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def detect_device(choice: str) -> str:
    if choice != "auto":
        return choice
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, timeout=120)
    try:
        return "cuda" if probe.returncode == 0 and int(probe.stdout.split()[-1]) > 0 else "cpu"
    except (ValueError, IndexError):
        return "cpu"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(cmd: list[str], env: dict, cwd: Path, timeout: float, log_path: Path) -> tuple[int, float]:
    """Run in its own session; kill the whole group on timeout. Output goes to log_path."""
    started = time.perf_counter()
    with log_path.open("w") as out:
        job = subprocess.Popen(cmd, env=env, cwd=str(cwd), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = job.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(job.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            job.wait()
            code = 124
        except BaseException:
            try:
                os.killpg(job.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise
    return code, time.perf_counter() - started


def tail(path: Path, n: int = 3) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-600:]


def mpiexec_prefix(n: int) -> list[str]:
    from runtime.launcher import find_mpiexec, mpiexec_command, mpiexec_flavor

    mpiexec = find_mpiexec()
    cmd = mpiexec_command(mpiexec, mpiexec_flavor(mpiexec), n, [])
    return cmd[:cmd.index("-m")]


def _rows_in_name(name: str) -> int | None:
    """R of a data file named data-R.npz (None for any other name: a partial .tmp.npz)."""
    match = re.fullmatch(r"data-(\d+)\.npz", name)
    return int(match.group(1)) if match else None


# -- the command ------------------------------------------------------------------------------

class Session:
    def __init__(self, args):
        self.args = args
        self.device = detect_device(args.device)
        self.gpus = [int(g) for g in str(args.gpus).split(",") if g.strip()]
        if not self.gpus or min(self.gpus) < 1:
            raise ValueError("--gpus: a comma-separated list of world sizes >= 1")
        if args.repeat < 1:
            raise ValueError(f"--repeat: a number of rounds >= 1, got {args.repeat}")
        self.models = [model_settings(n.strip(), args) for n in args.models.split(",") if n.strip()]
        for m in self.models:
            m["windows"] = args.windows
        self.variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else []
        for v in self.variants:
            if v not in TORCH_VARIANTS:
                raise ValueError(f"--variants: unknown {v!r} (variants: {', '.join(TORCH_VARIANTS)})")
        specs = [s for s in (args.ours_variants.split(",") if args.ours_variants else []) if s.strip()]
        specs += args.ours_variant or []
        self.ours = [parse_ours_variant(s, args.ours_path) for s in specs]
        labels = [o["label"] for o in self.ours]
        if len(set(labels)) != len(labels):
            raise ValueError(f"--ours-variants: labels must differ ({', '.join(labels)})")
        self.work = Path(args.work or (Path.home() / ".cache" / "graph-transpiler-bench")).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        now = dt.datetime.now(dt.timezone.utc)
        self.host = args.host or platform.node().split(".")[0] or "host"
        self.date = now.strftime("%Y-%m-%d")
        self.run_id = args.run_id or (now.strftime("%Y%m%dT%H%M%SZ") + "-" + self.host)
        self.results = Path(args.results or (HERE / "results" / f"{self.date}-{self.host}.jsonl"))
        self.commit = git_commit(ROOT)
        self._trees: dict[str, tuple[str | None, str]] = {}  # see tree()
        self.logs = self.work / "logs" / self.run_id
        self.logs.mkdir(parents=True, exist_ok=True)
        self.records: list[dict] = []

    # paths
    def model_dir(self, m: dict) -> Path:
        return self.work / "models" / f"{m['name']}-{digest([m['kind'], m['config'], self.args.seed])}"

    def data_path(self, m: dict) -> Path:
        """The model's data: the smallest file already in --work with rows enough for the largest
        world (rank r reads rows [r*B, (r+1)*B)), else a new one with exactly those. So a call with
        fewer GPUs than the `prepare` before it measures the prepared data, not data of its own
        (whose export took the model's time again), and its rank 0 reads what the larger world's did."""
        needed = m["batch"] * max(self.gpus)
        held = sorted((rows, path) for path in self.model_dir(m).glob("data-*.npz")
                      if (rows := _rows_in_name(path.name)) is not None and rows >= needed)
        return held[0][1] if held else self.model_dir(m) / f"data-{needed}.npz"

    def out_dir(self, m: dict, ours: dict, gpus: int) -> Path:
        tree, (_, source) = self.tree(ours)
        key = digest([m["optimizer"], ours["flags"], str(tree), source])
        # No label in the name: variants that differ only in their label (rows run under another
        # environment, say NCCL_* variables) share one transpiled OUT.
        return self.model_dir(m) / f"out-g{gpus}-{key}"

    def tree(self, ours: dict) -> tuple[Path, tuple[str | None, str]]:
        """The source tree an ours variant runs, and its (commit, source digest), read once per run:
        an edit made while the run goes on must not send its timing rows to a directory its
        transpile step never wrote."""
        tree = Path(ours["path"]) if ours["path"] else ROOT
        if str(tree) not in self._trees:
            self._trees[str(tree)] = (self.commit if tree == ROOT else git_commit(tree), source_digest(tree))
        return tree, self._trees[str(tree)]

    def write_spec(self, name: str, spec: dict) -> Path:
        path = self.logs / f"{name}.spec.json"
        path.write_text(json.dumps(spec, indent=1))
        return path

    # phases
    def prepare(self) -> dict[tuple, str]:
        """Export every model (in parallel) and transpile every (model, ours variant, world size);
        returns the transpile errors keyed by (model, label, gpus)."""
        jobs = []
        for m in self.models:
            if (self.model_dir(m) / "model.onnx").exists() and self.data_path(m).exists():
                continue
            spec = {"kind": m["kind"], "config": m["config"], "seed": self.args.seed, "dir": str(self.model_dir(m)),
                    "rows": m["batch"] * max(self.gpus), "data": str(self.data_path(m))}
            jobs.append((m["name"], [sys.executable, str(WORKER), "export", str(self.write_spec(f"export-{m['name']}", spec))]))
        errors: dict[tuple, str] = {}
        if jobs:
            log(f"exporting {', '.join(n for n, _ in jobs)} (PyTorch -> ONNX, CPU)")
            with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                done = list(pool.map(lambda j: (j[0], run_child(j[1], child_env(None, "cpu"), self.work, self.args.prepare_timeout,
                                                                self.logs / f"export-{j[0]}.log")), jobs))
            for name, (code, secs) in done:
                log(f"export {name}: {'ok' if code == 0 else 'FAILED'} in {secs:.0f} s")
                if code != 0:
                    raise SystemExit(f"benchmarks: export of {name} failed: {tail(self.logs / f'export-{name}.log')}")
        jobs, planned = [], set()
        for m in self.models:
            for g in self.gpus:
                for o in self.ours:
                    out = self.out_dir(m, o, g)
                    if out in planned or ((out / "plan.json").exists() and not self.args.fresh):
                        continue
                    planned.add(out)
                    if out.exists():
                        shutil.rmtree(out)
                    cmd = [sys.executable, "-m", "transpiler.cli", str(self.model_dir(m) / "model.onnx"), "-o", str(out),
                           "--gpus", str(g), *transpile_flags(m["optimizer"]), *o["flags"]]
                    jobs.append(((m["name"], o["label"], g), cmd, o["path"]))
        if jobs:
            log(f"transpiling {len(jobs)} plan(s), {self.args.jobs} at a time: "
                + ", ".join(f"{n}/{lab}/g{g}" for (n, lab, g), _, _ in jobs))

            def one(job):
                (name, label, g), cmd, tree = job
                return job[0], run_child(cmd, child_env(tree, "cpu"), self.work, self.args.prepare_timeout,
                                         self.logs / f"transpile-{name}-{label}-g{g}.log")
            with ThreadPoolExecutor(max_workers=self.args.jobs) as pool:
                for key, (code, secs) in pool.map(one, jobs):
                    name, label, g = key
                    logfile = self.logs / f"transpile-{name}-{label}-g{g}.log"
                    log(f"transpile {name} [{label}] for {g} rank(s): {'ok' if code == 0 else 'FAILED'} in {secs:.0f} s")
                    if code != 0:
                        errors[key] = f"transpile failed (exit {code}): {tail(logfile)}"
        return errors

    def measure(self, system: str, variant: str, m: dict, gpus: int, ours: dict | None, error: str | None,
                round_: int | None = None) -> dict:
        env = (ours or {}).get("env", {})  # the variant's own environment variables
        base = {"run": self.run_id, "date": self.date, "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "host": self.host, "system": system, "variant": variant,
                "model": m["name"], "gpus": gpus, "device": self.device, "batch": m["batch"],
                "dtype": "float32, TF32 matmul/conv" if self.device == "cuda" else "float32",
                "config": describe(m), "commit": self.commit, "mem_method": "device used (cudaMemGetInfo) after the "
                "timed steps minus after CUDA context creation", "steps_per_window": m["steps"],
                "windows": m["windows"], "warmup": m["warmup"], "env": {**run_env(), **env}}
        if round_ is not None:  # --repeat: the row's round (bench_lib._series shows the median one)
            base["round"] = round_
        if ours is not None:
            _, (commit, source) = self.tree(ours)
            base.update(transpile_flags=ours["flags"], ours_path=ours["path"], ours_commit=commit, ours_source=source)
        label = f"{system}/{variant}/{m['name']}/g{gpus}" + (f"/round{round_}" if round_ is not None else "")
        if error is None and self.device == "cuda":
            have = self.gpu_count()
            if gpus > have:
                error = f"needs {gpus} GPUs, this machine has {have}"
        if error is None and system == "pytorch" and (variant in GPT_ONLY and m["kind"] != "gpt"
                                                       or variant in CNN_ONLY and m["kind"] != "cnn"):
            return {}
        if error is not None:
            record = bench_lib.make_record(base, None, error)
            log(f"{label}: not run: {error}")
        else:
            result = self.logs / f"{label.replace('/', '-')}.json"
            spec = {"kind": m["kind"], "config": m["config"], "seed": self.args.seed, "variant": variant,
                    "batch": m["batch"], "optimizer": m["optimizer"], "gpus": gpus, "device": self.device,
                    "data": str(self.data_path(m)), "model": str(self.model_dir(m) / "model.onnx"),
                    "out": str(self.out_dir(m, ours, gpus)) if ours else None, "steps": m["steps"],
                    "windows": m["windows"], "warmup": m["warmup"], "port": free_port(), "result": str(result),
                    "profile_steps": self.args.profile_steps if self.device == "cuda" else 0,
                    "threads": self.args.threads, "traces": self.args.traces}
            spec_path = self.write_spec(label.replace("/", "-"), spec)
            mode = "torch" if system == "pytorch" else "ours"
            cmd = [sys.executable, str(WORKER), mode, str(spec_path)]
            if gpus > 1:
                cmd = mpiexec_prefix(gpus) + cmd[1:]
            log(f"{label}: running")
            logfile = self.logs / f"{label.replace('/', '-')}.log"
            code, secs = run_child(cmd, child_env(ours["path"] if ours else None, self.device, env), self.work,
                                   self.args.child_timeout, logfile)
            measured, err = None, None
            if code == 0 and result.exists():
                measured = json.loads(result.read_text())
            else:
                errs = sorted(result.parent.glob(result.name + ".error*"))
                err = (errs[0].read_text() if errs else
                       ("timed out after %d s" % self.args.child_timeout if code == 124 else f"exit {code}: {tail(logfile)}"))
            record = bench_lib.make_record(base, measured, err)
            record["wall_s"] = round(secs, 1)
            if measured:
                log(f"{label}: {record['step_ms']:.3f} ms/step (p90 {record['p90_ms']:.3f})"
                    + (f", {record['kernels_per_step']:.0f} kernels/step, {record['gpu_kernel_ms']:.2f} ms kernels"
                       if record.get("kernels_per_step") is not None else "")
                    + (f", {record['peak_mem_gib']:.2f} GiB" if record.get("peak_mem_gib") is not None else "")
                    + f", first loss {record.get('first_loss')}, {secs:.0f} s")
            else:
                log(f"{label}: FAILED: {err} (log {logfile})")
        bench_lib.append_jsonl(self.results, record)
        self.records.append(record)
        return record

    _gpu_count = None

    def gpu_count(self) -> int:
        if self._gpu_count is None:
            probe = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
            self._gpu_count = sum(1 for line in probe.stdout.splitlines() if line.startswith("GPU "))
        return self._gpu_count

    def run(self) -> int:
        log(f"run {self.run_id}: device {self.device}, models {', '.join(m['name'] for m in self.models)}, "
            f"gpus {self.gpus}, pytorch {self.variants}, ours {[o['label'] for o in self.ours]}; work {self.work}")
        errors = self.prepare()
        repeat = self.args.repeat
        for m in self.models:
            for g in self.gpus:
                # Rounds interleave the rows (every row once, then again): a drift of the machine
                # over the call (clocks, another tenant) reaches every row alike, not one row's rounds.
                for round_ in range(repeat):
                    tag = round_ if repeat > 1 else None
                    for v in self.variants:
                        self.measure("pytorch", v, m, g, None, None, tag)
                    for o in self.ours:
                        self.measure("graph-transpiler", o["label"], m, g, o, errors.get((m["name"], o["label"], g)), tag)
        log(f"results appended to {self.results}")
        if self.records and not self.args.no_docs:
            # every row of this run id, earlier calls with the same --run-id included
            render(bench_lib.select_run(bench_lib.load_jsonl([self.results]), self.run_id),
                   Path(self.args.docs), Path(self.args.image))
        shown = bench_lib.select_run(self.records, self.run_id) if self.records else []
        print(bench_lib.render_table(shown), flush=True)
        print(bench_lib.render_summary(shown), flush=True)
        return 0 if all(not r.get("error") for r in self.records) else 1


def render(records: list[dict], doc: Path, image: Path) -> None:
    image_ref = os.path.relpath(image, doc.parent)
    try:
        bench_lib.plot(records, image)
    except ImportError:
        log("matplotlib missing: no chart")
        image_ref = None
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(bench_lib.update_doc(text, bench_lib.render_section(records, image_ref)))
    log(f"rendered {doc}" + (f" and {image}" if image_ref else ""))


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="gpt2_small,resnet18,perceptron", help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--gpus", default="1", help="world sizes, comma-separated (e.g. 1,2,4); default 1")
    p.add_argument("--variants", default="eager,fused,sdpa",
                   help="PyTorch rows: " + "; ".join(f"{k}: {v}" for k, v in TORCH_VARIANTS.items()) + " ('' for none)")
    p.add_argument("--ours-variants", default="default",
                   help="graph-transpiler rows, comma-separated LABEL[=TRANSPILE FLAGS][@DIR] (a flag NAME=VALUE with an "
                        "upper-case NAME: an environment variable of the row's processes); presets: "
                        + ", ".join(f"{k} ({' '.join(v) or 'no flags'})" for k, v in OURS_PRESETS.items()) + " ('' for none)")
    p.add_argument("--ours-variant", action="append", metavar="SPEC", help="one more ours row (a SPEC with commas)")
    p.add_argument("--ours-path", help="source tree (a checkout) whose transpiler and runtime run the ours rows "
                                       "without their own @DIR (put first on PYTHONPATH in their processes)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--steps", type=int, help="steps per timed window (default: 5; perceptron 50)")
    p.add_argument("--windows", type=int, default=6, help="timed windows (default 6)")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure every row this many times, in rounds (each row once, then again), each a record "
                        "with its round; tables show each row's median round and the range (default 1)")
    p.add_argument("--warmup", type=int, help="warm-up steps before timing (default: 8 GPT, 10 ResNet, 20 perceptron)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps recorded by torch.profiler on GPU (0: none)")
    p.add_argument("--traces", action="store_true",
                   help="with --profile-steps: each rank also writes its Chrome trace (host calls and GPU activity on "
                        "one clock) beside the row's result in --work's logs")
    p.add_argument("--batch", type=int, help="per-GPU batch, every model (default: 8 GPT, 256 ResNet, 1000 perceptron)")
    for key in ("layers", "width", "heads", "vocab", "seq"):
        p.add_argument(f"--{key}", type=int, help=f"GPT {key} (default GPT-2-small's)")
    p.add_argument("--cnn-width", type=int, help="ResNet width (default 64)")
    p.add_argument("--cnn-depth", help="ResNet blocks per stage (default 2,2,2,2)")
    p.add_argument("--image-size", type=int, help="ResNet image size (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="CPU threads per process (torch and onnxruntime; CPU device)")
    p.add_argument("--work", help="cache of exported models and transpiled OUTs (default ~/.cache/graph-transpiler-bench)")
    p.add_argument("--fresh", action="store_true", help="transpile again even when --work has the OUT")
    p.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)), help="parallel transpiles")
    p.add_argument("--child-timeout", type=float, default=300, help="seconds per measured process (default 300)")
    p.add_argument("--prepare-timeout", type=float, default=900, help="seconds per export/transpile (default 900)")
    p.add_argument("--results", help="JSONL to append to (default benchmarks/results/<date>-<host>.jsonl)")
    p.add_argument("--run-id", help="run id of the records (default: UTC time and host); give the same id to "
                                     "several calls to render their rows together")
    p.add_argument("--host", help="host name in the records (default: this machine's)")
    p.add_argument("--docs", default=str(DEFAULT_DOC), help="markdown file to render into (default docs/benchmarks.md)")
    p.add_argument("--image", default=str(DEFAULT_IMAGE), help="chart PNG (default docs/images/benchmarks.png)")
    p.add_argument("--no-docs", action="store_true", help="do not render the docs")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", required=True)
    for name, text in (("compare", "export, transpile, time every row, append JSONL, render docs"),
                       ("prepare", "export and transpile only (no timing; CPU)")):
        add_options(sub.add_parser(name, help=text, description=text))
    r = sub.add_parser("render", help="re-render docs/benchmarks.md from JSONL results")
    r.add_argument("jsonl", nargs="*", help="result files (default: every benchmarks/results/*.jsonl)")
    r.add_argument("--run", help="run id to show (default: the latest)")
    r.add_argument("--docs", default=str(DEFAULT_DOC))
    r.add_argument("--image", default=str(DEFAULT_IMAGE))
    args = top.parse_args(argv)
    if args.command == "render":
        files = args.jsonl or sorted((HERE / "results").glob("*.jsonl"))
        if not files:
            print("python -m benchmarks render: no JSONL results", file=sys.stderr)
            return 2
        try:
            records = bench_lib.select_run(bench_lib.load_jsonl(files), args.run)
        except ValueError as exc:
            print(f"python -m benchmarks render: {exc}", file=sys.stderr)
            return 2
        render(records, Path(args.docs), Path(args.image))
        return 0
    try:
        session = Session(args)
    except ValueError as exc:
        print(f"python -m benchmarks {args.command}: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "prepare":
        errors = session.prepare()
        for key, err in errors.items():
            log(f"{'/'.join(map(str, key))}: {err}")
        log(f"prepared {session.work}")
        return 1 if errors else 0
    return session.run()
