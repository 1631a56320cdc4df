"""plan.json: its format, the names of OUT's files, and the one validating reader.

The transpiler writes the plan (transpiler/plan.py) and checks it with this reader before OUT is
renamed into place; the runtime (runtime/plan.py) and ``inspection/`` read it here. Validation is
shallow but complete for what the readers use: every such field is checked for presence and type,
so a bad or foreign plan fails at load with one line naming the file and the field
(``PlanError``), never later as a KeyError deep inside a rank. Schema: docs/contracts.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.errors import UserError

FORMAT = "graph-transpiler/plan"
# 2: a rank entry may be {"rank": r, "same_as": q} (rank r runs rank q's files, q < r), so plan.json
# holds the state list once per distinct set of rank graphs, not once per rank. Version 1 plans
# (every entry written out) are read as they always were.
FORMAT_VERSION = 2
READS_VERSIONS = (1, 2)
SAME_AS = "same_as"
STATE_KINDS = ("param", "buffer", "optimizer", "step", "loss_scale")  # loss_scale: --precision fp16
EXPORTED_KINDS = ("param", "buffer")  # state written back into the user's model by --export
PLAN_FILE = "plan.json"
SOURCE_MODEL_FILE = "model.onnx"  # the user's model, copied unchanged
SINGLE_STEM = "train"  # train.onnx, train_init.onnx, train_accum.onnx: the single-device graphs
EVAL_FILE = "eval.onnx"  # forward + loss in eval mode, one for every rank (absent in older OUTs)
EVAL_FIELD = "eval"  # plan.json's optional description of it
# Top-level fields that only describe the rewrite (inspect shows them; the runtime does not read them).
REPORT_FIELDS = {"frozen": list, "placement": dict, "buckets": list, "collectives": dict}
# Descriptive and optional (plans written before it lack it; readers then show "not recorded"):
# every float initializer with trained/frozen/buffer and the reason, the transpile summary line and
# the exporter rewrites it warned about. Checked for shape where present.
TRAINABLE_FIELD = "trainable"
TRAINABLE_STATUSES = ("trained", "frozen", "buffer")
# Optional (absent: float32 everywhere, as every plan written before it): the compute dtype of the
# step graphs' matrix products, the dtype of their gradient collectives, and fp16's loss scaling
# (docs/precision.md). Readers need it only to report the loss scale and skipped steps.
PRECISION_FIELD = "precision"
PRECISION_DTYPES = ("fp32", "bf16", "fp16")


def rank_stem(rank: int) -> str:
    return f"rank{rank}"


def graph_files(stem: str) -> dict[str, str]:
    """The file names of one set of graphs (``stem`` is SINGLE_STEM or ``rank_stem(r)``)."""
    return {"step": f"{stem}.onnx", "init": f"{stem}_init.onnx", "accum": f"{stem}_accum.onnx"}


class PlanError(UserError):
    """plan.json is missing, unreadable or not what the contract says. One line naming the file and,
    where there is one, the field; ``kind`` and ``details`` let a reader word it its own way."""

    def __init__(self, message: str, *, path: Path | str, field: str | None = None, kind: str = "invalid",
                 **details: Any):
        super().__init__(message)
        self.path, self.field, self.kind, self.details = Path(path), field, kind, details


@dataclass(frozen=True)
class DataInput:
    name: str
    dtype: str
    shape: tuple[int | str, ...]  # ints are fixed, strings symbolic ("batch" on the batch axis)
    batch_axis: int


@dataclass(frozen=True)
class Piece:
    """Elements ``[at, at + stop - start)`` of a flat state value are elements ``[start, stop)`` of
    the state ``of`` of the single-device graphs (``graphs.single.state``), flattened in C order."""

    of: str
    start: int
    stop: int
    at: int


@dataclass(frozen=True)
class StateEntry:
    """One state value carried between steps: fed as ``input``, read back from ``output``.

    ``shape`` and ``dtype`` are absent (None) in plans written before they were recorded. ``pieces``
    None: the value is the whole state of the single-device graphs named ``input`` (replicated or
    kept on one rank); a tuple (``zero``'s slices): a flat vector holding those pieces of whole
    states, zero elsewhere (padding). Together they let a checkpoint be read back by name, whole,
    whatever the world size and strategy that wrote it (runtime/reshard.py)."""

    input: str
    output: str
    kind: str
    param: str | None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    pieces: tuple[Piece, ...] | None = None


@dataclass(frozen=True)
class Accumulator:
    """A gradient accumulator of --grad-accumulation: zeros before a step's first micro-batch."""

    input: str
    output: str
    param: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Gradient:
    """The step graph's value ``value`` holds trained parameter ``param``'s local gradient (this
    rank's share of the batch) as the backward gives it: before any accumulation, cast to the
    collectives' dtype, collective or update. A runtime that accumulates micro-batches itself
    (``transpile run --grad-accumulation K`` on a plan transpiled without it) wraps these values."""

    param: str
    value: str


@dataclass(frozen=True)
class GraphFiles:
    step: Path
    init: Path
    state: tuple[StateEntry, ...]
    accum: Path | None = None  # the graph of the first K-1 micro-batches (grad_accumulation K > 1)
    accumulators: tuple[Accumulator, ...] = ()
    # Optional (absent in plans written before it: empty): every trained parameter's local gradient.
    gradients: tuple[Gradient, ...] = ()


@dataclass(frozen=True)
class EvalGraph:
    """The evaluation graph: fed the data inputs and ``state`` (parameter and buffer state inputs,
    named like the user's initializers, from the rank's current state); its output ``loss`` is the
    mean loss over the rows fed."""

    path: Path
    loss: str
    state: tuple[str, ...]


@dataclass(frozen=True)
class LossScaling:
    """fp16's dynamic loss scaling (torch.amp.GradScaler's rule), as the step graphs do it: the
    scale is state ``scale_state`` (0 before the first step, meaning ``init_scale``; after a step
    its output holds the scale the next step uses, GradScaler.get_scale() after update()), the
    growth tracker state ``growth_tracker_state``; the step graph's output ``skipped_output`` is
    1.0 where the step's update was skipped (a gradient was not finite), else 0.0."""

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    scale_state: str
    growth_tracker_state: str
    skipped_output: str


@dataclass(frozen=True)
class Precision:
    compute: str  # "fp32" | "bf16" | "fp16": the matrix products' dtype
    grad_dtype: str  # the gradient collectives' dtype
    loss_scaling: LossScaling | None = None


@dataclass(frozen=True)
class Parameter:
    name: str
    shape: tuple[int, ...]
    dtype: str
    root: int
    bucket: int


@dataclass(frozen=True)
class Plan:
    path: Path  # plan.json itself; graph files are resolved relative to its directory
    world_size: int
    strategy: str
    model: Path  # OUT/model.onnx, the user's model (source of --export)
    data_inputs: tuple[DataInput, ...]
    loss: str
    lr_input: str
    optimizer: dict[str, Any]
    parameters: tuple[Parameter, ...]
    single: GraphFiles
    ranks: tuple[GraphFiles, ...]  # ranks[r] is rank r's
    grad_accumulation: int = 1  # micro-batches per optimizer step
    grad_norm: str | None = None  # the step graphs' squared-gradient-norm output (--clip-grad-norm)
    eval: EvalGraph | None = None  # None: an OUT written before evaluation graphs existed
    precision: Precision | None = None  # None: float32 everywhere (the field is absent)
    sparse_gradients: tuple[str, ...] = ()  # tables whose gradients go as rows (--sparse-grads)
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # the JSON document, as read

    @property
    def out_dir(self) -> Path:
        return self.path.parent

    @property
    def lr(self) -> float:
        return float(self.optimizer["lr"])

    def graphs(self, rank: int | None) -> GraphFiles:
        """Rank ``rank``'s graphs, or the single-device ones for ``None``."""
        return self.single if rank is None else self.ranks[rank]


_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number", bool: "a boolean"}


def _type_names(types: type | tuple[type, ...]) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)


