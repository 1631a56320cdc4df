"""Where training rows come from: one reader interface (``Source``), one implementation per format.

``open_source(path)`` picks the format (the ``FORMATS`` table) from what ``path`` is:

- a ``.npz`` file: every array in memory (as before this module existed);
- a directory of ``<input name>.npy`` files: each memory-mapped (``mmap_mode="r"``), so a rank's
  reads touch only the pages of its rows;
- a ``.parquet`` file or a directory of them: one column per input, scalars or (nested)
  fixed-size lists, read a row group at a time, the current row group of each column cached.

runtime/data.py does the sharding and shuffling and asks a Source for rows, sorted and unique.
Errors are one line naming the file and, where known, the column and row (docs/data.md).
"""

from __future__ import annotations

import mmap
import zipfile
from pathlib import Path
from typing import Protocol

import numpy as np

from runtime.errors import RunError

# A memory-mapped read is cut into pieces that touch at most about PIECE_BYTES of the file; after
# each piece its pages are dropped from the rank's mapping (madvise MADV_DONTNEED: they stay in the
# page cache, shared by the host's ranks). A page fault can map a whole page-cache folio around the
# row (up to FOLIO_BYTES on recent kernels), so scattered rows count that much each.
PIECE_BYTES = 64 << 20
FOLIO_BYTES = 2 << 20


