"""Read a model without reading its large weights.

Parsing an ONNX file with protobuf holds its bytes and the parsed copy (2x the model), and every
proto copy after that (checker, shape inference, onnx-ir round trips) one more; on GPT-2-small
(650 MB) transpiling peaked at 6.5 GB. Here the large float initializers never enter memory: each
becomes an external-data reference (ONNX's own ``data_location = EXTERNAL`` with location, offset,
length) to where its bytes already are, and onnx-ir reads such a tensor lazily (memory-mapped) only
where a pass needs its values.

- Weights inside the model file: the file is scanned at the protobuf wire level (tags and lengths,
  no payload read) to find each initializer's ``raw_data``; the model is parsed with those fields
  cut out and replaced by references into the model file itself.
- Weights in external data files: the references are kept as the file has them (after checking
  that every referenced byte exists); small or integer ones are read in, since shape inference and
  constant folding read their values.

OUT then holds the weights once: model.onnx (the user's file, copied byte for byte) and the data
files it names, which the rank graphs reference in turn (transpiler/plan.py).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto
from onnx.external_data_helper import load_external_data_for_tensor

from transpiler.errors import TranspileError
from transpiler.weights import is_large_float, raw_bytes

# Field numbers of onnx.proto: ModelProto.graph, GraphProto.initializer, TensorProto fields.
_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_RAW_DATA = 1, 2, 9
_LENGTH_DELIMITED = 2


@dataclass
class LazyModel:
    proto: onnx.ModelProto  # large float initializers as external references, resolved against ``base_dir``
    sha256: str  # of the model file's bytes
    base_dir: Path
    # What OUT must hold for the references to resolve there: location as the references name it
    # -> (the file to copy, its name in OUT). The model file itself becomes OUT's model.onnx.
    files: dict[str, tuple[Path, str]] = field(default_factory=dict)
    external_data: bool = False  # the user's file keeps tensors in separate files


def read_lazy(path: Path, out_name: str) -> LazyModel:
    """``path`` parsed with its large weights left on disk; ``out_name``: the model's name in OUT.

    Every reference names its file by absolute path, so it resolves wherever a pass copies the
    model (onnx-ir round trips lose the base directory); OUT's graphs name OUT's copies instead."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
        size = os.fstat(f.fileno()).st_size
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    model_file = str(path.resolve())
    try:
        skeleton = _skeleton(buf, model_file)
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()
    proto = onnx.ModelProto()
    proto.ParseFromString(skeleton)  # raises DecodeError for a file that is not a model
    lazy = LazyModel(proto, digest.hexdigest(), path.parent, {model_file: (path, out_name)})
    user_external = [t for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL
                     and _location(t) != model_file]
    lazy.external_data = bool(user_external)
    for tensor in user_external:
        _check_reference(tensor, path)
        location = _location(tensor)
        if location == out_name:
            raise TranspileError(f"{path}: its external data file '{location}' has the name OUT gives the model; "
                                 "rename the data file")
        absolute = str((path.parent / location).resolve())
        # OUT's model.onnx names it: copied under the same name, whatever the graphs reference.
        lazy.files.setdefault(absolute, (path.parent / location, location))
        if is_large_float(tensor):
            next(e for e in tensor.external_data if e.key == "location").value = absolute
        else:  # read in: shape inference and folding read such values
            load_external_data_for_tensor(tensor, str(path.parent))
            tensor.data_location = TensorProto.DEFAULT
            del tensor.external_data[:]
    return lazy


def inline_weights(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with its referenced weights read in (for running it from memory), in place."""
    for tensor in proto.graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            info = {e.key: e.value for e in tensor.external_data}
            with open(info["location"], "rb") as f:
                f.seek(int(info.get("offset", 0)))
                tensor.raw_data = f.read(int(info["length"]))
            tensor.data_location = TensorProto.DEFAULT
            del tensor.external_data[:]
    return proto


def _location(tensor: TensorProto) -> str:
    return next((e.value for e in tensor.external_data if e.key == "location"), "")


def _check_reference(tensor: TensorProto, path: Path) -> None:
    """The referenced bytes exist: a missing or short data file fails here, in one line, not in a
    later pass (or at run time)."""
    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    where = f"{path}: cannot read its external data (initializer '{tensor.name}'"
    target = (path.parent / location).resolve()
    if not location or Path(location).is_absolute() or path.parent.resolve() not in target.parents:
        raise TranspileError(f"{where}: location '{location}' is not a file beside the model)")
    if not target.is_file():
        raise TranspileError(f"{where}: no file {location})")
    want = raw_bytes(tensor) or 0
    offset, length = int(info.get("offset", 0)), int(info.get("length", want))
    if length != want or offset + length > target.stat().st_size:
        raise TranspileError(f"{where}: needs bytes [{offset}, {offset + want}) of {location}, which holds "
                             f"{target.stat().st_size}; the file is truncated or damaged)")


def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _fields(buf, start: int, end: int):
    """(field number, wire type, start of the tag, start of the value, end) of each field."""
    pos = start
    while pos < end:
        tag_start = pos
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
            value_start = pos
        elif wire == 1:
            value_start, pos = pos, pos + 8
        elif wire == _LENGTH_DELIMITED:
            length, value_start = _varint(buf, pos)
            pos = value_start + length
        elif wire == 5:
            value_start, pos = pos, pos + 4
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {tag_start}")
        if pos > end:
            raise ValueError(f"a field at byte {tag_start} runs past the end")
        yield number, wire, tag_start, value_start, pos


def _delimited(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | _LENGTH_DELIMITED) + _encode_varint(len(payload)) + payload


def _skeleton(buf, location: str) -> bytes:
    """The model's bytes with each large float initializer's raw_data replaced by a reference."""
    out = bytearray()
    for number, wire, tag_start, value_start, end in _fields(buf, 0, len(buf)):
        if number == _MODEL_GRAPH and wire == _LENGTH_DELIMITED:
            graph = bytearray()
            for g_number, g_wire, g_tag, g_value, g_end in _fields(buf, value_start, end):
                if g_number == _GRAPH_INITIALIZER and g_wire == _LENGTH_DELIMITED:
                    graph += _delimited(_GRAPH_INITIALIZER, _initializer(buf, g_value, g_end, location))
                else:
                    graph += buf[g_tag:g_end]
            out += _delimited(_MODEL_GRAPH, bytes(graph))
        else:
            out += buf[tag_start:end]
    return bytes(out)


def _initializer(buf, start: int, end: int, location: str) -> bytes:
    raw = next(((tag, value, stop) for number, wire, tag, value, stop in _fields(buf, start, end)
                if number == _TENSOR_RAW_DATA and wire == _LENGTH_DELIMITED), None)
    if raw is None or raw[2] - raw[1] < 4096:  # no raw_data, or small: parsed as it is
        return bytes(buf[start:end])
    tag, value, stop = raw
    tensor = TensorProto()
    tensor.ParseFromString(bytes(buf[start:tag]) + bytes(buf[stop:end]))  # everything but the bytes
    if not is_large_float(tensor) or raw_bytes(tensor) != stop - value:
        return bytes(buf[start:end])  # kept whole: a short raw_data is reported by load's size check
    tensor.data_location = TensorProto.EXTERNAL
    for key, val in (("location", location), ("offset", value), ("length", stop - value)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(val)
    return tensor.SerializeToString()