class _Reader:
    """Typed field access that names ``file: field 'a.b[2].c'`` in every error."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, what: str, kind: str = "invalid", **details) -> PlanError:
        return PlanError(f"{self.path}: field '{where}' {what}", path=self.path, field=where, kind=kind, **details)

    def get(self, obj: dict, key: str, types: type | tuple[type, ...], where: str, *, optional: bool = False):
        name = f"{where}.{key}" if where else key
        if key not in obj:
            if optional:
                return None
            raise self.fail(name, "is missing", "missing")
        value = obj[key]
        if optional and value is None:
            return None
        # bool is an int subclass; a JSON true where a count is expected is a bug in the writer.
        if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise self.fail(name, f"must be {_type_names(types)}, got {value!r}", "type", got=type(value).__name__)
        if not isinstance(value, types):
            raise self.fail(name, f"must be {_type_names(types)}, got {type(value).__name__}", "type",
                            got=type(value).__name__, expected=types)
        return value


def locate(given: str | Path) -> Path:
    """``given/plan.json`` (or ``given`` itself if it is a plan.json), or a PlanError."""
    given = Path(given)
    if not given.exists():
        raise PlanError(f"{given}: no such directory (give the -o directory of 'transpile')", path=given, kind="location")
    if given.is_file() and given.name != PLAN_FILE:
        raise PlanError(f"{given}: a file; give the -o directory of 'transpile' (it holds plan.json)", path=given,
                        kind="location")
    path = given / PLAN_FILE if given.is_dir() else given
    if not path.is_file():
        raise PlanError(f"{given}: no plan.json here; is it the -o directory of 'transpile'?", path=given, kind="location")
    return path


def load_plan(out_dir: str | Path, *, report_fields: bool = False) -> Plan:
    """Read ``out_dir/plan.json`` (or a plan.json path) and validate the fields readers use;
    ``report_fields`` also requires the descriptive fields (REPORT_FIELDS) that inspect shows."""
    path = locate(out_dir)
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"{path}: not readable as JSON: {str(exc).splitlines()[0]}", path=path) from None
    return parse_plan(raw, path, report_fields=report_fields)


def parse_plan(raw: Any, path: Path, *, report_fields: bool = False) -> Plan:
    """Validate a plan document (as read from ``path``; graph files are checked beside it)."""
    r = _Reader(path)
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: not a graph-transpiler plan (it must hold a JSON object, got {type(raw).__name__})",
                        path=path, kind="format", found=type(raw).__name__)
    fmt = r.get(raw, "format", str, "")
    if fmt != FORMAT:
        raise r.fail("format", f"is {fmt!r}, expected {FORMAT!r} (not a graph-transpiler plan)", "format", found=fmt)
    version = r.get(raw, "format_version", int, "")
    if version not in READS_VERSIONS:
        newer = " (written by a newer transpiler; upgrade the runtime)" if version > FORMAT_VERSION else ""
        raise r.fail("format_version", f"is {version}, this runtime reads {' and '.join(map(str, READS_VERSIONS))}{newer}",
                     "version",
                     found=version)
    if report_fields:
        for key, kind in REPORT_FIELDS.items():
            r.get(raw, key, kind, "")
        _trainable(raw, r)

    world_size = r.get(raw, "world_size", int, "")
    if world_size < 1:
        raise r.fail("world_size", f"must be >= 1, got {world_size}")
    graphs = r.get(raw, "graphs", dict, "")
    ranks_raw = r.get(graphs, "ranks", list, "graphs")
    if len(ranks_raw) != world_size:  # checked first: every per-rank field below depends on it
        raise r.fail("graphs.ranks", f"has {len(ranks_raw)} entries, world_size is {world_size}", "ranks",
                     world_size=world_size, entries=len(ranks_raw))
    strategy = r.get(raw, "strategy", str, "")
    # What the rank graphs do is in their collectives: a reader runs any strategy's plan, so a new
    # strategy (transpiler/strategies/) needs nothing here. The name is for people (inspect).
    if not strategy:
        raise r.fail("strategy", "is empty; expected the name of the strategy that wrote the plan")

    source = r.get(raw, "source_model", dict, "")
    model = path.parent / r.get(source, "file", str, "source_model")

    data_inputs = tuple(_data_input(d, r, f"data_inputs[{i}]") for i, d in enumerate(r.get(raw, "data_inputs", list, "")))
    if not data_inputs:
        raise r.fail("data_inputs", "is empty (a step graph needs data)")

    optimizer = r.get(raw, "optimizer", dict, "")
    r.get(optimizer, "lr", (int, float), "optimizer")

    parameters = tuple(_parameter(p, r, f"parameters[{i}]", world_size) for i, p in enumerate(r.get(raw, "parameters", list, "")))

    accumulation = r.get(raw, "grad_accumulation", int, "", optional=True) or 1  # absent in older plans
    if accumulation < 1:
        raise r.fail("grad_accumulation", f"is {accumulation}, must be >= 1")
    trained = [p.name for p in parameters]
    single = _graph_files(r.get(graphs, "single", dict, "graphs"), r, "graphs.single", accumulation, trained)
    ranks = []
    for i, entry in enumerate(ranks_raw):
        where = f"graphs.ranks[{i}]"
        if not isinstance(entry, dict):
            raise r.fail(where, "must be an object")
        if r.get(entry, "rank", int, where) != i:
            raise r.fail(f"{where}.rank", f"is {entry['rank']}, expected {i} (ranks must be listed in order)")
        if SAME_AS in entry and version >= 2:
            same = r.get(entry, SAME_AS, int, where)
            if not 0 <= same < i:
                raise r.fail(f"{where}.{SAME_AS}", f"is {same}, expected an earlier rank (0..{i - 1})")
            ranks.append(ranks[same])
            # Written out in the document as read, so readers of ``raw`` see every rank's entry.
            ranks_raw[i] = {**ranks_raw[same], "rank": i}
            continue
        ranks.append(_graph_files(entry, r, where, accumulation, trained))
    _check_pieces(single, ranks, r)

    return Plan(
        path=path,
        world_size=world_size,
        strategy=strategy,
        model=model,
        data_inputs=data_inputs,
        loss=r.get(raw, "loss", str, ""),
        lr_input=r.get(raw, "lr_input", str, ""),
        optimizer=optimizer,
        parameters=parameters,
        single=single,
        ranks=tuple(ranks),
        grad_accumulation=accumulation,
        grad_norm=r.get(raw, "grad_norm_output", str, "", optional=True),
        eval=_eval_graph(r.get(raw, EVAL_FIELD, dict, "", optional=True), r),
        precision=_precision(r.get(raw, PRECISION_FIELD, dict, "", optional=True), r),
        sparse_gradients=_sparse_gradients(r.get(raw, "sparse_gradients", list, "", optional=True), trained, r),
        raw=raw,
    )


def _sparse_gradients(raw: list | None, trained: list[str], r: _Reader) -> tuple[str, ...]:
    """``sparse_gradients``: where present, trained parameters, each once."""
    if raw is None:
        return ()
    if any(not isinstance(p, str) or p not in trained for p in raw) or len(set(raw)) != len(raw):
        raise r.fail("sparse_gradients", "must name trained parameters of 'parameters', each once")
    return tuple(raw)


def _eval_graph(section: dict | None, r: _Reader) -> EvalGraph | None:
    if section is None:
        return None
    path = r.path.parent / r.get(section, "graph", str, EVAL_FIELD)
    if not path.is_file():
        raise r.fail(f"{EVAL_FIELD}.graph", f"names {path.name}, which is not in {r.path.parent}")
    state = r.get(section, "state", list, EVAL_FIELD)
    for i, name in enumerate(state):
        if not isinstance(name, str):
            raise r.fail(f"{EVAL_FIELD}.state[{i}]", f"must be a string, got {name!r}")
    return EvalGraph(path, r.get(section, "loss", str, EVAL_FIELD), tuple(state))


def _precision(section: dict | None, r: _Reader) -> Precision | None:
    if section is None:
        return None
    dtypes = {}
    for key in ("compute", "grad_dtype"):
        dtypes[key] = r.get(section, key, str, PRECISION_FIELD)
        if dtypes[key] not in PRECISION_DTYPES:
            raise r.fail(f"{PRECISION_FIELD}.{key}", f"is {dtypes[key]!r}, expected one of {', '.join(PRECISION_DTYPES)}")
    scaling = r.get(section, "loss_scaling", dict, PRECISION_FIELD, optional=True)
    if scaling is not None:
        where = f"{PRECISION_FIELD}.loss_scaling"
        numbers = {key: float(r.get(scaling, key, (int, float), where))
                   for key in ("init_scale", "growth_factor", "backoff_factor")}
        interval = r.get(scaling, "growth_interval", int, where)
        if not (numbers["init_scale"] > 0 and numbers["growth_factor"] > 1 and 0 < numbers["backoff_factor"] < 1
                and interval >= 1):
            raise r.fail(where, "needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        names = {key: r.get(scaling, key, str, where)
                 for key in ("scale_state", "growth_tracker_state", "skipped_output")}
        scaling = LossScaling(**numbers, growth_interval=interval, **names)
    return Precision(dtypes["compute"], dtypes["grad_dtype"], scaling)


def _trainable(raw: dict, r: _Reader) -> None:
    section = r.get(raw, TRAINABLE_FIELD, dict, "", optional=True)
    if section is None:
        return
    r.get(section, "summary", str, TRAINABLE_FIELD)
    for i, w in enumerate(r.get(section, "warnings", list, TRAINABLE_FIELD)):
        if not isinstance(w, str):
            raise r.fail(f"{TRAINABLE_FIELD}.warnings[{i}]", "must be a string")
    for i, entry in enumerate(r.get(section, "initializers", list, TRAINABLE_FIELD)):
        where = f"{TRAINABLE_FIELD}.initializers[{i}]"
        if not isinstance(entry, dict):
            raise r.fail(where, "must be an object")
        r.get(entry, "name", str, where)
        status = r.get(entry, "status", str, where)
        if status not in TRAINABLE_STATUSES:
            raise r.fail(f"{where}.status", f"is {status!r}, expected one of {', '.join(TRAINABLE_STATUSES)}")
        r.get(entry, "reason", str, where, optional=True)
        r.get(entry, "why", str, where, optional=True)


def _data_input(d: Any, r: _Reader, where: str) -> DataInput:
    if not isinstance(d, dict):
        raise r.fail(where, "must be an object")
    shape = r.get(d, "shape", list, where)
    for j, dim in enumerate(shape):
        if isinstance(dim, bool) or not isinstance(dim, (int, str)):
            raise r.fail(f"{where}.shape[{j}]", f"must be an integer or a name, got {dim!r}")
    axis = r.get(d, "batch_axis", int, where)
    if not 0 <= axis < len(shape):
        raise r.fail(f"{where}.batch_axis", f"is {axis}, outside a shape of rank {len(shape)}")
    return DataInput(r.get(d, "name", str, where), r.get(d, "dtype", str, where), tuple(shape), axis)


def _parameter(p: Any, r: _Reader, where: str, world_size: int) -> Parameter:
    if not isinstance(p, dict):
        raise r.fail(where, "must be an object")
    root = r.get(p, "root", int, where)
    if not 0 <= root < world_size:
        raise r.fail(f"{where}.root", f"is {root}, outside world_size {world_size}")
    return Parameter(
        name=r.get(p, "name", str, where),
        shape=tuple(r.get(p, "shape", list, where)),
        dtype=r.get(p, "dtype", str, where),
        root=root,
        bucket=r.get(p, "bucket", int, where),
    )


def _pieces(raw: list | None, shape: list | None, r: _Reader, where: str) -> tuple[Piece, ...] | None:
    if raw is None:
        return None
    if shape is None or len(shape) != 1:
        raise r.fail(f"{where}.pieces", f"needs a flat (1-d) 'shape' on its entry, got {shape!r}")
    pieces = []
    for i, p in enumerate(raw):
        pw = f"{where}.pieces[{i}]"
        if not isinstance(p, dict):
            raise r.fail(pw, "must be an object")
        start, stop, at = (r.get(p, key, int, pw) for key in ("start", "stop", "at"))
        if not (0 <= start < stop and 0 <= at and at + stop - start <= shape[0]):
            raise r.fail(pw, f"needs 0 <= start < stop and at + stop - start <= {shape[0]}, got start {start}, "
                             f"stop {stop}, at {at}")
        pieces.append(Piece(r.get(p, "of", str, pw), start, stop, at))
    return tuple(pieces)


def _check_pieces(single: GraphFiles, ranks: list[GraphFiles], r: _Reader) -> None:
    """Every piece names a state of the single-device graphs and lies inside it (where its shape is known)."""
    sizes = {s.input: None if s.shape is None else math.prod(s.shape) for s in single.state}
    for i, files in enumerate(ranks):
        for j, s in enumerate(files.state):
            for k, p in enumerate(s.pieces or ()):
                where = f"graphs.ranks[{i}].state[{j}].pieces[{k}]"
                if p.of not in sizes:
                    raise r.fail(f"{where}.of", f"is {p.of!r}, not a state of graphs.single")
                if sizes[p.of] is not None and p.stop > sizes[p.of]:
                    raise r.fail(f"{where}.stop", f"is {p.stop}, beyond the {sizes[p.of]} elements of {p.of!r}")


def _gradients(raw: list | None, trained: list[str], r: _Reader, where: str) -> tuple[Gradient, ...]:
    """``gradients``: where present, one entry per trained parameter (``parameters``), each once."""
    if raw is None:
        return ()
    gradients = []
    for i, entry in enumerate(raw):
        gw = f"{where}.gradients[{i}]"
        if not isinstance(entry, dict):
            raise r.fail(gw, "must be an object")
        gradients.append(Gradient(r.get(entry, "param", str, gw), r.get(entry, "value", str, gw)))
    named = [g.param for g in gradients]
    if sorted(named) != sorted(trained):
        extra = sorted(set(named) - set(trained)) or sorted({p for p in named if named.count(p) > 1})
        lacking = sorted(set(trained) - set(named))
        raise r.fail(f"{where}.gradients", "must name each trained parameter of 'parameters' once"
                     + (f"; names {', '.join(extra[:3])} too often or not a trained parameter" if extra else "")
                     + (f"; lacks {', '.join(lacking[:3])}" if lacking else ""))
    return tuple(gradients)


def _graph_files(g: dict, r: _Reader, where: str, accumulation: int, trained: list[str]) -> GraphFiles:
    files = {}
    for key in ("step", "init", *(("accum",) if accumulation > 1 else ())):
        path = r.path.parent / r.get(g, key, str, where)
        if not path.is_file():
            raise r.fail(f"{where}.{key}", f"names {path.name}, which is not in {r.path.parent}")
        files[key] = path
    state = []
    for i, s in enumerate(r.get(g, "state", list, where)):
        sw = f"{where}.state[{i}]"
        if not isinstance(s, dict):
            raise r.fail(sw, "must be an object")
        # Kinds "param" and "buffer" mean something to the runtime (--export writes them back); the
        # others (optimizer, step) are carried opaquely, so new kinds need no change here.
        kind = r.get(s, "kind", str, sw)
        shape = r.get(s, "shape", list, sw, optional=True)
        if shape is not None and any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise r.fail(f"{sw}.shape", f"must list non-negative integers, got {shape!r}")
        state.append(StateEntry(r.get(s, "input", str, sw), r.get(s, "output", str, sw), kind,
                                r.get(s, "param", str, sw, optional=True),
                                None if shape is None else tuple(shape), r.get(s, "dtype", str, sw, optional=True),
                                _pieces(r.get(s, "pieces", list, sw, optional=True), shape, r, sw)))
    accumulators = []
    for i, a in enumerate(r.get(g, "accumulators", list, where) if accumulation > 1 else []):
        aw = f"{where}.accumulators[{i}]"
        if not isinstance(a, dict):
            raise r.fail(aw, "must be an object")
        shape = r.get(a, "shape", list, aw)
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise r.fail(f"{aw}.shape", f"must list non-negative integers, got {shape!r}")
        accumulators.append(Accumulator(r.get(a, "input", str, aw), r.get(a, "output", str, aw),
                                        r.get(a, "param", str, aw), tuple(shape), r.get(a, "dtype", str, aw)))
    return GraphFiles(files["step"], files["init"], tuple(state), files.get("accum"), tuple(accumulators),
                      _gradients(r.get(g, "gradients", list, where, optional=True), trained, r, where))
