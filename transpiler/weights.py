"""Large weights kept out of whole-model protobuf passes.

onnx.checker, shape inference and the version converter serialize the whole model, weights
included, and need only the weights' types: on GPT-2-small (650 MB) that serialization dominated
transpile time. ``detach_weights`` moves the large float initializers out of a model (each becomes a
graph input of the same type for the duration), ``attach_weights`` puts them back.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

# Float tensors with at least this many elements are detached; small ones (and every integer
# tensor: shapes, axes, indices) stay, since shape inference may read their values.
MIN_ELEMENTS = 1024
_FLOATS = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}


def _numel(tensor: TensorProto) -> int:
    n = 1
    for d in tensor.dims:
        n *= d
    return n


# Types whose values are packed two to a byte.
_PACKED = {getattr(TensorProto, n, -1) for n in ("INT4", "UINT4", "FLOAT4E2M1")}


def raw_bytes(tensor: TensorProto) -> int | None:
    """The bytes of raw data ``tensor``'s dims and type need; None for strings and unknown types."""
    if tensor.data_type == TensorProto.STRING:
        return None
    try:
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        return None
    count = _numel(tensor)
    return (count + 1) // 2 if tensor.data_type in _PACKED else count * itemsize or None


def is_large_float(tensor: TensorProto) -> bool:
    """Whether a tensor is one the whole-model passes need only the type of (and the loader leaves
    on disk, transpiler/lazy_weights.py)."""
    return tensor.data_type in _FLOATS and _numel(tensor) >= MIN_ELEMENTS


def detach_weights(proto: onnx.ModelProto) -> tuple[list[TensorProto], list[str]]:
    """Remove the large float initializers from ``proto`` (in place); returns them and the names of
    the graph inputs added in their place."""
    graph = proto.graph
    big = [i for i, t in enumerate(graph.initializer) if is_large_float(t)]
    if not big:
        return [], []
    detached = []
    for i in big:
        tensor = TensorProto()
        tensor.CopyFrom(graph.initializer[i])
        detached.append(tensor)
    for i in reversed(big):
        del graph.initializer[i]
    inputs = {vi.name for vi in graph.input}
    added = [t.name for t in detached if t.name not in inputs]
    by_name = {t.name: t for t in detached}
    graph.input.extend(helper.make_tensor_value_info(n, by_name[n].data_type, list(by_name[n].dims)) for n in added)
    return detached, added


def attach_weights(proto: onnx.ModelProto, detached: list[TensorProto], added: list[str]) -> None:
    """Undo ``detach_weights`` on ``proto`` (or on a model derived from it, e.g. by shape inference)."""
    if not detached:
        return
    graph = proto.graph
    names = set(added)
    for i in reversed([i for i, vi in enumerate(graph.input) if vi.name in names]):
        del graph.input[i]
    graph.initializer.extend(detached)
