"""Executing a cut rank graph: a Backend compiles segments, a Program runs segments and collectives.

The GPU backend (runtime/gpu/) implements ``Backend.compile`` (onnxruntime CUDA EP with IOBinding
on device buffers) and ``Backend.make_program`` (a program that issues each collective on a
communication stream and lets the next segments run while it is in flight). The trainer only calls
``run`` and the host conversions below, so it is the same for both.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import ChainMap
from typing import Any

import numpy as np
import onnx

from runtime.collectives import CollectiveOp, Communicator
from runtime.errors import RunError
from runtime.segments import CutGraph, NativeGroup, Segment


class SegmentRunner(ABC):
    """One compiled segment; built once per rank, run every step."""

    @abstractmethod
    def run(self, feeds: dict[str, Any]) -> list[Any]:
        """The segment's outputs, in ``segment.outputs`` order."""

    def release(self) -> None:
        """Drop what the runner holds on the device (sessions, their CUDA graphs); it is not run again."""
        return None  # nothing to release by default


class LaunchRunner(SegmentRunner):
    """A backend-native runner whose whole work is ``launch(values, allocate)`` on a mapping of
    values: the first call (``run``) checks the inputs, configures for their shapes and allocates
    the outputs not already in ``values`` (a node run inside an onnxruntime session is given them:
    runtime/gpu/in_session.py); from then on the program gives fixed output buffers per step parity
    (``prepare``) and ``run_bound`` writes into those. The GPU program treats it like an onnxruntime
    segment."""

    def __init__(self, outputs):
        self.outputs = list(outputs)
        self.prepared: list[dict[str, Any] | None] = [None, None]

    @abstractmethod
    def launch(self, values, allocate: bool) -> None: ...

    def run(self, feeds):
        values = dict(feeds)
        self.launch(values, allocate=True)
        return [values[name] for name in self.outputs]

    def prepare(self, parity: int, outputs: dict[str, Any]) -> None:
        self.prepared[parity] = dict(outputs)

    def run_bound(self, parity: int, env: dict[str, Any]) -> None:
        # A view, not a merged copy: the program's env holds every value of the step.
        self.launch(ChainMap(self.prepared[parity], env), allocate=False)


