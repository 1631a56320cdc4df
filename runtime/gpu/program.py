"""GpuProgram: runs a cut rank graph on the GPU with its collectives overlapped (the sessions are
OrtCudaSegment, session.py; the backend that makes them is GpuBackend, backend.py).

Streams and order. Every session runs on one compute stream (``user_compute_stream``); every NCCL
call runs on the communicator's stream. Collective k waits for an event recorded on the compute
stream after the segments before it; a segment that reads a collective's outputs waits for the
event recorded after that collective. So bucket k's collective runs while the backward of later
buckets computes, and (with ``split_tail``) the optimizer of bucket k runs as soon as it is done.
At the end of a step the compute stream waits for every collective, so the next step never
writes a buffer that NCCL still reads.

Buffers. The first call of a program (the init graph's only one, and the first step) runs on
buffers allocated as it goes (CuPy's for the outputs of sessions whose shapes are static, which
after specialization is all of them; onnxruntime's otherwise), each dropped after its last reader,
and records every value's shape. From the second call on,
everything is preallocated and bound once, in two IOBindings per segment (one per step parity):
- each collective owns one flat buffer (two, by parity, if its outputs are state), laid out by its
  op class (CollectiveOp.flat_layout, runtime/collectives/); a gradient that only its collective
  reads is bound straight into its slot (bind_output at a pointer into the bucket), so one NCCL
  call moves the bucket without a copy; collectives run in place (CollectiveOp.launch_flat);
- values that leave the program (state, loss) get two buffers, by parity: step t reads step t-1's
  values from one set while writing the other; except state written over its input: by the fused
  optimizer update (``_in_place``), or by an item after every reader of the input, such as the
  Broadcasts of `sharded` (``_carried_in_place``): one buffer, updated in place;
- values passed between segments of one step share one block, placed so that values whose
  lifetimes (from the item that computes one to the last item that reads it) overlap never
  overlap in bytes (``pack_buffers``): with
  native BatchNorms a ResNet step has ~80 items, and most of what passes between them (an
  activation on its way to the next layer, a gradient on its way to the previous one) lives for
  two or three items. A value a collective reads lives to the end of the step (NCCL reads it on
  its own stream). A constant a session folded is written once, when bound, and keeps its buffer.
A step then is: rebind the few inputs whose pointer changed, run each session, enqueue each NCCL
call. No tensor goes to the host; the loss is copied on the device into a ring read when logging.

The host never waits for the GPU in a bound step (DDP's ``work.wait()``: a stream wait, not a host
wait): the order between the two streams is carried by events alone, so the host enqueues the
whole step and runs ahead into the next while the GPU works. That is sound because everything that
touches the step's buffers runs on one of the two streams: onnxruntime's kernels, replays and
copies on the user compute stream (with ``has_user_compute_stream``; a replay or an uncaptured run
only enqueues there), the native kernels and CuPy's copies on it too, NCCL and the copies into its
slots on the communication stream. What bounds the run-ahead is the feed of the next step's data
(HostIO.feed waits for the previous copy of the same input), about one step.
"""

from __future__ import annotations

import sys
from collections import deque
from contextlib import contextmanager
from typing import Any

import numpy as np

from runtime.collectives import CollectiveOp, Communicator
from runtime.executor import Backend, ProgramBase, median_timings, timing_key
from runtime.gpu.buffers import bfloat16_edges, bucket_dtype, carried_in_place, pack_buffers, value_lifetimes
from runtime.gpu.device import GpuDevice
from runtime.gpu.session import OrtCudaSegment, agree_on_graphs, misaligned
from runtime.segments import CutGraph


class _Slots:
    """The flat buffer(s) of one collective and the views of its inputs and outputs in them; the
    op says where each view lies (CollectiveOp.flat_layout and flat_inputs/flat_outputs)."""

    def __init__(self, op: CollectiveOp, in_shapes: list[tuple], dtype, world: int, rank: int, parities: int, cp):
        self.op = op
        layout = op.flat_layout(in_shapes, world, rank)
        self.buffers = [cp.zeros(layout.total, dtype=dtype) for _ in range(parities)]  # zeros: the padding stays 0
        self.inputs: list[dict[str, Any]] = [op.flat_inputs(layout, buf) for buf in self.buffers]
        self.outputs: list[dict[str, Any]] = [op.flat_outputs(layout, buf) for buf in self.buffers]
        self.mean_view: list[Any] = [op.flat_mean_view(layout, buf) for buf in self.buffers]


