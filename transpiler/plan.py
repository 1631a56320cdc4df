"""Write OUT: the graphs and plan.json (docs/contracts.md), atomically."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

import onnx
import onnx.checker
import onnx_ir as ir

from contract.collectives import SHAPED_BY_INPUT
from contract.names import GRAD_NORM_OUTPUT, LR_INPUT, NEXT
from contract.plan import (
    EVAL_FIELD,
    EVAL_FILE,
    FORMAT,
    FORMAT_VERSION,
    PLAN_FILE,
    PRECISION_FIELD,
    SAME_AS,
    SINGLE_STEM,
    SOURCE_MODEL_FILE,
    PlanError,
    graph_files,
    parse_plan,
    rank_stem,
)
from transpiler.collectives import bucket_tensors, collective_nodes
from transpiler.errors import TranspileError
from transpiler.eval_graph import build_eval_graph, eval_entry
from transpiler.job import Job, RankGraphs, reduced_gradient_name
from transpiler.passes.precision import precision_json
from transpiler.placement import METHODS, place
from transpiler.sparse_grads import ALL_ROWS_SUFFIX, ROWS_SUFFIX
from transpiler.weights import attach_weights, detach_weights

# Protobuf cannot serialize a message over 2 GiB; larger graphs keep their tensors beside them.
EXTERNAL_DATA_BYTES = 1 << 30


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("graph-transpiler")
    except PackageNotFoundError:
        return "0+unknown"


def _checked(model: ir.Model | onnx.ModelProto, name: str, locations: dict[str, str]) -> onnx.ModelProto:
    """``model`` serialized (a proto as it is) and checked; ``locations``: the weight references'
    files -> their names in OUT."""
    proto = model if isinstance(model, onnx.ModelProto) else ir.serde.serialize_model(model)
    for tensor in proto.graph.initializer:  # large weights stay where OUT's model.onnx holds them
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = locations[entry.value]
    # The lowest IR version the opset allows: onnx stamps its newest by default, which onnxruntime
    # releases often do not load yet.
    default_opset = [o for o in proto.opset_import if o.domain in ("", "ai.onnx")]
    proto.ir_version = min(proto.ir_version, onnx.helper.find_min_ir_version_for(default_opset, ignore_unknown=True))
    weights, stand_ins = detach_weights(proto)  # the passes below need the weights' types only
    try:
        proto = onnx.shape_inference.infer_shapes(proto)
    except Exception:
        pass  # types of the collectives' outputs are already explicit; inference only adds detail
    try:
        onnx.checker.check_model(proto)
    except Exception as exc:
        raise TranspileError(f"internal error: {name} fails onnx.checker ({' '.join(str(exc).split())[:300]})") from None
    attach_weights(proto, weights, stand_ins)
    return proto


class _GraphWriter:
    """Writes each distinct graph once. Ranks given the same graph object (``Strategy.rank_key``),
    or whose graphs serialize to the same bytes, share one file, named after the first rank that
    runs it; plan.json says which file each rank runs."""

    def __init__(self, directory: Path, locations: dict[str, str]):
        self.directory, self.locations = directory, locations
        self.by_object: dict[int, str] = {}
        self.by_content: dict[str, str] = {}

    def write(self, model: ir.Model | onnx.ModelProto, name: str) -> str:
        """The file that holds ``model``: ``name``, or the one an identical graph was written to."""
        if id(model) in self.by_object:
            return self.by_object[id(model)]
        proto = _checked(model, name, self.locations)
        path = self.directory / name
        if _tensor_bytes(proto) > EXTERNAL_DATA_BYTES:  # too large to compare in memory: its own file
            onnx.save_model(proto, path, save_as_external_data=True, location=path.name + ".data", size_threshold=1024)
        else:
            data = proto.SerializeToString()
            digest = hashlib.sha256(data).hexdigest()
            if digest in self.by_content:
                name = self.by_content[digest]
            else:
                path.write_bytes(data)
                self.by_content[digest] = name
        self.by_object[id(model)] = name
        return name


def _tensor_bytes(proto: onnx.ModelProto) -> int:
    """The initializers' bytes, from their dims (ByteSize() would walk the whole message)."""
    total = 0
    for t in proto.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        n = 1
        for d in t.dims:
            n *= d
        total += n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total


