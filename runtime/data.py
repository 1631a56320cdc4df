"""Training data: open a .npz, .npy directory or Parquet (runtime/data_sources.py), validate it against plan["data_inputs"], and cut deterministic batches.

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
from pathlib import Path

import numpy as np

from runtime.data_sources import ArraySource, Source, open_source
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
    """Validated data inputs read through a Source (runtime/data_sources.py); ``source`` names the
    file or directory (or ``<data>``) in errors. ``arrays`` may be a dict of arrays held in memory."""

    def __init__(self, arrays: dict[str, np.ndarray] | Source, inputs: tuple[DataInput, ...], source: str):
        self.source = source
        self.inputs = inputs
        self.reader = ArraySource(arrays, source) if isinstance(arrays, dict) else arrays
        self.layouts: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        have = self.reader.names()
        rows: dict[str, int] = {}
        for spec in inputs:
            if spec.name not in have:
                raise RunError(f"{source}: missing input '{spec.name}' (it holds: {', '.join(sorted(have)) or 'nothing'})")
            shape, dtype = self.reader.describe(spec.name, spec.batch_axis)
            _check_array(tuple(shape), np.dtype(dtype), spec, source)
            self.layouts[spec.name] = (tuple(shape), np.dtype(dtype))
            rows[spec.name] = shape[spec.batch_axis]
        if len(set(rows.values())) > 1:
            counts = ", ".join(f"'{name}' {n}" for name, n in rows.items())
            raise RunError(f"{source}: inputs have different row counts along their batch axes: {counts}")
        self.rows = next(iter(rows.values()))
        if self.rows == 0:
            raise RunError(f"{source}: input '{inputs[0].name}' has no rows")
        self._permutations: dict[tuple[int, int], np.ndarray] = {}

    @classmethod
    def load(cls, path: str | Path, inputs: tuple[DataInput, ...]) -> Dataset:
        """A .npz, a directory of NAME.npy files or Parquet (runtime/data_sources.py picks)."""
        return cls(open_source(path), inputs, str(path))

    def steps_for_epochs(self, epochs: float, batch: int, *, start: int = 0, samples: int = 0) -> int:
        """Steps that read every row ``epochs`` times (the last batch may run into the next epoch).
        Resumed at step ``start`` having read ``samples`` positions: those steps plus the batches
        still to read (the same count as a fresh run's when the batch did not change)."""
        if not 0 < epochs < float("inf"):
            raise RunError(f"--epochs must be a positive finite number, got {epochs:g}")
        if start == 0 and samples == 0:
            return max(1, math.ceil(epochs * self.rows / batch))
        return start + max(0, math.ceil((epochs * self.rows - samples) / batch))

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
        return self.shard_at(step * batch, batch=batch, rank=rank, world_size=world_size, shuffle=shuffle, seed=seed)

    def shard_at(self, position: int, *, batch: int, rank: int, world_size: int, shuffle: bool = False,
                 seed: int = 0) -> dict[str, np.ndarray]:
        """Rank ``rank``'s shard of the global batch of positions [position, position + batch): a
        run resumed with another global batch goes on from the position its checkpoint reached
        (runtime/checkpoint.py), not from ``step * batch``."""
        per_rank = shard_size(batch, world_size)
        start = position + rank * per_rank
        rows = self.positions_to_rows(np.arange(start, start + per_rank, dtype=np.int64), shuffle=shuffle, seed=seed)
        return self.take(rows)

    def take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """These rows of every data input, along each input's batch axis. The Source is asked for
        the distinct rows in ascending order (one pass over a file); they come back in ``rows``'
        order."""
        unique, inverse = np.unique(np.asarray(rows, dtype=np.int64), return_inverse=True)
        return {spec.name: np.take(self.reader.read(spec.name, unique, spec.batch_axis), inverse, axis=spec.batch_axis)
                for spec in self.inputs}

    def _permutation(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch)
        if key not in self._permutations:
            # A batch touches at most a few consecutive epochs, so keep only the most recent ones.
            if len(self._permutations) >= 4:
                del self._permutations[min(self._permutations)]
            self._permutations[key] = np.random.default_rng([seed, epoch]).permutation(self.rows)
        return self._permutations[key]


def _check_array(shape: tuple[int, ...], dtype: np.dtype, spec: DataInput, source: str) -> None:
    try:
        expected = np.dtype(spec.dtype)
    except TypeError:
        raise RunError(f"{source}: input '{spec.name}' must have dtype {spec.dtype}, which NumPy cannot hold") from None
    if dtype != expected:
        raise RunError(f"{source}: input '{spec.name}' has dtype {dtype}, the model expects {expected}")
    shown = "[" + ", ".join(str(d) for d in spec.shape) + "]"
    if len(shape) != len(spec.shape):
        raise RunError(f"{source}: input '{spec.name}' has shape {list(shape)}, the model expects {shown}")
    for axis, (have, want) in enumerate(zip(shape, spec.shape)):
        if axis != spec.batch_axis and isinstance(want, int) and have != want:
            raise RunError(f"{source}: input '{spec.name}' has shape {list(shape)}, the model expects {shown} "
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
    the input and the first bad row: onnxruntime would wrap negative ones silently (PyTorch raises).
    Read in chunks of about 64 MiB, so a memory-mapped or Parquet set is never whole in memory."""
    for spec in dataset.inputs:
        if spec.name not in bounds:
            continue
        n, ignore, what = bounds[spec.name]
        shape, dtype = dataset.layouts[spec.name]
        row_bytes = max(1, dtype.itemsize * math.prod(shape) // max(1, dataset.rows))
        chunk = max(1, (64 << 20) // row_bytes)
        count, first = 0, None
        for start in range(0, dataset.rows, chunk):
            rows = np.arange(start, min(start + chunk, dataset.rows), dtype=np.int64)
            array = dataset.reader.read(spec.name, rows, spec.batch_axis)
            bad = (array < 0) | (array >= n)
            if ignore is not None:
                bad &= array != ignore
            if first is None and bad.any():
                index = np.unravel_index(int(np.argmax(bad)), array.shape)
                at = list(map(int, index))
                at[spec.batch_axis] += start
                first = (at, int(array[index]))
            count += int(bad.sum())
        if first is None:
            continue
        at, value = first
        allowed = f"[0, {n})" + (f" or ignore_index {ignore}" if ignore is not None else "")
        raise RunError(f"{dataset.source}: input '{spec.name}' row {at[spec.batch_axis]} holds {value} at {at}, "
                       f"outside {allowed} ({what}); {count} such value(s)")
