"""A checkpoint's state by name, whole, whatever the world size and strategy that wrote it.

The rank files of a checkpoint hold each rank's state under its own graph's names
(runtime/checkpoint.py): parameters on every rank, optimizer state where the strategy keeps it
(``allreduce``: on every rank; ``sharded``: on the parameter's root only; ``zero``: a flat slice
``bucket<b>.slice.<slot>`` per bucket on every rank). Its manifest also records, from the plan
that wrote it (plan.json's state entries, contract/plan.py):

- ``tensors`` (``tensor_index``): every state of the single-device graphs (each parameter and
  buffer, each optimizer slot of each parameter ``<param>.<slot>``, the step counter, fp16's loss
  scale), by name, whole: its kind, its parameter, and where its values are. A value some rank
  holds whole is read from the lowest such rank (parameters are equal on every rank; buffers, which
  every rank updates from its own shard unless --sync-bn, are rank 0's, as --export writes them);
  a value spread over zero's slices is a list of pieces ``{"rank", "key", "at", "start", "stop"}``
  (elements [at, at + stop - start) of that rank's key are elements [start, stop) of the whole
  tensor, flattened), with the whole shape and dtype.
- ``model`` (``model_summary``): what another plan must share to resume it: the parameters (name,
  shape, dtype), the optimizer and its hyper-parameters (lr aside: a run option, checked with the
  schedule), the compute precision, the source model's sha256.

``Tensors`` reads any of these tensors whole from the rank files; ``differences`` says in one line
what stops a plan from resuming a checkpoint of another plan; ``rank_state`` cuts one rank's state
out of the whole tensors for the plan that resumes (its own zero slices from the pieces its plan
records, padding zero as a zero run keeps it).
"""

from __future__ import annotations

import math
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from runtime import checkpoint
from runtime.errors import RunError
from runtime.plan import Plan, StateEntry


def tensor_index(plan: Plan, role: int | None) -> tuple[dict[str, dict], list[str]]:
    """The ``tensors`` section of a checkpoint written by the ranks of ``plan`` (``role`` None: one
    process running the single-device graphs), and the rank states it cannot place by name (zero
    slices of a plan written before plan.json recorded their pieces)."""
    whole = {s.input: s for s in plan.single.state}
    ranks = [plan.single] if role is None else list(plan.ranks)
    tensors: dict[str, dict] = {}
    pieces: dict[str, list[dict]] = {}
    unmapped: list[str] = []
    for rank, files in enumerate(ranks):
        for s in files.state:
            if s.pieces is not None:
                for p in s.pieces:
                    pieces.setdefault(p.of, []).append({"rank": rank, "key": s.input, "at": p.at, "start": p.start,
                                                         "stop": p.stop})
            elif s.input not in whole:
                if s.input not in unmapped:
                    unmapped.append(s.input)
            elif s.input not in tensors:
                tensors[s.input] = {"kind": s.kind, "param": s.param, "rank": rank, "key": s.input}
    for name, found in pieces.items():
        s = whole[name]  # contract.plan checks that every piece names a single-device state
        if name not in tensors and s.shape is not None and s.dtype is not None:
            tensors[name] = {"kind": s.kind, "param": s.param, "shape": list(s.shape), "dtype": s.dtype,
                             "pieces": sorted(found, key=lambda p: p["start"])}
    return tensors, unmapped


def model_summary(plan: Plan, unmapped: list[str]) -> dict:
    """The ``model`` section of a checkpoint's manifest: what ``differences`` compares."""
    source = plan.raw.get("source_model")
    return {
        "sha256": source.get("sha256") if isinstance(source, dict) else None,
        "strategy": plan.strategy,
        "parameters": [[p.name, list(p.shape), p.dtype] for p in plan.parameters],
        "optimizer": _optimizer(plan.optimizer),
        "precision": _precision(plan),
        "unmapped": list(unmapped),
    }


def _optimizer(optimizer: dict) -> dict:
    # lr is a run option (--lr, the schedule), compared with the schedule, not here.
    return {key: value for key, value in optimizer.items() if key != "lr"}


def _precision(plan: Plan) -> str:
    return plan.precision.compute if plan.precision is not None else "fp32"


