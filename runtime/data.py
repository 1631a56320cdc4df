"""Training data: load a .npz, validate it against plan["data_inputs"], and cut deterministic batches.

Batches (docs/contracts.md): the data is an endless stream of positions 0, 1, 2, ...; position p
holds row ``p mod n`` of epoch ``p // n`` (n = rows). Global batch b is positions [b*B, (b+1)*B),
cut into N equal contiguous shards; rank r takes shard r. With ``shuffle``, epoch e reads its rows
through its own permutation ``numpy.random.default_rng([seed, e]).permutation(n)``, so every epoch
is a fresh order, the stream is the same on every rank and every run, and a batch that straddles an
epoch boundary takes the tail of one permutation and the head of the next. Without shuffle this is
exactly "rows [b*B, (b+1)*B) modulo n".
"""

from __future__ import annotations

import math
import zipfile
from pathlib import Path

import numpy as np

from runtime.errors import RunError
from runtime.plan import DataInput


def shard_size(batch: int, world_size: int, micro_batches: int = 1) -> int:
    """Rows per rank. The one check of the batch's divisibility: the global batch must split into
    ``world_size`` equal shards, and each shard into ``micro_batches`` equal micro-batches
    (--grad-accumulation)."""
    if batch < 1:
        raise RunError(f"--batch must be >= 1, got {batch}")
    if batch % world_size != 0:
        raise RunError(f"global batch {batch} does not split into {world_size} equal shards "
                       f"(batch % world_size = {batch % world_size}); use a multiple of {world_size}")
    k = micro_batches
    if k > 1 and batch % (world_size * k):
        raise RunError(f"global batch {batch} does not split into {world_size} rank(s) x {k} micro-batches "
                       f"(--grad-accumulation {k}); use a multiple of {world_size * k}")
    return batch // world_size