class Backend(ABC):
    name: str
    # Node domains this backend runs itself instead of onnxruntime (segments.py cuts their nodes out
    # into NativeGroup items, which ``compile`` must then accept), e.g. the fused optimizer updates.
    native_domains: frozenset[str] = frozenset()
    # Of those, the domains whose nodes are staged as late as their readers allow (segments.py),
    # e.g. the GPU's optimizer updates: one group, one multi-tensor launch, per part.
    late_native_domains: frozenset[str] = frozenset()
    # Capabilities the trainer asks about (a backend declares them; none is inferred from its name):
    records_timings: bool = False  # its programs have record_timings()/median_timings() (--timings)
    runs_grad_accumulation: bool = False  # it runs plans transpiled with --grad-accumulation K > 1
    sends_low_precision: bool = False  # its collectives send bf16/fp16 buckets (--grad-dtype)

    @abstractmethod
    def compile(self, segment: Segment | NativeGroup, where: str) -> SegmentRunner: ...

    # Whether the step graph's collectives run inside the backend's segments (the cut keeps them).
    collectives_inside = False

    def make_program(self, cut: CutGraph, comm: Communicator, *, calls_per_step: int = 1,
                     carried: dict[str, str] | None = None) -> Program:
        """The program that runs ``cut``; ``calls_per_step``: how often a training step calls it
        (the accumulate graph: K - 1 times), which a backend that replays recorded calls needs;
        ``carried``: output -> the input the caller feeds it back as on the next call (the step's
        state), which a backend that keeps state in place may use."""
        return Program(cut, self, comm)

    def describe(self) -> str | None:
        """One line for the run's banner on how this backend computes (the GPU names its native
        kernels and why any is off); None: nothing to say."""
        return None

    def split_tail(self) -> bool:
        """Whether the last segment is cut by collective (segments.py): worth it only where
        collectives run asynchronously, as on the GPU."""
        return False

    def prepare_step_graph(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """The step graph as this backend runs it, before it is cut: a backend may rewrite it into
        nodes of its ``native_domains`` (the GPU fuses elementwise chains). Same values."""
        return model

    def from_host(self, array: np.ndarray) -> Any:
        """A host array as this backend's value (a device buffer on GPU)."""
        return array

    def feed(self, name: str, array: np.ndarray) -> Any:
        """The per-step value of graph input ``name`` (data, lr); the GPU reuses one buffer per name."""
        return self.from_host(array)

    def to_host(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    def hold_scalar(self, value: Any) -> Any:
        """Keep a step's loss until ``scalars_to_host``; the GPU keeps it on the device."""
        return float(np.asarray(value))

    def scalars_to_host(self, held: list) -> list[float]:
        return [float(v) for v in held]


class OrtCpuSegment(SegmentRunner):
    def __init__(self, segment: Segment, where: str, threads: int | None):
        import onnxruntime as ort

        from runtime.cpu_scatter import race_free_scatters
        from runtime.low_precision import lower

        self.where = f"{where}: segment {segment.index}"
        self.outputs = list(segment.outputs)
        options = ort.SessionOptions()
        options.log_severity_level = 4  # failures surface as RunError; ORT's own log line would repeat them
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        try:
            # bf16/fp16 nodes as float32 compute rounded like a GPU (runtime/low_precision.py); a
            # step graph is lowered whole before the cut (prepare_step_graph), this catches the rest.
            model = lower(segment.model)
            # onnxruntime's CPU ScatterND(add) races between threads where indices repeat
            # (runtime/cpu_scatter.py): rewritten race-free, or the session runs on one thread.
            model, racy = race_free_scatters(model)
            if racy:
                options.intra_op_num_threads = 1
            self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/NotImplemented types
            raise RunError(f"{self.where}: onnxruntime cannot load it: {_first_line(exc)}") from None

    def run(self, feeds):
        try:
            return self.session.run(self.outputs, feeds)
        except Exception as exc:
            raise RunError(f"{self.where}: onnxruntime failed: {_first_line(exc)}") from None


class CpuBackend(Backend):
    """onnxruntime CPU execution provider; ``threads`` caps each session's intra-op threads.
    Low-precision (bf16/fp16) graphs run as float32 with their roundings (runtime/low_precision.py)."""

    name = "cpu"
    records_timings = True
    runs_grad_accumulation = True
    sends_low_precision = True

    def __init__(self, threads: int | None = None):
        self.threads = threads

    def compile(self, segment, where):
        return OrtCpuSegment(segment, where, self.threads)

    def prepare_step_graph(self, model):
        """A step graph with bfloat16/float16 values (--precision, --grad-dtype) as float32 compute
        with the low-precision roundings (runtime/low_precision.py): onnxruntime's CPU provider
        has almost no bf16 kernel. Others unchanged."""
        from runtime.low_precision import lower

        return lower(model)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class ProgramBase(ABC):
    """What every program of a cut graph shares: the items in order with their runners (segments
    and native groups are compiled once here; collectives have none and run through the
    communicator), the constants as backend values, who produces and who reads each value, and
    the check of the feeds. Subclasses say how a step runs (``_run``)."""

    def __init__(self, cut: CutGraph, backend: Backend, comm: Communicator):
        self.cut, self.backend, self.comm = cut, backend, comm
        self.steps: list[tuple[Segment | NativeGroup | CollectiveOp, SegmentRunner | None]] = [
            (item, None if isinstance(item, CollectiveOp) else backend.compile(item, cut.where)) for item in cut.items]
        self.constants = {name: backend.from_host(value) for name, value in cut.constants.items()}
        self.producer: dict[str, int] = {}  # value -> position of the item that computes it
        self.readers: dict[str, list[int]] = {}  # value -> positions of the items that read it, in order
        for pos, item in enumerate(cut.items):
            for name in item.inputs:
                self.readers.setdefault(name, []).append(pos)
            for name in item.outputs:
                self.producer[name] = pos

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """One call of the graph: ``feeds`` has every graph input; returns the graph's outputs."""
        missing = [name for name in self.cut.inputs if name not in feeds]
        if missing:
            raise RunError(f"{self.cut.where}: not fed: {', '.join(missing)}")
        return self._run(feeds)

    @abstractmethod
    def _run(self, feeds: dict[str, Any]) -> dict[str, Any]: ...


class Program(ProgramBase):
    """Runs a cut graph: segments on the backend, collectives on the communicator, in order.

    Each value is dropped right after its last reader, so a step holds no more activations than
    the graph itself needs.
    """

    def __init__(self, cut: CutGraph, backend: Backend, comm: Communicator):
        super().__init__(cut, backend, comm)
        keep = set(cut.outputs)
        self.release: list[list[str]] = [[] for _ in cut.items]
        self.timings: dict[tuple[str, int], list[float]] | None = None  # see record_timings
        for name, positions in self.readers.items():
            if name not in keep:
                self.release[positions[-1]].append(name)

    def _run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        env = {**self.constants, **feeds}
        for (item, runner), release in zip(self.steps, self.release):
            values = [env[name] for name in item.inputs]
            started = time.perf_counter() if self.timings is not None else 0.0
            if runner is not None:
                results = runner.run(dict(zip(item.inputs, values)))
            else:
                self.comm.current = item.label
                results = item.run(self.comm, values)
                self.comm.current = None
            if self.timings is not None:
                self.timings.setdefault(timing_key(item, runner), []).append(time.perf_counter() - started)
            env.update(zip(item.outputs, results))
            for name in release:
                del env[name]
        return {name: env[name] for name in self.cut.outputs}

    def record_timings(self) -> None:
        """From now on, time every segment and collective of every run (seconds, wall clock: the
        CPU backend runs each item to completion, so these are the items' own times)."""
        self.timings: dict[tuple[str, int], list[float]] | None = {}

    def median_timings(self) -> dict[str, dict[str, float]]:
        return median_timings(self.timings or {})


def timing_key(item, runner) -> tuple[str, int]:
    """How ``--timings`` names a cut graph's item: a segment (or native group) by its index, a
    collective by its order."""
    return ("segments", item.index) if runner is not None else ("collectives", item.order)


def median_timings(samples: dict[tuple[str, int], list[float]]) -> dict[str, dict[str, float]]:
    """``{"segments": {index: s}, "collectives": {order: s}}``: medians of each item's recorded
    seconds, the format ``transpile inspect --timings`` reads."""
    out: dict[str, dict[str, float]] = {"segments": {}, "collectives": {}}
    for (kind, key), values in sorted(samples.items()):
        out[kind][str(key)] = float(np.median(values))
    return out