def _shown(names: list[str]) -> str:
    return ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def differences(model: dict, tensors: dict, plan: Plan, *, parameters_only: bool = False) -> tuple[str | None, list[str]]:
    """(what stops ``plan`` from resuming a checkpoint with this ``model`` and ``tensors``, in one
    line, or None; warnings). ``parameters_only``: for an export, only the trained values matter."""
    warnings: list[str] = []
    if model.get("unmapped"):
        return (f"its plan (transpiled before plan.json recorded where zero's slices lie) leaves "
                f"{_shown(model['unmapped'])} without a layout by name; resume it with the OUT that wrote it"), warnings
    theirs = {name: (tuple(shape), dtype) for name, shape, dtype in model.get("parameters", [])}
    ours = {p.name: (tuple(p.shape), p.dtype) for p in plan.parameters}
    if theirs.keys() != ours.keys():
        parts = []
        if theirs.keys() - ours.keys():
            parts.append(f"the checkpoint has parameter(s) {_shown(sorted(theirs.keys() - ours.keys()))} that this plan lacks")
        if ours.keys() - theirs.keys():
            parts.append(f"this plan has parameter(s) {_shown(sorted(ours.keys() - theirs.keys()))} that the checkpoint lacks")
        return f"a different model: {'; '.join(parts)}", warnings
    for name, (shape, dtype) in ours.items():
        if theirs[name] != (shape, dtype):
            their_shape, their_dtype = theirs[name]
            return (f"a different model: parameter '{name}' is {list(their_shape)} {their_dtype} in the checkpoint, "
                    f"{list(shape)} {dtype} in this plan"), warnings
    needed = [s for s in plan.single.state if not parameters_only or s.kind in ("param", "buffer")]
    lacking = [s.input for s in needed if s.input not in tensors]
    if not parameters_only:
        theirs_opt, ours_opt = model.get("optimizer", {}), _optimizer(plan.optimizer)
        if theirs_opt.get("name") != ours_opt.get("name"):
            return (f"a different optimizer: the checkpoint's is {theirs_opt.get('name')}, this plan's "
                    f"{ours_opt.get('name')} (transpile with --optimizer {theirs_opt.get('name')})"), warnings
        for key in sorted(theirs_opt.keys() | ours_opt.keys()):
            if theirs_opt.get(key) != ours_opt.get(key):
                return (f"a different optimizer: the checkpoint's {theirs_opt.get('name')} has {key} "
                        f"{theirs_opt.get(key)}, this plan's {ours_opt.get(key)}"), warnings
        if model.get("precision", "fp32") != _precision(plan):
            return (f"the checkpoint was trained with --precision {model.get('precision', 'fp32')}, this plan computes in "
                    f"{_precision(plan)}"), warnings
        extra = sorted(tensors.keys() - {s.input for s in plan.single.state})
        if extra:
            return f"the checkpoint holds state {_shown(extra)} that this plan has no place for", warnings
        unplaced = [s.input for files in plan.ranks for s in files.state
                    if s.pieces is None and s.input not in {w.input for w in plan.single.state}]
        if unplaced:
            return (f"this plan (transpiled before plan.json recorded where zero's slices lie) cannot place "
                    f"{_shown(unplaced)} by name; transpile the model again"), warnings
    if lacking:
        return f"this plan's state {_shown(lacking)} is not in the checkpoint", warnings
    source = plan.raw.get("source_model")
    sha = source.get("sha256") if isinstance(source, dict) else None
    if model.get("sha256") and sha and model["sha256"] != sha:
        warnings.append("the checkpoint was trained from another model.onnx (its sha256 differs) with the same "
                        "parameters; its values are taken by parameter name")
    return None, warnings


def rank_state(entries: tuple[StateEntry, ...], read: Callable[[str], np.ndarray]) -> dict[str, np.ndarray]:
    """One rank's state, keyed by its graph's state inputs, from whole tensors ``read(name)``: an
    entry without pieces is the whole tensor of its name; a zero slice is a flat vector holding its
    pieces, zero elsewhere (the padding a zero run keeps at zero)."""
    state = {}
    for s in entries:
        if s.pieces is None:
            state[s.input] = read(s.input)
            continue
        flat = np.zeros(math.prod(s.shape), dtype=np.dtype(s.dtype))
        for p in s.pieces:
            whole = read(p.of).reshape(-1)
            if p.stop > whole.size:
                raise RunError(f"'{p.of}' has {whole.size} elements, this plan's '{s.input}' takes [{p.start}, {p.stop})")
            flat[p.at:p.at + p.stop - p.start] = whole[p.start:p.stop]
        state[s.input] = flat.reshape(s.shape)
    return state