class GpuProgram(ProgramBase):
    """Runs a cut graph on ``device`` (see the module docstring); the interface of executor.Program.
    ``backend`` compiles its items; ``debug_sync`` synchronizes the device after every item."""

    def __init__(self, cut: CutGraph, backend: Backend, comm: Communicator, device: GpuDevice, *,
                 debug_sync: bool = False, collectives=None, carried: dict[str, str] | None = None):
        super().__init__(cut, backend, comm)  # segments and native groups compiled, constants on the device
        self.device, self.debug_sync = device, debug_sync
        self.carried = dict(carried or {})  # output -> the input the caller feeds it back as (_carried_in_place)
        # The step's collectives inside its sessions (session_collectives.Registry), or None (cut).
        self.session_collectives = collectives if comm.size > 1 else None
        comm.before_destroy(self.release)  # its graphs may have captured NCCL calls
        self.step_done = device.cp.cuda.Event(disable_timing=True)
        cp = self.cp = device.cp
        producer = self.producer
        # Segment pos -> positions of the collectives whose outputs it reads directly.
        self.waits = {pos: sorted({producer[n] for n in item.inputs if n in producer and self.steps[producer[n]][1] is None})
                      for pos, (item, runner) in enumerate(self.steps) if runner is not None}
        self.collective_pos = [pos for pos, (_, runner) in enumerate(self.steps) if runner is None]
        self.labels = {pos: f"{self.steps[pos][0].label} of {cut.where}" for pos in self.collective_pos}
        self.ready = {pos: cp.cuda.Event(disable_timing=True) for pos in self.collective_pos}
        self.done = {pos: cp.cuda.Event(disable_timing=True) for pos in self.collective_pos}
        self.calls = 0
        self.shapes: dict[str, tuple[tuple, Any]] = {}
        self.slots: dict[int, _Slots] = {}
        self.copy_in: dict[int, list[str]] = {}
        self.outs: dict[int, list[dict[str, Any]]] = {}
        self.block_bytes = 0
        # --timings: per recorded step, (item key, start event, end event) on the item's stream.
        self.timed_steps: deque[list[tuple[tuple[str, int], Any, Any]]] | None = None
        # What passes between items as bfloat16 (buffers.bfloat16_edges), given to each session
        # before the first call compiles it.
        edges = bfloat16_edges([(list(item.inputs), None if isinstance(runner, OrtCudaSegment) else
                                 runner.bfloat16_inputs() if hasattr(runner, "bfloat16_inputs") else frozenset())
                                for item, runner in self.steps],
                               self.producer, set(cut.inputs) | set(cut.outputs))
        for _, runner in self.steps:
            if isinstance(runner, OrtCudaSegment):
                runner.bfloat16_edges = edges

    def _run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        if self.calls == 1:
            return self._run_first(feeds)
        if self.calls == 2:
            # What the first call dropped goes back before the program's own buffers are allocated, so
            # that those lie in chunks of their own (CuPy frees a chunk only once all of it is free).
            self._release_pool()
            if self.session_collectives is not None:  # every rank at its call 2, before any capture
                agree_on_graphs(self.steps, self.comm, self.cut.where)
            feeds = self._allocate(feeds)
        elif self.calls == 3:
            # The first call's outputs (GPT-2-small: 1.8 GiB) were last read by call 2: given back.
            self._release_pool()
        return self._run_bound(feeds, self.calls % 2)

    def release(self) -> None:
        """Drop every session and its CUDA graphs (the communicator's close calls it); not run again."""
        for runner in (r for _, r in self.steps if r is not None):
            runner.release()

    def _release_pool(self) -> None:
        self.device.compute.synchronize()
        self.cp.get_default_memory_pool().free_all_blocks()

    def _allow_capture(self) -> None:
        """Whether the sessions may be captured as CUDA graphs, decided at the first call, after the
        communicator connected: what decides is its watchdog thread, whose event queries invalidate
        onnxruntime's global-mode capture unless it runs in relaxed capture mode (cuda.py). Where it
        could not, programs with collectives run uncaptured (a host round trip per session): said
        once. (Decided before connect(), this left every multi-rank program uncaptured: 4 H100s,
        GPT-2-small 600 launches and 15 stream synchronizations per step, run h100x4-s23.)"""
        relaxed = getattr(self.comm, "relaxed", True)
        if not (self.collective_pos or self.session_collectives) or self.comm.size == 1 or relaxed is True:
            return
        print(f"transpile: warning: {self.cut.where}: no CUDA graphs (the NCCL watchdog could not enter relaxed "
              "capture mode): every session runs uncaptured", file=sys.stderr, flush=True)
        for _, runner in self.steps:
            if isinstance(runner, OrtCudaSegment):
                runner.capture_allowed = False

    # -- first call: allocated as it goes, collectives synchronous -----------------------------
    def _run_first(self, feeds):
        self._allow_capture()
        env = {**self.constants, **feeds}
        self.device.compute.synchronize()  # constants and fed data are on the device before any run
        keep = set(self.cut.outputs) | set(self.constants) | set(feeds)
        shapes = {name: (tuple(v.shape), v.dtype) for name, v in env.items()}
        for pos, (item, runner) in enumerate(self.steps):
            values = [env[name] for name in item.inputs]
            if runner is not None:
                inputs = dict(zip(item.inputs, values))
                if self.session_collectives is not None and isinstance(runner, OrtCudaSegment):
                    runner.ensure_compiled(inputs)  # making the session is not a hang: not watched
                with self._watched("the first step"):
                    results = runner.run(inputs)
            else:
                results = item.run(self.comm, values)
            env.update(zip(item.outputs, results))
            shapes.update((name, (tuple(v.shape), v.dtype)) for name, v in zip(item.outputs, results))
            # A value no later item reads goes back to its allocator now (CuPy's pool; onnxruntime's
            # arena for an output it allocated), so the first call holds no more than a step does.
            del values, results
            for name in item.inputs + item.outputs:
                if name in env and name not in keep and max(self.readers.get(name, [pos])) <= pos:
                    del env[name]
        self.shapes = shapes
        # The first call's work is done before its values (some in onnxruntime's arenas) are dropped
        # and the second call allocates the program's own buffers.
        self.device.compute.synchronize()
        return {name: env[name] for name in self.cut.outputs}

    # -- from the second call on: preallocated, bound once, overlapped -------------------------
    def _in_place(self, feeds: dict[str, Any], bound_into: dict) -> dict[str, str]:
        """Program outputs the fused optimizer update writes over its own inputs (output -> input),
        instead of into the second buffer of a parity pair. Safe where the input is fed (the buffer
        the previous call's update wrote), read by no item after the update, and the output goes to
        no slot."""
        pairs: dict[str, str] = {}
        program_outputs = set(self.cut.outputs)
        for pos, (_, runner) in enumerate(self.steps):
            for out, src in (runner.in_place_pairs() if hasattr(runner, "in_place_pairs") else {}).items():
                if out not in program_outputs or out in bound_into or src not in feeds:
                    continue
                if max(self.readers.get(src, [pos])) <= pos and src not in self.cut.outputs:
                    pairs[out] = src
        return pairs

    def _carried_in_place(self, feeds: dict[str, Any], taken) -> dict[str, str]:
        """State that a later item computes for the next call, written over the buffer this call
        reads it from (output -> input; buffers.carried_in_place says where that is safe):
        `sharded`'s Broadcasts and `zero`'s AllGathers write the next parameters into one buffer
        instead of a parity pair (GPT-2-small: 0.65 GB). Where the caller feeds another value (a
        checkpoint loaded), the readers read that one and the output still goes here."""
        items = [(list(item.inputs), list(item.outputs), runner is not None) for item, runner in self.steps]
        return carried_in_place(items, self.readers, self.carried, set(self.cut.outputs), set(feeds), set(taken))

    def _own_buffers(self, pairs: dict[str, str], feeds: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """For each (output -> input) of the same shape and dtype: one buffer of the program's own for
        both, holding the fed value (not the first call's output it was fed, which would pin its
        chunk of the pool; this call reads the input from it too). An output in a collective's flat
        bucket (an AllGather's) takes its view there where onnxruntime may read it as an input, so
        the finish copies nothing. Returns (output -> buffer, input -> the same buffer)."""
        aliased: dict[str, Any] = {}
        moved: dict[str, Any] = {}
        registry = self.session_collectives
        for out, src in pairs.items():
            value, (shape, dtype) = feeds[src], self.shapes[out]
            if tuple(value.shape) != shape or value.dtype != dtype:
                continue
            view = registry.output_view(out) if registry is not None else None
            if view is None or tuple(view.shape) != shape or view.dtype != dtype or not view.flags.c_contiguous \
                    or misaligned(view):
                view = self.cp.empty(shape, dtype)
            aliased[out] = moved[src] = view
            view[...] = value
        return aliased, moved

    def _allocate(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """The program's buffers and bindings (the module docstring); returns ``feeds`` with the
        state that the update writes in place moved into the program's own buffers."""
        cp, comm = self.cp, self.comm
        program_outputs = set(self.cut.outputs)
        bound_into: dict[str, tuple[int, str]] = {}  # segment output -> (collective pos, input name)
        seen = {name: dtype for name, (_, dtype) in self.shapes.items()}
        for pos in self.collective_pos:
            op = self.steps[pos][0]
            in_shapes = [self.shapes[n][0] for n in op.inputs]
            dtype = bucket_dtype(list(op.inputs), list(op.outputs), op.output_specs, seen, op.where)
            parities = 2 if any(n in program_outputs for n in op.outputs) else 1
            self.slots[pos] = _Slots(op, in_shapes, dtype, comm.size, comm.rank, parities, cp)
            self.copy_in[pos] = []
            for name in op.inputs:
                src = self.producer.get(name)
                only_reader = self.readers[name] == [pos] and op.inputs.count(name) == 1
                # A slot off the alignment onnxruntime's kernels may need (the packed layout of a
                # ReduceScatter bucket) is filled by a copy instead of bound as the output.
                aligned = not any(misaligned(views[name]) for views in self.slots[pos].inputs)
                if (src is not None and self.steps[src][1] is not None and only_reader and aligned
                        and name not in program_outputs):
                    bound_into[name] = (pos, name)
                else:
                    self.copy_in[pos].append(name)
        aliased, moved = self._own_buffers(self._in_place(feeds, bound_into), feeds)
        carried_out, carried_in = self._own_buffers(self._carried_in_place(feeds, bound_into.keys() | aliased.keys()), feeds)
        aliased.update(carried_out)
        moved.update(carried_in)
        internal = self._internal_buffers(bound_into, aliased)
        for pos, (item, runner) in enumerate(self.steps):
            if runner is None:
                continue
            per_parity = []
            for parity in (0, 1):
                outs = {}
                for name in item.outputs:
                    shape, dtype = self.shapes[name]
                    if name in bound_into:
                        slots = self.slots[bound_into[name][0]]
                        outs[name] = slots.inputs[parity % len(slots.buffers)][name]
                    elif name in aliased:
                        outs[name] = aliased[name]
                    elif name in program_outputs:
                        outs[name] = cp.empty(shape, dtype)
                    else:
                        outs[name] = internal[name]
                runner.prepare(parity, outs)
                per_parity.append(outs)
            self.outs[pos] = per_parity
        return {**feeds, **moved}

    def _internal_buffers(self, bound_into: dict, aliased: dict) -> dict[str, Any]:
        """A device array for every value passed between this step's items (the module docstring)."""
        cp = self.cp
        items = [(list(item.outputs), runner is not None) for item, runner in self.steps]
        # A session writes a constant it folded once, when bound.
        once = {pos: runner.written_once() for pos, (_, runner) in enumerate(self.steps) if isinstance(runner, OrtCudaSegment)}
        nbytes = {name: int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                  for name, (shape, dtype) in self.shapes.items()}
        own = set(bound_into) | set(aliased) | set(self.cut.outputs)
        lifetimes = value_lifetimes(items, self.readers, nbytes, own, once)
        offsets, total = pack_buffers(lifetimes)
        self.block_bytes = total  # reported by benchmarks/gpu_memory_steps.py
        block = cp.empty(max(total, 1), dtype=np.uint8)
        internal = {}
        for name, size, _, _ in lifetimes:
            shape, dtype = self.shapes[name]
            internal[name] = block[offsets[name]:offsets[name] + size].view(dtype).reshape(shape)
        return internal

    # -- --timings: each item's time on its own stream ------------------------------------------
    def record_timings(self, steps: int = 64) -> None:
        """From the next bound call on, time every item of the last ``steps`` calls with a pair of
        CUDA events around it on its stream (a session's or native group's on the compute stream,
        a collective's on the communication stream after its wait): the GPU's time for the item,
        as ``transpile inspect --timings`` draws it. No host wait is added; the events are read
        by ``median_timings``."""
        self.timed_steps = deque(maxlen=steps)

    def median_timings(self) -> dict[str, dict[str, float]]:
        self.device.synchronize()
        samples: dict[tuple[str, int], list[float]] = {}
        for marks in self.timed_steps or ():
            for key, start, end in marks:
                samples.setdefault(key, []).append(self.cp.cuda.get_elapsed_time(start, end) / 1e3)
        return median_timings(samples)

    def _mark(self, marks: list, pos: int, stream):
        """Records the start of item ``pos`` on ``stream`` in a timed call; returns the event to
        record at its end."""
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        start.record(stream)
        marks.append((timing_key(*self.steps[pos]), start, end))
        return end

    def _run_bound(self, feeds, parity: int):
        env = {**self.constants, **feeds}  # fed data: copied on the compute stream, in order
        marks = None
        if self.timed_steps is not None:
            marks = []
            self.timed_steps.append(marks)
        with self._watched("a step"):
            self._enqueue(env, parity, marks)
        return {name: env[name] for name in self.cut.outputs}

    def _enqueue(self, env: dict, parity: int, marks: list | None) -> None:
        comm, compute = self.comm, self.device.compute
        waited: set[int] = set()
        for pos, (item, runner) in enumerate(self.steps):
            if runner is not None:
                for c in self.waits[pos]:
                    if c not in waited:
                        compute.wait_event(self.done[c])
                        waited.add(c)
                end = self._mark(marks, pos, compute) if marks is not None else None
                runner.run_bound(parity, env)
                if end is not None:
                    end.record(compute)
                if self.debug_sync:
                    self.device.synchronize()
                env.update(self.outs[pos][parity])
                continue
            slots = self.slots[pos]
            p = parity % len(slots.buffers)
            self.ready[pos].record(compute)
            comm.stream.wait_event(self.ready[pos])
            end = self._mark(marks, pos, comm.stream) if marks is not None else None
            if self.copy_in[pos]:
                with comm.stream:
                    for name in self.copy_in[pos]:
                        slots.inputs[p][name][...] = env[name]
            item.launch_flat(comm, slots.buffers[p], slots.mean_view[p], self.labels[pos])
            if end is not None:
                end.record(comm.stream)
            self.done[pos].record(comm.stream)
            if self.debug_sync:
                self.device.synchronize()
            comm.track(pos, self.done[pos], self.labels[pos])
            env.update(slots.outputs[p])
        # The next step writes buffers NCCL may still read (slots, their inputs): it starts after them.
        for c in self.collective_pos:
            if c not in waited:
                compute.wait_event(self.done[c])

    @contextmanager
    def _watched(self, what: str):
        """With the collectives inside the sessions, the watchdog watches what is enqueued in this
        block whole: each finish, in the session of its start, made the compute stream wait for its
        collective (events recorded inside a captured graph, which no stream out here can wait
        for). The entry is made before the block, not after it: a peer that died can block this
        host inside it (a first call's runs wait for NCCL), and an entry never made never expires.
        It is done once the block returned and the compute stream passed its end."""
        if self.session_collectives is None:
            yield
            return
        entry = _InFlight(self.step_done)
        self.comm.track(("step", id(self)), entry, f"{what} of {self.cut.where} (its collectives run inside its sessions)")
        try:
            yield
        finally:
            self.step_done.record(self.device.compute)
            entry.enqueued = True


class _InFlight:
    """A watchdog entry (NcclCommunicator.track's ``event``) for work still being enqueued: not
    done before ``enqueued`` is set, then done when ``event`` has happened."""

    def __init__(self, event):
        self.event, self.enqueued = event, False

    @property
    def done(self) -> bool:
        return self.enqueued and self.event.done