def _collectives_json(job: Job, graphs: RankGraphs, phase: str) -> list[dict]:
    """The (rank-independent) collective sequence, described by the parameters it moves."""
    model = graphs.step if phase == "step" else graphs.init
    by_param = {}
    for p in job.problem.params:
        slots = [f"{p}.{slot}" for slot in job.options.optimizer.slots()]
        for name in (p, p + NEXT, p + ".updated", job.grad_names[p], job.grad_names[p] + ".mean",
                     job.grad_names[p] + ROWS_SUFFIX, job.grad_names[p] + ALL_ROWS_SUFFIX,
                     reduced_gradient_name(job, p), *slots):
            by_param[name] = p
    out = []
    for node in sorted(collective_nodes(model.graph), key=lambda n: n.attributes["order"].as_int()):
        attrs = {k: a.value for k, a in node.attributes.items()}
        tensors = bucket_tensors(node)
        out.append(
            {
                "order": attrs["order"],
                "op": node.op_type,
                "root": attrs.get("root"),
                "bucket": attrs["bucket"],
                "reduction": attrs.get("reduction"),
                # Collectives inside the forward (--sync-bn statistics) move no parameter: named by tensor.
                "params": [by_param.get(v.name, v.name) for v in tensors],
                # An AllConcat's rows grow with the batch: no size before a run (null).
                "bytes": None if node.op_type in SHAPED_BY_INPUT else sum(v.dtype.bitwidth // 8 * _numel(v) for v in tensors),
            }
        )
    return out


def _numel(value: ir.Value) -> int:
    n = 1
    for d in value.shape.numpy():
        n *= int(d)
    return n


def plan_json(job: Job, files: dict[int | None, dict[str, str]] | None = None) -> dict:
    """``files``: the graph file each rank runs, per kind (default: each rank its own)."""
    problem, opts = job.problem, job.options
    placement = job.placement
    others = {}
    for method in METHODS:
        if method != placement.method:
            alt = place(job.sizes, opts.world_size, method)
            others[method] = {**alt.to_json(), "imbalance": round(alt.imbalance, 6)}
    bucket_of = {p: b.id for b in job.buckets for p in b.params}
    params_json = []
    for p in job.grad_order:
        value = problem.model.graph.initializers[p]
        params_json.append(
            {
                "name": p,
                "shape": [int(d) for d in value.shape.numpy()],
                "dtype": value.dtype.numpy().name,
                "bytes": job.sizes[p],
                "root": placement.roots[p],
                "bucket": bucket_of[p],
            }
        )

    def graphs_json(g: RankGraphs, stem: str) -> dict:
        names = files[g.rank] if files is not None else graph_files(stem)
        entry = {"step": names["step"], "init": names["init"], "state": [s.to_json() for s in g.state]}
        entry["optimizer_state_bytes"] = sum(s.bytes for s in g.state if s.kind == "optimizer")
        entry["updates"] = list(g.updates)
        # Each trained parameter's local gradient in this step graph (transpile run --grad-accumulation).
        if not job.sparse:  # with tables sent as rows there is no dense gradient to wrap at run time
            entry["gradients"] = [{"param": p, "value": v} for p, v in g.gradients.items()]
        if g.accum is not None:
            entry["accum"] = names["accum"]
            entry["accumulators"] = [a.to_json() for a in g.accumulators]
        return entry

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "world_size": opts.world_size,
        "strategy": opts.strategy,
        "source_model": {"file": SOURCE_MODEL_FILE, "sha256": problem.sha256, "path": str(problem.path.resolve())},
        "opset": problem.opset,
        "data_inputs": [
            {"name": d.name, "dtype": d.dtype, "shape": d.shape, "batch_axis": d.batch_axis} for d in problem.data_inputs
        ],
        "loss": problem.loss,
        "lr_input": LR_INPUT,
        "optimizer": opts.optimizer.to_json(),
        "bucket_mb": job.bucket_mb,  # the cap used: --bucket-mb, or the automatic one (transpiler/bucketing.py)
        # Optional: present only with --first-bucket-mb.
        **({"first_bucket_mb": opts.first_bucket_mb} if opts.first_bucket_mb is not None else {}),
        "grad_accumulation": opts.grad_accumulation,
        # Optional: present only with --sparse-grads: the tables whose gradients go as rows.
        **({"sparse_gradients": list(job.sparse)} if job.sparse else {}),
        # Optional: present only for --precision bf16|fp16 or --grad-dtype (docs/precision.md).
        **({PRECISION_FIELD: section} if (section := precision_json(job)) is not None else {}),
        # Optional: the step graphs' squared gradient norm (only with --clip-grad-norm).
        **({"grad_norm_output": GRAD_NORM_OUTPUT} if opts.optimizer.max_grad_norm is not None else {}),
        "parameters": params_json,
        # Optional (older plans lack it): the eval-mode forward + loss, for transpile run --eval-data.
        EVAL_FIELD: eval_entry(problem),
        "frozen": list(problem.frozen),
        # Optional (older plans lack it): every float initializer with its decision and reason, the
        # one-line summary `transpile` prints, and the exporter rewrites it warned about.
        "trainable": {
            "summary": problem.selection.summary() if problem.selection else "",
            "initializers": problem.selection.to_json(problem.model.graph) if problem.selection else [],
            "warnings": list(problem.warnings),
        },
        "placement": {**placement.to_json(), "other_methods": others},
        "buckets": [b.to_json() for b in job.buckets],
        "graphs": {
            "single": graphs_json(job.single, SINGLE_STEM),
            "ranks": _ranks_json(job.ranks, lambda g: graphs_json(g, rank_stem(g.rank))),
        },
        "collectives": {
            "init": _collectives_json(job, job.ranks[0], "init"),
            "step": _collectives_json(job, job.ranks[0], "step"),
        },
        "versions": {"graph_transpiler": _version(), "onnx": onnx.__version__, "onnx_ir": ir.__version__},
    }