# Rank-file arrays the reader keeps while it reassembles tensors: a zero slice holds pieces of many
# parameters, read one after another.
_CACHE_BYTES = 256 << 20


class Tensors:
    """A checkpoint's state by name, whole (the manifest's ``tensors``, above), read
    from the rank files of whatever world size wrote it. Each rank file opened is checked to hold
    the checkpoint's step. Use as a context manager: it closes the files."""

    def __init__(self, directory: Path, meta: checkpoint.Meta, option: str = "--resume"):
        if meta.tensors is None:
            raise RunError(f"{option} {directory}: written before checkpoints recorded their state by name (format 2)")
        self.directory, self.meta, self.option = directory, meta, option
        self.index = meta.tensors
        self._files: dict[int, np.lib.npyio.NpzFile] = {}
        self._cache: OrderedDict[tuple[int, str], np.ndarray] = OrderedDict()
        self._bytes = 0

    def __enter__(self) -> Tensors:
        return self

    def __exit__(self, *exc) -> None:
        for npz in self._files.values():
            npz.close()
        self._files.clear()
        self._cache.clear()

    def read(self, name: str) -> np.ndarray:
        """The whole tensor ``name`` (a state input name of the single-device graphs)."""
        entry = self.index.get(name)
        if entry is None:
            raise RunError(f"{self.option} {self.directory}: holds no state '{name}'")
        try:
            if "key" in entry:
                return self._member(int(entry["rank"]), str(entry["key"]))
            flat = np.zeros(math.prod(entry["shape"]), dtype=np.dtype(entry["dtype"]))
            covered = 0
            for p in entry["pieces"]:
                start, stop, at = int(p["start"]), int(p["stop"]), int(p["at"])
                part = self._member(int(p["rank"]), str(p["key"])).reshape(-1)
                if not (0 <= start < stop <= flat.size and at + stop - start <= part.size):
                    raise ValueError(f"piece [{start}, {stop}) at {at} of '{p['key']}'")
                flat[start:stop] = part[at:at + stop - start]
                covered += stop - start
            if covered != flat.size:
                raise ValueError(f"its pieces cover {covered} of its {flat.size} elements")
            return flat.reshape(entry["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise RunError(f"{self.option} {self.directory}/meta.json: the layout of '{name}' is damaged "
                           f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None

    def _member(self, rank: int, key: str) -> np.ndarray:
        cached = self._cache.get((rank, key))
        if cached is not None:
            self._cache.move_to_end((rank, key))
            return cached
        npz = self._open(rank)
        path = self.directory / checkpoint.rank_file(rank)
        if key not in npz.files:
            raise RunError(f"{self.option} {path}: holds no '{key}', which the manifest names")
        try:
            array = npz[key]
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise RunError(f"{self.option} {path}: '{key}' is unreadable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                           "the checkpoint is damaged") from None
        self._cache[(rank, key)] = array
        self._bytes += array.nbytes
        while self._bytes > _CACHE_BYTES and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self._bytes -= dropped.nbytes
        return array

    def _open(self, rank: int) -> np.lib.npyio.NpzFile:
        if rank in self._files:
            return self._files[rank]
        path = self.directory / checkpoint.rank_file(rank)
        if not 0 <= rank < self.meta.world_size:
            raise RunError(f"{self.option} {self.directory}/meta.json: names rank {rank} of a checkpoint of "
                           f"{self.meta.world_size} rank(s)")
        try:
            npz = np.load(path, allow_pickle=False)
            saved = int(npz[checkpoint.STEP_KEY]) if checkpoint.STEP_KEY in npz.files else None
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise RunError(f"{self.option} {path}: unreadable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                           "the checkpoint is damaged") from None
        if saved is not None and saved != self.meta.step:
            npz.close()
            raise RunError(f"{self.option} {path}: holds the state of step {saved}, the checkpoint is at step "
                           f"{self.meta.step} (a rank file copied in from another checkpoint)")
        self._files[rank] = npz
        return npz