class Source(Protocol):
    """Named arrays that share a row count along each one's batch axis."""

    path: str  # the file or directory, as errors show it

    def names(self) -> list[str]: ...

    def describe(self, name: str, batch_axis: int) -> tuple[tuple[int, ...], np.dtype]:
        """The array's (shape, dtype) as the model sees it: rows along ``batch_axis``."""

    def read(self, name: str, rows: np.ndarray, batch_axis: int) -> np.ndarray:
        """These rows (sorted, unique int64) of ``name``, stacked along ``batch_axis``."""


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class ArraySource:
    """Arrays already in memory (a loaded .npz, or arrays handed to runtime.simulate)."""

    def __init__(self, arrays: dict[str, np.ndarray], path: str):
        self.path = path
        self.arrays = {name: np.asarray(array) for name, array in arrays.items()}

    @classmethod
    def open(cls, path: Path) -> ArraySource:
        try:
            loaded = np.load(path, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise RunError(f"{path}: a single array (.npy), not an .npz archive of named arrays; save the "
                               "data with np.savez(path, **{input_name: array}), or put NAME.npy files in a directory")
            with loaded as npz:
                arrays = {name: npz[name] for name in npz.files}
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise RunError(f"{path}: not a readable .npz file: {_reason(exc)}") from None
        return cls(arrays, str(path))

    def names(self) -> list[str]:
        return sorted(self.arrays)

    def describe(self, name: str, batch_axis: int) -> tuple[tuple[int, ...], np.dtype]:
        return self.arrays[name].shape, self.arrays[name].dtype

    def read(self, name: str, rows: np.ndarray, batch_axis: int) -> np.ndarray:
        return np.take(self.arrays[name], rows, axis=batch_axis)


class NpyDirSource:
    """A directory of ``<input name>.npy`` files, each memory-mapped read-only."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.files = {file.stem: file for file in sorted(path.glob("*.npy")) if file.is_file()}
        self._maps: dict[str, np.ndarray] = {}

    @classmethod
    def open(cls, path: Path) -> NpyDirSource:
        return cls(path)

    def _map(self, name: str) -> np.ndarray:
        if name not in self._maps:
            file = self.files[name]
            try:
                array = np.load(file, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise RunError(f"{file}: not a readable .npy file: {_reason(exc)}") from None
            if not isinstance(array, np.ndarray):
                raise RunError(f"{file}: not a readable .npy file: it holds an archive, not one array")
            self._maps[name] = array
        return self._maps[name]

    def names(self) -> list[str]:
        return list(self.files)

    def describe(self, name: str, batch_axis: int) -> tuple[tuple[int, ...], np.dtype]:
        array = self._map(name)
        return array.shape, array.dtype

    def read(self, name: str, rows: np.ndarray, batch_axis: int) -> np.ndarray:
        array = self._map(name)
        row_bytes = max(1, array.nbytes // max(1, array.shape[batch_axis]))
        mapping = getattr(array, "_mmap", None)
        parts = []
        try:
            for piece in _pieces(rows, row_bytes):
                parts.append(np.asarray(np.take(array, piece, axis=batch_axis)))
                if mapping is not None and hasattr(mapping, "madvise"):
                    mapping.madvise(mmap.MADV_DONTNEED)
        except OSError as exc:  # an I/O error of the file under the mapping
            raise RunError(f"{self.files[name]}: cannot read rows {int(rows[0])}..{int(rows[-1])}: {_reason(exc)}") from None
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts, axis=batch_axis) if parts else np.take(array, rows, axis=batch_axis)


def _pieces(rows: np.ndarray, row_bytes: int) -> list[np.ndarray]:
    """``rows`` (sorted) cut into pieces that each touch about PIECE_BYTES of the file at most: by
    span where the rows lie closer than a folio, else FOLIO_BYTES a row."""
    if not len(rows):
        return []
    span = (int(rows[-1]) - int(rows[0]) + 1) * row_bytes
    if span + 2 * FOLIO_BYTES <= PIECE_BYTES:
        return [rows]
    if len(rows) * max(row_bytes, FOLIO_BYTES) > span:  # dense: cut every PIECE_BYTES of the file
        per_piece = max(1, (PIECE_BYTES - 2 * FOLIO_BYTES) // row_bytes)
        bounds = np.searchsorted(rows, int(rows[0]) + per_piece * np.arange(1, span // (per_piece * row_bytes) + 1))
    else:
        bounds = np.arange(1, len(rows)) * max(1, PIECE_BYTES // max(row_bytes, FOLIO_BYTES))
    return [piece for piece in np.split(rows, bounds[bounds < len(rows)]) if len(piece)]


def _pyarrow(path):
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise RunError(f"{path}: reading Parquet needs pyarrow, which is not installed; "
                       "pip install pyarrow (or pip install 'graph-transpiler[cpu]')") from None
    return pyarrow


class ParquetSource:
    """A .parquet file or a directory of them (read in name order, one after the other): a column
    per input holding one row per sample, as a scalar or as nested fixed-size lists (the sample's
    shape outermost first). Reads decode only the row groups the rows fall in; each column keeps
    its most recent row group."""

    def __init__(self, path: Path, files: list[Path]):
        pa = _pyarrow(path)
        self.path = str(path)
        self._pa = pa
        self.files: list = []
        self.layouts: dict[str, tuple[tuple[int, ...], np.dtype, object]] = {}
        groups: list[tuple[int, int, int]] = []  # (file index, row group, rows)
        schema = None
        for index, file in enumerate(files):
            try:
                handle = pa.parquet.ParquetFile(file)
            except (OSError, pa.ArrowException) as exc:
                raise RunError(f"{file}: not a readable Parquet file: {_reason(exc)}") from None
            if schema is None:
                schema = handle.schema_arrow
                for field in schema:
                    self.layouts[field.name] = _layout(pa, field, file)
            elif not handle.schema_arrow.equals(schema):
                raise RunError(f"{file}: its columns differ from those of {files[0]} ({_columns(handle.schema_arrow)} "
                               f"vs {_columns(schema)})")
            self.files.append((file, handle))
            groups += [(index, g, handle.metadata.row_group(g).num_rows) for g in range(handle.num_row_groups)]
        self.groups = [(f, g) for f, g, n in groups if n > 0]
        counts = np.array([n for _, _, n in groups if n > 0], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.rows = int(self.starts[-1])
        self._cache: dict[str, tuple[int, np.ndarray]] = {}
        self.groups_read = 0  # row groups decoded, for tests and benchmarks

    @classmethod
    def open(cls, path: Path) -> ParquetSource:
        files = sorted(f for f in path.glob("*.parquet") if f.is_file()) if path.is_dir() else [path]
        return cls(path, files)

    def names(self) -> list[str]:
        return list(self.layouts)

    def describe(self, name: str, batch_axis: int) -> tuple[tuple[int, ...], np.dtype]:
        sample, dtype, _ = self.layouts[name]
        return (*sample[:batch_axis], self.rows, *sample[batch_axis:]), dtype

    def read(self, name: str, rows: np.ndarray, batch_axis: int) -> np.ndarray:
        sample, dtype, _ = self.layouts[name]
        which = np.searchsorted(self.starts, rows, side="right") - 1
        parts = []
        for group in np.unique(which):
            values = self._group(name, int(group))
            parts.append(values[rows[which == group] - self.starts[group]])
        out = np.concatenate(parts) if parts else np.empty((0, *sample), dtype)
        return np.moveaxis(out, 0, batch_axis) if batch_axis else out

    def _group(self, name: str, group: int) -> np.ndarray:
        cached = self._cache.get(name)
        if cached is not None and cached[0] == group:
            return cached[1]
        index, g = self.groups[group]
        file, handle = self.files[index]
        start = int(self.starts[group])
        try:
            column = handle.read_row_group(g, columns=[name]).column(0)
        except (OSError, self._pa.ArrowException) as exc:
            raise RunError(f"{file}: column '{name}', rows {start}..{int(self.starts[group + 1]) - 1} (row group {g}): "
                           f"not readable: {_reason(exc)}") from None
        values = _to_numpy(self._pa, column, self.layouts[name], f"{file}: column '{name}'", start)
        self._cache[name] = (group, values)
        self.groups_read += 1
        return values


def _columns(schema) -> str:
    return ", ".join(f"{field.name}: {field.type}" for field in schema)


def _layout(pa, field, file) -> tuple[tuple[int, ...], np.dtype, object]:
    """(sample shape, dtype, tensor extension shape or None) of a column, or a one-line error."""
    kind, shape, tensor = field.type, [], None
    if isinstance(kind, pa.BaseExtensionType) and kind.extension_name == "arrow.fixed_shape_tensor":
        if list(kind.permutation or range(len(kind.shape))) != list(range(len(kind.shape))):
            raise RunError(f"{file}: column '{field.name}' ({field.type}): a permuted tensor layout; store row-major")
        tensor, shape, kind = tuple(kind.shape), list(kind.shape), kind.value_type
    while pa.types.is_fixed_size_list(kind):
        shape.append(kind.list_size)
        kind = kind.value_type
    where = f"{file}: column '{field.name}' ({field.type})"
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or getattr(pa.types, "is_list_view", bool)(kind):
        raise RunError(f"{where} holds variable-length lists; store fixed-size lists (pa.list_(type, n), "
                       "see docs/data.md) or convert with python -m runtime.data_convert")
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
        raise RunError(f"{where}: not a numeric column (numbers, or fixed-size lists of numbers)")
    return tuple(shape), np.dtype(kind.to_pandas_dtype()), tensor


def _to_numpy(pa, column, layout, where: str, start: int) -> np.ndarray:
    sample, dtype, tensor = layout
    array = column.combine_chunks()
    if tensor is not None:
        array = array.storage
    rows = len(array)
    level = array
    while True:
        if level.null_count:
            first = int(np.flatnonzero(level.is_null().to_numpy(zero_copy_only=False))[0])
            size = max(1, len(level) // rows)
            raise RunError(f"{where}, row {start + first // size}: null value; every row needs a value")
        if not pa.types.is_fixed_size_list(level.type):
            break
        level = level.flatten()
    values = level.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return values.reshape(rows, *sample)


def _detect(path: Path) -> str:
    if path.is_dir():
        kinds = {kind for kind, suffix in (("npy", ".npy"), ("parquet", ".parquet")) if any(path.glob("*" + suffix))}
        if len(kinds) != 1:
            held = "both .npy and .parquet files" if kinds else "no .npy or .parquet files"
            raise RunError(f"{path}: a data directory holds either NAME.npy files or .parquet files; it holds {held}")
        return kinds.pop()
    return "parquet" if path.suffix.lower() in (".parquet", ".pq") else "npz"


FORMATS = {"npz": ArraySource.open, "npy": NpyDirSource.open, "parquet": ParquetSource.open}


def open_source(path: str | Path) -> Source:
    """The Source for ``path`` (a .npz, a directory of .npy files, a .parquet file or directory)."""
    path = Path(path)
    if not path.exists():
        raise RunError(f"{path}: no such data file or directory")
    return FORMATS[_detect(path)](path)
