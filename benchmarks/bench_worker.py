"""Child processes of `python -m benchmarks compare` (run as a FILE, never with -m, so that an
``--ours-path`` tree given first on PYTHONPATH supplies ``runtime``/``transpiler``).

    python benchmarks/bench_worker.py export SPEC.json     # write model.onnx + data.npz (CPU)
    python benchmarks/bench_worker.py torch SPEC.json      # time PyTorch, write the result JSON
    python benchmarks/bench_worker.py ours SPEC.json       # time the project's runtime, write the result JSON

With more than one rank, ``torch`` and ``ours`` run under mpiexec (one process per GPU / CPU rank);
rank 0 writes the result (the slowest rank's step time). SPEC is written by benchmarks/compare.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import bench_lib  # sibling file: sys.path[0] is this directory when run as a script
import numpy as np

# ---------------------------------------------------------------------------------------------
# models


def _gpt_config(cfg: dict):
    from models.gpt import GPTConfig

    return GPTConfig(**{k: cfg[k] for k in ("layers", "width", "heads", "vocab", "seq") if k in cfg})


def _cnn_config(cfg: dict):
    from models.cnn import CNNConfig

    return CNNConfig(width=cfg.get("width", 64), depth=tuple(cfg.get("depth", (2, 2, 2, 2))),
                     image_size=cfg.get("image_size", 32))


def export(spec: dict) -> None:
    """model.onnx from the very module PyTorch is timed on, and data.npz (rows = batch * gpus)."""
    out = Path(spec["dir"])
    out.mkdir(parents=True, exist_ok=True)
    kind, seed, rows = spec["kind"], spec["seed"], spec["rows"]
    model_path = out / "model.onnx"
    if not model_path.exists():
        tmp = out / "model.tmp.onnx"
        if kind == "gpt":
            from models import gpt

            gpt.export(gpt.make_module(_gpt_config(spec["config"]), seed), tmp)
        elif kind == "cnn":
            from models import cnn

            cnn.export(cnn.make_module(_cnn_config(spec["config"]), seed), tmp)
        else:
            import onnx

            from models import perceptron

            onnx.save(perceptron.build(seed), tmp)
        os.replace(tmp, model_path)
    data_path = Path(spec["data"])
    if not data_path.exists():
        if kind == "gpt":
            from models import gpt

            data = gpt.make_data(_gpt_config(spec["config"]), seed, rows)
        elif kind == "cnn":
            from models import cnn

            data = cnn.make_data(_cnn_config(spec["config"]), seed, rows)
        else:
            from models import perceptron

            data = perceptron.make_data(seed, rows)
        tmp = data_path.with_suffix(".tmp.npz")
        np.savez(tmp, **data)
        os.replace(tmp, data_path)


INPUTS = {"gpt": ("tokens", "targets"), "cnn": ("images", "labels"), "perceptron": ("X", "Y")}


def sdpa_gpt(module):
    """models/gpt.py's GPT with each attention replaced by fused QKV + scaled_dot_product_attention
    (causal), starting from the same weights: the same function, the layout PyTorch users write."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class SdpaAttention(nn.Module):
        def __init__(self, old):
            super().__init__()
            c = old.q.in_features
            self.heads = old.heads
            self.qkv = nn.Linear(c, 3 * c)
            self.proj = old.proj
            with torch.no_grad():
                self.qkv.weight.copy_(torch.cat([old.q.weight, old.k.weight, old.v.weight]))
                self.qkv.bias.copy_(torch.cat([old.q.bias, old.k.bias, old.v.bias]))

        def forward(self, x):
            b, t, c = x.shape
            h = self.heads
            qkv = self.qkv(x).view(b, t, 3, h, c // h).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, c))

    for block in module.blocks:
        block.attn = SdpaAttention(block.attn)
    return module


def torch_module(spec: dict):
    kind, variant = spec["kind"], spec["variant"]
    if kind == "gpt":
        from models import gpt

        module = gpt.make_module(_gpt_config(spec["config"]), spec["seed"])
        if variant.startswith("sdpa"):
            module = sdpa_gpt(module)
    elif kind == "cnn":
        from models import cnn

        module = cnn.make_module(_cnn_config(spec["config"]), spec["seed"])
    else:
        from models.torch_twins import twin_for

        module = twin_for("perceptron", spec["model"])
    return module.train()


def torch_optimizer(spec: dict, params, device: str):
    import torch

    opt = spec["optimizer"]
    extra = {}
    if spec["variant"] != "eager":
        extra["fused"] = True  # fused, sdpa, compile: the fastest optimizer torch offers
    if opt["name"] == "adamw":
        return torch.optim.AdamW(params, lr=opt["lr"], weight_decay=opt.get("weight_decay", 0.01), **extra)
    return torch.optim.SGD(params, lr=opt["lr"], momentum=opt.get("momentum", 0.0),
                           weight_decay=opt.get("weight_decay", 0.0), **extra)


# ---------------------------------------------------------------------------------------------
# ranks


class Ranks:
    """Rank, world size and local rank: MPI under mpiexec (world > 1), else a world of one."""

    def __init__(self, world: int):
        self.world = world
        self.comm = None
        self.rank = self.local = 0
        if world > 1:
            from mpi4py import MPI

            self.comm = MPI.COMM_WORLD
            if self.comm.Get_size() != world:
                raise SystemExit(f"bench_worker: expected {world} ranks, mpiexec started {self.comm.Get_size()}")
            self.rank = self.comm.Get_rank()
            local = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
            self.local = local.Get_rank()
            local.Free()

    def gather(self, value):
        return self.comm.gather(value, root=0) if self.comm is not None else [value]

    def barrier(self):
        if self.comm is not None:
            self.comm.Barrier()


def shard(spec: dict, rank: int) -> dict[str, np.ndarray]:
    b = spec["batch"]
    data = np.load(spec["data"])
    return {k: np.ascontiguousarray(data[k][rank * b:(rank + 1) * b]) for k in INPUTS[spec["kind"]]}


def timed_windows(step, sync, spec: dict) -> list[float]:
    times = []
    n = spec["steps"]
    for _ in range(spec["windows"]):
        sync()
        started = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        times.append((time.perf_counter() - started) * 1e3)
    return bench_lib.window_means(times, n)


def kernel_profile(step, sync, steps: int, trace: str | None = None) -> dict:
    """CUDA activity of ``steps`` steps recorded by torch.profiler (CUPTI): it lists onnxruntime's
    and NCCL's kernels too, since they run in this process. ``trace``: also write the Chrome trace
    there (host calls and device activity on one clock: chrome://tracing or Perfetto).

    One step runs under the profiler before the recorded ones (its ``warmup``, discarded): each rank
    starts its profiler at its own time (up to 1.7 s apart on 4 H200s, run h200x4-s37), so a
    rank's first profiled collective waits for the slowest rank's profiler, and that wait counted
    as NCCL time (hundreds of ms per step in the rows before). The collectives of that step line
    the ranks up again."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    kept: list = []

    def keep(prof):
        if trace:
            prof.export_chrome_trace(trace)
        # The device events, less the GPU-side copy of each ``bench_step`` range (a user annotation,
        # not a kernel: counted, it added a kernel and its span to every step).
        kept.extend(e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.name != bench_lib.STEP_RANGE)

    step()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], on_trace_ready=keep,
                 schedule=schedule(wait=0, warmup=1, active=1, repeat=1)) as prof:
        step()
        sync()
        prof.step()  # the warm-up step ends: the recorded ones begin (one profiler step for all of them)
        for _ in range(steps):
            with torch.profiler.record_function(bench_lib.STEP_RANGE):  # trace_steps.py splits the trace at these
                step()
        sync()
        prof.step()  # the recorded steps end: keep() runs
    events = kept
    summary = bench_lib.kernel_summary([(e.name, float(e.time_range.elapsed_us())) for e in events], steps)
    summary.update(bench_lib.timeline_summary(
        [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in events], steps))
    return summary


def used_bytes(mem_get_info) -> int:
    free, total = mem_get_info()
    return int(total) - int(free)


def process_memory(device: int) -> dict:
    """``device_processes_gib``: every process with memory on ``device`` as NVML lists it, ``"self"``
    for this one (what the device's used memory holds besides this process: another rank's
    context, say); ``device_process_commands``: the command line of each other one (``finish``
    names the run's own ranks ``rank K``), so a row tells a peer rank's context from the harness's;
    ``nvml_process_gib``: this one's. None where pynvml is not there."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        pids = {int(p.pid): round(int(p.usedGpuMemory or 0) / GIB, 3) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    except Exception:
        return {"device_processes_gib": None, "device_process_commands": None, "nvml_process_gib": None,
                "pid": os.getpid()}
    every = {("self" if pid == os.getpid() else str(pid)): gib for pid, gib in pids.items()}
    commands = {str(pid): _command(pid) for pid in pids if pid != os.getpid()}
    return {"device_processes_gib": every, "device_process_commands": commands, "nvml_process_gib": every.get("self"),
            "pid": os.getpid()}


def _command(pid: int) -> str:
    """The first 120 characters of process ``pid``'s command line (this host's /proc), or "?"."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


GIB = 2.0 ** 30


def run_torch(spec: dict) -> dict:
    import torch

    ranks = Ranks(spec["gpus"])
    cuda = spec["device"] == "cuda"
    result: dict = {"torch_version": torch.__version__}
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
        torch.cuda.set_device(ranks.local)
        device = torch.device("cuda", ranks.local)
        base_used = used_bytes(torch.cuda.mem_get_info)
        result["device_name"] = torch.cuda.get_device_name(ranks.local)
    else:
        device = torch.device("cpu")
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
    module = torch_module(spec).to(device)
    # cl-bf16: channels-last weights and images (NHWC), which cuDNN's bf16 convolutions run fastest.
    layout = torch.channels_last if spec["variant"].startswith("cl-") else torch.contiguous_format
    module = module.to(memory_format=layout)
    if "compile" in spec["variant"].split("-"):  # compile, sdpa-compile, sdpa-compile-bf16, cl-compile-bf16
        module = torch.compile(module)
    net = module
    if ranks.world > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{spec['port']}",
                                rank=ranks.rank, world_size=ranks.world)
        net = torch.nn.parallel.DistributedDataParallel(module, device_ids=[ranks.local] if cuda else None)
    opt = torch_optimizer(spec, module.parameters(), spec["device"])
    host = {k: torch.from_numpy(v) for k, v in shard(spec, ranks.rank).items()}
    if cuda:
        host = {k: v.pin_memory() for k, v in host.items()}
    dev = {k: torch.empty_like(v, device=device, memory_format=layout if v.dim() == 4 else torch.contiguous_format)
           for k, v in host.items()}
    names = INPUTS[spec["kind"]]
    losses = []
    # The -bf16 rows: torch's mixed precision as users run it (fp32 master weights, bf16 compute).
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if spec["variant"].endswith("-bf16")
                else contextlib.nullcontext())

    def step():
        # The batch comes from (pinned) host memory every step, as the runtime's does.
        for k in names:
            dev[k].copy_(host[k], non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = net(dev[names[0]], dev[names[1]])
        loss.backward()
        opt.step()
        return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    losses.append(float(step().item()))
    for _ in range(spec["warmup"] - 1):
        step()
    sync()
    result["windows_ms"] = timed_windows(step, sync, spec)
    if cuda:
        result["mem_used_delta_gib"] = round((used_bytes(torch.cuda.mem_get_info) - base_used) / GIB, 3)
        result["torch_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        result["torch_max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
        result.update(process_memory(ranks.local))
        if spec["profile_steps"] > 0:
            trace = spec["result"] + f".rank{ranks.rank}.trace.json" if spec.get("traces") else None
            result.update(kernel_profile(step, sync, spec["profile_steps"], trace))
    result["first_loss"] = losses[0]
    out = finish(ranks, result)
    if ranks.world > 1:
        torch.distributed.destroy_process_group()
    return out


def run_ours(spec: dict) -> dict:
    import onnxruntime

    from runtime.plan import load_plan
    from runtime.trainer import Trainer

    ranks = Ranks(spec["gpus"])
    cuda = spec["device"] == "cuda"
    result: dict = {"ort_version": onnxruntime.__version__, "runtime_file": str(Path(sys.modules["runtime.plan"].__file__).parent)}
    plan = load_plan(spec["out"])
    # The bucket cap the OUT was made with (a default cap now follows the model: transpiler/bucketing.py),
    # and the tables it sends as rows (--sparse-grads); an @DIR tree's plan may lack either.
    raw = getattr(plan, "raw", {}) or {}
    result["bucket_mb"], result["sparse_gradients"] = raw.get("bucket_mb"), raw.get("sparse_gradients", [])
    host_comm = None
    if ranks.world > 1:
        from runtime.collectives.mpi import MpiCommunicator

        host_comm = MpiCommunicator()
    started = time.perf_counter()
    if cuda:
        import cupy

        cupy.cuda.Device(ranks.local).use()
        base_used = used_bytes(cupy.cuda.runtime.memGetInfo)
        from skipping import skippable_nccl, skips  # sibling file, like bench_lib (an @DIR tree may lack it)

        from runtime.gpu import GpuBackend

        backend = GpuBackend(ranks.local, tf32=True)
        comm = skippable_nccl(host_comm, ranks.local)
        trainer = Trainer(plan, comm, rank=ranks.rank, backend=backend)
        comm.connect()

        def sync():
            cupy.cuda.Device(ranks.local).synchronize()
        result["device_name"] = cupy.cuda.runtime.getDeviceProperties(ranks.local)["name"].decode()
        result["kernels_line"] = getattr(backend, "describe", lambda: None)()  # an @DIR tree may predate it
    else:
        from runtime.collectives import LocalGroup
        from runtime.executor import CpuBackend

        backend = CpuBackend(threads=spec.get("threads"))
        comm = host_comm if host_comm is not None else LocalGroup(1).communicator(0)
        trainer = Trainer(plan, comm, rank=ranks.rank, backend=backend)

        def sync():
            pass
    phase = Phases(result, ranks.rank, started)
    phase("setup_s")
    trainer.initialize()
    phase("init_s")
    data = shard(spec, ranks.rank)
    lr = spec["optimizer"]["lr"]

    def step():
        trainer.step_async(data, lr)

    warm = []
    for _ in range(spec["warmup"]):  # each synchronized and timed: a slow start shows which step it is
        begun = time.perf_counter()
        step()
        sync()
        warm.append(round(time.perf_counter() - begun, 3))
    result["warmup_steps_s"] = warm
    phase("warmup_s")
    losses = trainer.collect_losses()
    result["windows_ms"] = timed_windows(step, sync, spec)
    phase("timed_s")
    trainer.collect_losses()
    if cuda:
        result["mem_used_delta_gib"] = round((used_bytes(cupy.cuda.runtime.memGetInfo) - base_used) / GIB, 3)
        result["cupy_pool_gib"] = round(cupy.get_default_memory_pool().total_bytes() / GIB, 3)
        result.update(process_memory(ranks.local))
        if spec["profile_steps"] > 0:
            trace = spec["result"] + f".rank{ranks.rank}.trace.json" if spec.get("traces") else None
            result.update(kernel_profile(step, sync, spec["profile_steps"], trace))
            trainer.collect_losses()
            phase("profile_s")
        if ranks.world > 1 and not skips(backend):
            result["nocomm_step_ms"] = None  # the captured sessions replay their NCCL calls
        elif ranks.world > 1:
            # The same step with no NCCL call: the difference is the communication left exposed.
            comm.skip = True
            for _ in range(2):
                step()
            sync()
            result["nocomm_step_ms"] = bench_lib.summarize(timed_windows(step, sync, spec))["step_ms"]
            trainer.collect_losses()
        comm.close()
        phase("close_s")
    result["first_loss"] = losses[0] if losses else None
    return finish(ranks, result)


class Phases:
    """Seconds each phase of a run took (``result[name]``), and a line per phase on stderr as it
    ends, so that the log of a row that timed out says which phase it was in (rank-prefixed)."""

    def __init__(self, result: dict, rank: int, started: float):
        self.result, self.rank, self.last = result, rank, started

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.result[name] = round(now - self.last, 2)
        self.last = now
        print(f"[rank {self.rank}] {name} {self.result[name]}", file=sys.stderr, flush=True)


def finish(ranks: Ranks, result: dict) -> dict | None:
    """Rank 0 gets the slowest rank's result, with every rank's step time."""
    result.update(bench_lib.summarize(result["windows_ms"]))
    # (runtime.cores.allowed_cores says the same, but an ours row's @DIR tree may predate it)
    result["cpu_affinity"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    every = ranks.gather(result)
    ranks.barrier()
    if ranks.rank != 0:
        return None
    slowest = max(every, key=lambda r: r["step_ms"])
    out = dict(slowest)
    if len(every) > 1:
        out["rank_step_ms"] = [r["step_ms"] for r in every]
        mems = [r.get("mem_used_delta_gib") for r in every if r.get("mem_used_delta_gib") is not None]
        out["mem_used_delta_gib"] = max(mems) if mems else None
        # Every rank's (the strategies that shard hold different state per rank; the row's
        # nvml_process_gib and device_processes_gib are the slowest rank's).
        out["rank_mem_used_delta_gib"] = [r.get("mem_used_delta_gib") for r in every]
        out["rank_nvml_process_gib"] = [r.get("nvml_process_gib") for r in every]
        # The cores each rank may run on: a launcher that binds (Open MPI's default for 1 or 2
        # ranks, before runtime/launcher.py asked for none) leaves a host-bound step one core.
        out["rank_cpu_affinity"] = [r.get("cpu_affinity") for r in every]
        ranks_of = {str(r.get("pid")): f"rank {k}" for k, r in enumerate(every)}
        if out.get("device_process_commands") is not None:  # None: no NVML, nothing known
            out["device_process_commands"] = {pid: ranks_of.get(pid, command)
                                              for pid, command in out["device_process_commands"].items()}
    out["peak_mem_gib"] = out.get("mem_used_delta_gib")
    out["python"] = platform.python_version()
    return out


def main(argv: list[str]) -> int:
    mode, spec_path = argv[0], argv[1]
    spec = json.loads(Path(spec_path).read_text())
    if mode == "export":
        export(spec)
        return 0
    try:
        result = run_torch(spec) if mode == "torch" else run_ours(spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as the row's error
        traceback.print_exc()
        Path(spec["result"] + f".error{os.environ.get('OMPI_COMM_WORLD_RANK', os.environ.get('PMI_RANK', ''))}").write_text(
            f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
        if spec.get("gpus", 1) > 1 and "mpi4py" in sys.modules:  # peers would wait in a collective
            sys.stderr.flush()
            sys.modules["mpi4py"].MPI.COMM_WORLD.Abort(1)
        return 1
    if result is not None:
        Path(spec["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
