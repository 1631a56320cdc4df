"""Facts about one ONNX graph, read with onnx only: types, sizes, op counts, attributes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
from onnx import helper

from inspection.errors import InspectError


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def load_model(path: Path) -> onnx.ModelProto:
    """An ONNX model with inferred types (for byte counts); a clear one-line error otherwise."""
    if not path.is_file():
        raise InspectError(f"{path}: no such file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # DecodeError, OSError, ...: the message is protobuf's, often multi-line
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InspectError(f"{path}: not an ONNX model ({first})") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise InspectError(f"{path}: not an ONNX model (no graph in it)")
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        return model


def type_of(t: onnx.TypeProto, rows: int | None) -> tuple[str, list]:
    if t.WhichOneof("value") != "tensor_type":
        return (t.WhichOneof("value") or "?", [])
    tt = t.tensor_type
    dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type).name if tt.elem_type else "?"
    shape: list = []
    if tt.HasField("shape"):
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                shape.append(d.dim_value)
            elif rows is not None:
                shape.append(rows)
            else:
                shape.append(d.dim_param or "?")
    return dtype, shape


class Types:
    """dtype and shape of every value of a graph whose type is known (inputs, outputs, value_info,
    initializers); symbolic dims become ``rows`` when given (for cost estimates)."""

    def __init__(self, graph: onnx.GraphProto, rows: int | None = None):
        self.info: dict[str, tuple[str, list]] = {}
        for t in graph.initializer:
            self.info[t.name] = (helper.tensor_dtype_to_np_dtype(t.data_type).name, list(t.dims))
        for vi in [*graph.value_info, *graph.input, *graph.output]:
            if vi.type.WhichOneof("value") is not None:
                self.info[vi.name] = type_of(vi.type, rows)

    def shape(self, name: str) -> list | None:
        return self.info.get(name, (None, None))[1]

    def numel(self, name: str) -> int | None:
        shape = self.shape(name)
        if shape is None or any(not isinstance(d, int) for d in shape):
            return None
        n = 1
        for d in shape:
            n *= d
        return n

    def nbytes(self, name: str) -> int | None:
        n = self.numel(name)
        dtype = self.info.get(name, ("?",))[0]
        try:
            import numpy as np

            return None if n is None else n * np.dtype(dtype).itemsize
        except TypeError:
            return None


def model_summary(model: onnx.ModelProto, file: str) -> dict:
    graph = model.graph
    types = Types(graph)
    inits = {t.name for t in graph.initializer}
    n_elems = sum(types.numel(t.name) or 0 for t in graph.initializer)
    n_bytes = sum(types.nbytes(t.name) or 0 for t in graph.initializer)

    def io(vi):
        dtype, shape = type_of(vi.type, None)
        return {"name": vi.name, "dtype": dtype, "shape": shape}

    ops = Counter(op_name(n) for n in graph.node)
    return {
        "file": file,
        "opset": next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None),
        "inputs": [io(vi) for vi in graph.input if vi.name not in inits],
        "outputs": [io(vi) for vi in graph.output],
        "initializers": {"count": len(graph.initializer), "elements": n_elems, "bytes": n_bytes},
        "nodes": len(graph.node),
        "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def op_name(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            value = helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default
