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