class Dataset:
    """Validated data arrays; ``source`` names the file (or ``<data>``) in errors."""

    def __init__(self, arrays: dict[str, np.ndarray], inputs: tuple[DataInput, ...], source: str):
        self.source = source
        self.inputs = inputs
        self.arrays = {}
        rows: dict[str, int] = {}
        for spec in inputs:
            if spec.name not in arrays:
                have = ", ".join(sorted(arrays)) or "nothing"
                raise RunError(f"{source}: missing input '{spec.name}' (it holds: {have})")
            array = np.asarray(arrays[spec.name])
            _check_array(array, spec, source)
            self.arrays[spec.name] = array
            rows[spec.name] = array.shape[spec.batch_axis]
        if len(set(rows.values())) > 1:
            counts = ", ".join(f"'{name}' {n}" for name, n in rows.items())
            raise RunError(f"{source}: inputs have different row counts along their batch axes: {counts}")
        self.rows = next(iter(rows.values()))
        if self.rows == 0:
            raise RunError(f"{source}: input '{inputs[0].name}' has no rows")
        self._permutations: dict[tuple[int, int], np.ndarray] = {}

    @classmethod
    def load(cls, path: str | Path, inputs: tuple[DataInput, ...]) -> Dataset:
        path = Path(path)
        if not path.is_file():
            raise RunError(f"{path}: no such data file")
        try:
            loaded = np.load(path, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise RunError(f"{path}: a single array (.npy), not an .npz archive of named arrays; save the "
                               "data with np.savez(path, **{input_name: array})")
            with loaded as npz:
                arrays = {name: npz[name] for name in npz.files}
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise RunError(f"{path}: not a readable .npz file: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        return cls(arrays, inputs, str(path))

    def steps_for_epochs(self, epochs: float, batch: int) -> int:
        """Steps that read every row ``epochs`` times (the last batch may run into the next epoch)."""
        if not 0 < epochs < float("inf"):
            raise RunError(f"--epochs must be a positive finite number, got {epochs:g}")
        return max(1, math.ceil(epochs * self.rows / batch))

    def positions_to_rows(self, positions: np.ndarray, *, shuffle: bool, seed: int) -> np.ndarray:
        rows = positions % self.rows
        if not shuffle:
            return rows
        epochs = positions // self.rows
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            rows[mask] = self._permutation(seed, int(epoch))[rows[mask]]
        return rows

    def shard(self, step: int, *, batch: int, rank: int, world_size: int, shuffle: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
        """Rank ``rank``'s shard of global batch ``step`` (0-based), one array per data input."""
        per_rank = shard_size(batch, world_size)
        start = step * batch + rank * per_rank
        rows = self.positions_to_rows(np.arange(start, start + per_rank, dtype=np.int64), shuffle=shuffle, seed=seed)
        return self.take(rows)

    def take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """These rows of every data input, along each input's batch axis."""
        return {spec.name: np.take(self.arrays[spec.name], rows, axis=spec.batch_axis) for spec in self.inputs}

    def _permutation(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch)
        if key not in self._permutations:
            # A batch touches at most a few consecutive epochs, so keep only the most recent ones.
            if len(self._permutations) >= 4:
                del self._permutations[min(self._permutations)]
            self._permutations[key] = np.random.default_rng([seed, epoch]).permutation(self.rows)
        return self._permutations[key]


def _check_array(array: np.ndarray, spec: DataInput, source: str) -> None:
    try:
        expected = np.dtype(spec.dtype)
    except TypeError:
        raise RunError(f"{source}: input '{spec.name}' must have dtype {spec.dtype}, which NumPy cannot hold") from None
    if array.dtype != expected:
        raise RunError(f"{source}: input '{spec.name}' has dtype {array.dtype}, the model expects {expected}")
    shown = "[" + ", ".join(str(d) for d in spec.shape) + "]"
    if array.ndim != len(spec.shape):
        raise RunError(f"{source}: input '{spec.name}' has shape {list(array.shape)}, the model expects {shown}")
    for axis, (have, want) in enumerate(zip(array.shape, spec.shape)):
        if axis != spec.batch_axis and isinstance(want, int) and have != want:
            raise RunError(f"{source}: input '{spec.name}' has shape {list(array.shape)}, the model expects {shown} "
                           f"(axis {axis} is {have}, expected {want})")


# Ops that pass integer ids through unchanged (in value), only reshaped or re-typed.
_PASS_THROUGH = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast", "Transpose", "Expand", "Slice",
                 "Concat", "Split", "Tile"}


def id_bounds(model_path: Path, inputs: tuple[DataInput, ...]) -> dict[str, tuple[int, int | None, str]]:
    """For each integer data input that feeds an embedding (Gather's indices) or a class loss
    (SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss labels), possibly through reshapes and
    casts: (number of classes or rows, the loss's ignore_index or None, what it feeds). Read from
    the user's model in OUT (shapes only: its float weights are not loaded)."""
    import onnx

    integer = {spec.name for spec in inputs if np.dtype(spec.dtype).kind in "iu"}
    if not integer or not model_path.is_file():
        return {}
    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    # Shape inference needs the weights' shapes, not their values: float initializers become inputs.
    shapes: dict[str, list] = {t.name: list(t.dims) for t in graph.initializer}
    keep = [t for t in graph.initializer if t.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                                onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)]
    moved = [onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in graph.initializer
             if t not in keep]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    graph.input.extend(moved)
    try:
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001 - without inferred shapes, the initializers' shapes still serve
        pass
    for vi in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        shapes.setdefault(vi.name, [d.dim_value if d.HasField("dim_value") else None for d in dims])
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for position, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, position))
    bounds: dict[str, tuple[int, int | None, str]] = {}
    for name in integer:
        frontier, seen = [name], set()
        while frontier:
            value = frontier.pop()
            if value in seen:
                continue
            seen.add(value)
            for node, position in consumers.get(value, []):
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                found = None
                if node.op_type in _PASS_THROUGH and position == 0:
                    frontier.extend(node.output)
                elif node.op_type == "Gather" and position == 1:
                    table = shapes.get(node.input[0]) or []
                    axis = attrs.get("axis", 0)
                    if len(table) > abs(axis) and isinstance(table[axis], int) and table[axis] > 0:
                        found = (table[axis], None, f"Gather '{node.name or node.output[0]}' of '{node.input[0]}'")
                elif node.op_type in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss") and position == 1:
                    scores = shapes.get(node.input[0]) or []
                    if len(scores) > 1 and isinstance(scores[1], int) and scores[1] > 0:
                        found = (scores[1], attrs.get("ignore_index"), f"{node.op_type} '{node.name or node.output[0]}'")
                if found is not None and (name not in bounds or found[0] < bounds[name][0]):
                    bounds[name] = found
    return bounds


def check_ids(dataset: Dataset, bounds: dict[str, tuple[int, int | None, str]]) -> None:
    """Ids outside [0, n) (other than the loss's ignore_index) are an error naming the data file,
    the input and the first bad row: onnxruntime would wrap negative ones silently (PyTorch raises)."""
    for spec in dataset.inputs:
        if spec.name not in bounds:
            continue
        n, ignore, what = bounds[spec.name]
        array = dataset.arrays[spec.name]
        bad = (array < 0) | (array >= n)
        if ignore is not None:
            bad &= array != ignore
        if not bad.any():
            continue
        index = np.unravel_index(int(np.argmax(bad)), array.shape)
        row, value = int(index[spec.batch_axis]), int(array[index])
        allowed = f"[0, {n})" + (f" or ignore_index {ignore}" if ignore is not None else "")
        raise RunError(f"{dataset.source}: input '{spec.name}' row {row} holds {value} at {list(map(int, index))}, "
                       f"outside {allowed} ({what}); {int(bad.sum())} such value(s)")
