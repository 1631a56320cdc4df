"""Load and validate the user's model: find its data inputs, its loss and its trainable parameters."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx.checker
import onnx.shape_inference
import onnx.version_converter
import onnx_ir as ir

from contract.plan import SOURCE_MODEL_FILE
from transpiler.autodiff import check_supported, differentiable_values
from transpiler.autodiff._context import FLOAT_TYPES
from transpiler.batch_constants import baked_batch_size
from transpiler.batchnorm import decompose_batchnorm
from transpiler.errors import TranspileError, UnsupportedOpsError
from transpiler.lazy_weights import LazyModel, read_lazy
from transpiler.trainable import Selection, folded_batchnorm, merged_parameters, select, transposed_copies
from transpiler.weights import attach_weights, detach_weights, raw_bytes

# Graphs handed to autodiff and the optimizer are at least this opset, so every Reduce* op takes
# its axes as an input and the rules need to know one form only.
MIN_OPSET = 18
BATCH_DIM = "batch"



@dataclass
class DataInput:
    name: str
    dtype: str  # numpy dtype name
    shape: list[int | str | None]
    batch_axis: int = 0


@dataclass
class Problem:
    """What training the user's model means: a forward graph, its loss and what to train."""

    path: Path
    # The files OUT copies so that its graphs' weight references resolve there: location -> (file,
    # name in OUT); the model file itself becomes OUT's model.onnx (transpiler/lazy_weights.py).
    files: dict[str, tuple[Path, str]]
    sha256: str
    model: ir.Model  # forward graph, opset >= MIN_OPSET, batch axes symbolic, shapes inferred
    loss: str
    data_inputs: list[DataInput]
    params: list[str]  # trainable initializers, in graph order
    frozen: list[str] = field(default_factory=list)  # float initializers not trained
    external_data: bool = False  # the model file keeps its tensors in separate files
    buffers: list[str] = field(default_factory=list)  # updated every step, not trained (BN running stats)
    # Every float initializer: name -> (trained | frozen | buffer, reason code; transpiler/trainable.py)
    selection: Selection | None = None
    warnings: list[str] = field(default_factory=list)  # exporter rewrites seen (merged parameters, folded BN)

    @property
    def opset(self) -> int:
        return self.model.opset_imports.get("", 0)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def read_model(path: str | Path) -> LazyModel:
    """The model with its large weights left on disk as references (transpiler/lazy_weights.py)."""
    path = Path(path)
    if path.is_dir():
        raise TranspileError(f"{path}: a directory, not an ONNX model file")
    if not path.is_file():
        raise TranspileError(f"{path}: no such file")
    try:
        lazy = read_lazy(path, SOURCE_MODEL_FILE)
    except TranspileError:
        raise
    except Exception as exc:  # protobuf raises DecodeError and friends; the scanner ValueError, IndexError
        raise TranspileError(f"{path}: not an ONNX model ({_one_line(exc)})") from None
    if not lazy.proto.HasField("graph") or not lazy.proto.graph.node:
        raise TranspileError(f"{path}: not an ONNX model (no graph or no nodes)")
    return lazy