def _ranks_json(ranks: list[RankGraphs], entry) -> list[dict]:
    """One entry per rank; a rank built as an earlier one (``Strategy.rank_key``: the same graph
    objects, hence the same files, state and updates) is written ``{"rank": r, "same_as": q}``, so
    plan.json does not repeat the state list N times (contract/plan.py, format_version 2)."""
    first: dict[tuple, int] = {}
    out = []
    for g in ranks:
        key = (id(g.step), id(g.init), id(g.accum), id(g.state), id(g.updates))
        if key in first:
            out.append({"rank": g.rank, SAME_AS: first[key]})
        else:
            first[key] = g.rank
            out.append({"rank": g.rank, **entry(g)})
    return out


def check_out_dir(out_dir: str | Path) -> Path:
    """The resolved OUT, or a TranspileError if writing it would destroy something else.

    OUT is replaced as a whole, so it must be new, empty, or an earlier OUT (it holds plan.json):
    never the user's project directory, the model's folder or ".".
    """
    if str(out_dir).strip() == "":
        raise TranspileError("-o: empty path; give the output directory")
    out = Path(out_dir).resolve()
    blocker = next((a for a in (out, *out.parents) if a.exists()), None)
    if blocker is not None and not blocker.is_dir():
        what = "exists and is not a directory" if blocker == out else f"{blocker} is a file, not a directory"
        raise TranspileError(f"-o {out_dir}: {what}")
    if out.is_dir() and not (out / PLAN_FILE).is_file() and any(out.iterdir()):
        raise TranspileError(f"-o {out_dir}: {out} is a non-empty directory that is not a transpiler output (no "
                             "plan.json); OUT is replaced as a whole, so give a new or empty directory")
    return out