def _upgrade(proto: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset >= MIN_OPSET:
        return proto
    try:
        return onnx.version_converter.convert_version(proto, MIN_OPSET)
    except Exception as exc:
        raise TranspileError(
            f"{path}: cannot upgrade opset {opset} to {MIN_OPSET} ({_one_line(exc)}); re-export with opset >= {MIN_OPSET}"
        ) from None


def _check_raw_sizes(proto: onnx.ModelProto, path: Path) -> None:
    """An initializer's raw_data must hold its declared shape exactly (the checker skips the large
    ones, which are detached before it runs: a short one would fail deep inside a later pass)."""
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL or not tensor.raw_data:
            continue
        want = raw_bytes(tensor)
        if want is not None and len(tensor.raw_data) != want:
            raise TranspileError(f"{path}: initializer '{tensor.name}' holds {len(tensor.raw_data)} bytes of raw_data, "
                                 f"its shape {list(tensor.dims)} of {onnx.TensorProto.DataType.Name(tensor.data_type).lower()} "
                                 f"needs {want}; the file is truncated or damaged")


def _infer(proto: onnx.ModelProto, *, strict: bool) -> onnx.ModelProto:
    proto = onnx.shape_inference.infer_shapes(proto, check_type=strict, strict_mode=strict, data_prop=True)
    # Typing one such output lets inference reach the next one: repeat until nothing changes.
    for _ in range(len(proto.graph.node)):
        if not _type_like_input(proto):
            break
        proto = onnx.shape_inference.infer_shapes(proto, check_type=strict, strict_mode=strict, data_prop=True)
    return proto


# Two batch sizes that no exporter's example batch is likely to be, at which shapes are inferred to
# tell the dims that follow the batch from fixed ones.
_PROBE_BATCHES = (5, 7)


def _shapes_at(proto: onnx.ModelProto, data_names: list[str], rows: int) -> dict[str, list]:
    """Every value's dims (None where unknown) with the data inputs' axis 0 set to ``rows``; shape
    inference as lenient as it goes (a graph baked for another batch fails at some node; the values
    after it stay unknown). Empty if inference fails outright."""
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    for vi in probe.graph.input:
        if vi.name in data_names and vi.type.tensor_type.shape.dim:
            vi.type.tensor_type.shape.dim[0].dim_value = rows
    try:
        probe = _infer(probe, strict=False)
    except Exception:
        return {}
    graph = probe.graph
    return {vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
            for vi in [*graph.input, *graph.value_info, *graph.output]
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")}


def _make_batch_symbolic(proto: onnx.ModelProto, data_names: list[str]) -> None:
    # Each rank is fed B/N rows and one device B rows, so the batch axis must not be a constant.
    for vi in proto.graph.input:
        if vi.name in data_names and vi.type.tensor_type.shape.dim:
            dim = vi.type.tensor_type.shape.dim[0]
            dim.Clear()
            dim.dim_param = BATCH_DIM
    # Stale value_info (with the old batch size) would contradict the new shapes.
    del proto.graph.value_info[:]


def _fold_integer_constants(proto: onnx.ModelProto) -> None:
    """Replace nodes that compute integers from constants alone by Constant nodes.

    Exporters without constant folding (TorchScript with do_constant_folding=False, as training
    export wants) feed Slice/Reshape/ReduceSum their starts, axes and shapes through chains like
    Unsqueeze(Constant); gradient rules need those as constants. Only integer and boolean results
    are folded: float arithmetic stays in the graph, computed as the user's model computes it.
    """
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    known: dict[str, np.ndarray] = {}
    integer_types = {onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT16, onnx.TensorProto.INT8,
                     onnx.TensorProto.UINT64, onnx.TensorProto.UINT32, onnx.TensorProto.UINT16, onnx.TensorProto.UINT8,
                     onnx.TensorProto.BOOL}
    for tensor in proto.graph.initializer:
        if tensor.data_type in integer_types:
            known[tensor.name] = numpy_helper.to_array(tensor)
    opset = [o for o in proto.opset_import if o.domain in ("", "ai.onnx")]
    nodes = []
    for node in proto.graph.node:
        foldable = (
            node.domain in ("", "ai.onnx")
            and (node.op_type == "Constant" or (node.input and all(i in known for i in node.input if i)))
            and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        )
        if foldable:
            try:
                model = onnx.helper.make_model(
                    onnx.helper.make_graph([node], "fold", [], [onnx.helper.make_empty_tensor_value_info(o) for o in node.output],
                                           [numpy_helper.from_array(known[i], i) for i in dict.fromkeys(node.input) if i]),
                    opset_imports=opset)
                results = ReferenceEvaluator(model).run(None, {})
            except Exception:  # not evaluable here: leave it to the runtime
                results = None
            if results is not None and all(np.asarray(r).dtype.kind in "iub" for r in results):
                for name, result in zip(node.output, results):
                    known[name] = np.asarray(result)
                    if node.op_type != "Constant":
                        nodes.append(onnx.helper.make_node("Constant", [], [name], name=f"{node.name or name}/folded",
                                                           value=numpy_helper.from_array(known[name])))
                if node.op_type != "Constant":
                    continue
        nodes.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)


def _shape_of(value: ir.Value) -> list[int | str | None]:
    if value.shape is None:
        return []
    return [d if isinstance(d, int) else (d.value if d.value is not None else None) for d in value.shape]


def _find_loss(graph: ir.Graph, loss: str | None, path: Path) -> ir.Value:
    outputs = {v.name: v for v in graph.outputs}
    if loss is not None:
        if loss not in outputs:
            raise TranspileError(
                f"{path}: --loss '{loss}' is not an output of the graph (outputs: {', '.join(outputs) or 'none'})"
            )
        value = outputs[loss]
        if value.dtype not in FLOAT_TYPES or (value.shape is not None and value.shape.rank() != 0):
            raise TranspileError(
                f"{path}: loss '{loss}' must be a float scalar, but it is {value.dtype} with shape {_shape_of(value)}"
            )
        return value
    scalars = [
        v for v in graph.outputs if v.dtype in FLOAT_TYPES and v.shape is not None and v.shape.rank() == 0
    ]
    if len(scalars) == 1:
        return scalars[0]
    described = ", ".join(f"{v.name} {v.dtype} {_shape_of(v)}" for v in graph.outputs)
    if not scalars:
        raise TranspileError(f"{path}: no scalar float output to use as the loss (outputs: {described})")
    raise TranspileError(
        f"{path}: several scalar float outputs could be the loss ({', '.join(v.name for v in scalars)}); pick one with --loss"
    )


def load_problem(path: str | Path, *, loss: str | None = None, freeze: str | None = None,
                 train: str | None = None) -> Problem:
    """Read, check and normalise the user's model; raise TranspileError with a one-line reason."""
    path = Path(path)
    lazy = read_model(path)
    proto = lazy.proto
    init_names = {t.name for t in proto.graph.initializer}
    data_names = [vi.name for vi in proto.graph.input if vi.name not in init_names]
    _check_raw_sizes(proto, path)
    # The whole-model passes below need the weights' types only (transpiler/weights.py).
    weights, stand_ins = detach_weights(proto)
    try:
        onnx.checker.check_model(proto)
    except Exception as exc:
        raise TranspileError(f"{path}: invalid ONNX model ({_one_line(exc)})") from None
    proto = _upgrade(proto, path)
    _make_batch_symbolic(proto, data_names)
    _fold_integer_constants(proto)
    # Every value's dims at two batch sizes, before the symbolic inference below fills value_info:
    # the dims that follow the batch where the symbol is lost (transpiler/batch_constants.py).
    runs = {rows: _shapes_at(proto, data_names, rows) for rows in _PROBE_BATCHES}
    try:
        proto = _infer(proto, strict=True)
    except Exception as exc:
        raise TranspileError(f"{path}: shape inference failed ({_one_line(exc)})") from None
    attach_weights(proto, weights, stand_ins)

    model = ir.serde.deserialize_model(proto)  # the weights' references are absolute paths
    loss_value = _find_loss(model.graph, loss, path)
    # Parameters are found on the graph as it will be differentiated: BatchNormalization decomposed
    # (its running statistics become buffers). `model` keeps the original nodes; AutodiffPass
    # decomposes its own copies, with or without synchronized statistics.
    probe, found = decompose_batchnorm(ir.serde.deserialize_model(proto))
    _share_weights(probe.graph, model.graph)
    buffers = [b.name for b in found]
    graph = probe.graph
    loss_value = next(v for v in graph.outputs if v.name == loss_value.name)

    data_inputs = []
    for value in graph.inputs:
        if value.name in init_names:
            continue
        dtype = value.dtype.numpy().name if value.dtype is not None else "float32"
        data_inputs.append(DataInput(value.name, dtype, _shape_of(value)))

    if not data_inputs:
        raise TranspileError(f"{path}: the model has no data inputs (every graph input is an initializer); "
                             "data parallelism splits the inputs' batch axis, so the data must be graph inputs")

    reachable = differentiable_values(graph, loss_value)
    selection = select(graph, reachable, buffers, freeze=freeze, train=train, where=str(path))
    params, frozen = selection.params, selection.frozen
    if not params:
        why = f" after --freeze '{freeze}'" if freeze else ""
        counts = selection.counts()
        if counts:
            from transpiler.trainable import REASONS

            why += " (frozen: " + ", ".join(f"{n} {REASONS[r]}" for r, n in counts.most_common()) + ")"
        raise TranspileError(
            f"{path}: loss '{loss_value.name}' is not reachable from any float parameter{why}; nothing to train"
        )
    not_fp32 = [p for p in params if graph.initializers[p].dtype != ir.DataType.FLOAT]
    if not_fp32:
        first = graph.initializers[not_fp32[0]]
        raise TranspileError(f"{path}: trained parameters must be float32, '{first.name}' is {first.dtype} "
                             f"({len(not_fp32)} such); convert the model to float32, or --freeze them")
    try:
        check_supported(graph, loss_value, [graph.initializers[p] for p in params])
    except UnsupportedOpsError as exc:
        raise UnsupportedOpsError(exc.nodes, where=str(path)) from None
    # An exporter rewrite that cannot be warned about and trained anyway: a size taken from the
    # example batch (transpiler/batch_constants.py). Read, like the warnings below, on the graph as exported.
    baked = baked_batch_size(model.graph, BATCH_DIM, runs)
    if baked is not None:
        raise TranspileError(f"{path}: {baked}")

    problem = Problem(
        path=path,
        files=lazy.files,
        sha256=lazy.sha256,
        model=model,
        loss=loss_value.name,
        data_inputs=data_inputs,
        params=params,
        frozen=frozen,
        buffers=buffers,
        external_data=lazy.external_data,
        selection=selection,
        # Read on the graph as exported (metadata and Identity copies intact, BatchNorm not decomposed).
        warnings=(merged_parameters(model.graph, params) + transposed_copies(model.graph, params)
                  + folded_batchnorm(model.graph)),
    )
    for value in model.graph.initializers.values():  # read by the rules above; unmapped until read again
        if isinstance(value.const_value, ir.ExternalTensor):
            value.const_value.release()
    return problem


def _share_weights(graph: ir.Graph, like: ir.Graph) -> None:
    """``graph``'s weight references become ``like``'s tensor objects: one mapping of each weight's
    bytes, not one per copy of the graph (each would count its pages again)."""
    for name, value in graph.initializers.items():
        other = like.initializers.get(name)
        if other is not None and isinstance(value.const_value, ir.ExternalTensor) and isinstance(
                other.const_value, ir.ExternalTensor):
            value.const_value = other.const_value


# Ops whose output 0 has input 0's type and shape, which onnx's shape inference leaves untyped
# where the op is a function (GroupNormalization-21 as dynamo writes it from opset 21), and with it
# everything downstream.
_SAME_AS_INPUT = frozenset({"GroupNormalization", "InstanceNormalization", "RMSNormalization"})


def _type_like_input(proto: onnx.ModelProto) -> bool:
    """Give each untyped output 0 of a ``_SAME_AS_INPUT`` node its input's type; True if any."""
    graph = proto.graph
    typed = {v.name: v for v in [*graph.input, *graph.value_info, *graph.output] if v.type.HasField("tensor_type")}
    added = False
    for node in graph.node:
        if node.op_type not in _SAME_AS_INPUT or node.domain not in ("", "ai.onnx") or not node.input or not node.output:
            continue
        source, out = typed.get(node.input[0]), node.output[0]
        if source is None or not source.type.tensor_type.HasField("shape"):
            continue
        if out in typed and typed[out].type.tensor_type.HasField("shape"):
            continue
        if out in typed:  # typed without a shape: take the input's
            typed[out].type.CopyFrom(source.type)
        else:
            typed[out] = onnx.helper.make_value_info(out, source.type)
            graph.value_info.append(typed[out])
        added = True
    return added


def validate_freeze(freeze: str | None, option: str = "--freeze") -> None:
    if freeze is None:
        return
    try:
        re.compile(freeze)
    except re.error as exc:
        raise TranspileError(f"{option} '{freeze}' is not a valid regular expression ({exc})") from None