def write_out(job: Job, out_dir: str | Path) -> dict:
    """Write every file into a temporary sibling of OUT, then swap it into place.

    A failure leaves no OUT behind (and an existing OUT untouched until the new one is complete).
    An I/O error (a full or read-only file system, no permission, EIO) is one TranspileError naming
    the path (as it would be in OUT) and the error, after the temporary directory is removed.
    """
    out_dir = check_out_dir(out_dir)
    existed = out_dir.exists()
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TranspileError(f"-o {out_dir}: cannot create {exc.filename or out_dir.parent}: {os_error_text(exc)}") from None
    # Named before it exists and created inside the try: Ctrl-C or SIGTERM (raised as exceptions,
    # commands/main.py) right after the mkdir still removes it. With mkdtemp a signal landing between
    # its mkdir and the try left the directory behind (seen under load in test_cli_safety).
    _remove_stale_temporaries(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        tmp.mkdir()
        tmp.chmod(0o777 & ~_umask())  # OUT gets the permissions of any new directory
        # The user's bytes unchanged (and its external data files): OUT does not depend on them,
        # and the graphs reference the weights in them rather than holding copies.
        locations = {}
        for location, (source, name) in job.problem.files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, tmp / name)
            locations[location] = name
        writer = _GraphWriter(tmp, locations)
        files = {}  # rank (None: single device) -> kind -> the file it runs
        for g, stem in ((job.single, SINGLE_STEM), *((g, rank_stem(g.rank)) for g in job.ranks)):
            names = graph_files(stem)
            files[g.rank] = {kind: writer.write(model, names[kind])
                             for kind, model in (("step", g.step), ("init", g.init), ("accum", g.accum))
                             if model is not None}
        writer.write(build_eval_graph(job.problem), EVAL_FILE)
        plan = plan_json(job, files)
        text = json.dumps(plan, indent=1) + "\n"
        (tmp / PLAN_FILE).write_text(text)
        try:  # the readers' own validation, before OUT exists: writer and readers cannot drift apart
            plan = parse_plan(json.loads(text), tmp / PLAN_FILE, report_fields=True).raw  # as readers see it
        except PlanError as exc:
            raise TranspileError(f"internal error: the plan written breaks the contract: {exc}") from None
        _swap_in(tmp, out_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = "; the earlier OUT is unchanged" if existed else ""
        raise TranspileError(f"-o {out_dir}: cannot write {_as_in_out(exc, tmp, out_dir)}: {os_error_text(exc)}; "
                             f"nothing was written{kept}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return plan


def _swap_in(tmp: Path, out_dir: Path) -> None:
    """Put the complete ``tmp`` in the place of OUT; on an error an existing OUT is put back."""
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-{os.getpid()}-", dir=out_dir.parent))
    try:
        os.replace(out_dir, old / "out")
        try:
            os.replace(tmp, out_dir)
        except OSError:
            os.replace(old / "out", out_dir)
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _as_in_out(exc: OSError, tmp: Path, out_dir: Path) -> str:
    """The path of an OSError as the user would see it in OUT (not in the temporary directory)."""
    names = [Path(os.fsdecode(n)) for n in (exc.filename2, exc.filename) if n is not None]  # a copy's target first
    for path in names:
        with contextlib.suppress(ValueError):
            return str(out_dir / path.relative_to(tmp))
    return str(names[-1]) if names else str(out_dir)


def os_error_text(exc: OSError) -> str:
    """'No space left on device (ENOSPC)': the OS error of ``exc`` for a one-line message."""
    name = errno.errorcode.get(exc.errno or 0)
    text = exc.strerror or (str(exc).splitlines() or [type(exc).__name__])[0]
    return f"{text} ({name})" if name else text


def _remove_stale_temporaries(out_dir: Path) -> None:
    """Remove what a killed ``transpile`` to the same OUT left (kill -9 leaves no chance to clean
    up): our hidden ``.OUT.tmp-<pid>-<id>`` and ``.OUT.old-<pid>-<id>`` siblings whose process is
    gone. A live pid (another transpile running now) is left alone."""
    pattern = re.compile(rf"^\.{re.escape(out_dir.name)}\.(?:tmp|old)-(\d+)-[0-9a-z_]+$")
    try:
        siblings = list(out_dir.parent.iterdir())
    except OSError:
        return
    for path in siblings:
        match = pattern.match(path.name)
        if match is None or not path.is_dir() or path.is_symlink():
            continue
        pid = int(match.group(1))
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # its owner still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(path, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
