"""Convert a .npz into the layouts ``transpile run --data`` memory-maps or streams (docs/data.md).

    python -m runtime.data_convert IN.npz OUT_DIR --format npy      # OUT_DIR/<name>.npy per array
    python -m runtime.data_convert IN.npz OUT_DIR --format parquet  # OUT_DIR/part-00000.parquet ...

Parquet: one column per array, one row per sample (along axis 0, or the axis ``--batch-axis
NAME=K`` names), a sample of shape (d1, d2, ...) stored as nested fixed-size lists
``pa.list_(pa.list_(type, d2), d1)``; ``--row-group-rows`` rows per row group, ``--file-rows``
rows per file. Arrays are read from the .npz one at a time (an .npz member is read whole).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def write_npy(arrays, out_dir: str | Path) -> list[Path]:
    """``out_dir/<name>.npy`` for each array of ``arrays`` (a dict, or an open .npz)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, array in arrays.items():
        np.save(out_dir / f"{name}.npy", np.asarray(array))
        written.append(out_dir / f"{name}.npy")
    return written


def parquet_column(array: np.ndarray, batch_axis: int = 0):
    """A pyarrow array holding one row per sample of ``array`` (rows along ``batch_axis``),
    multi-dimensional samples as nested fixed-size lists."""
    import pyarrow as pa

    array = np.ascontiguousarray(np.moveaxis(np.asarray(array), batch_axis, 0))
    column = pa.array(array.reshape(-1))
    for size in reversed(array.shape[1:]):
        column = pa.FixedSizeListArray.from_arrays(column, size)
    return column


def write_parquet(arrays: dict[str, np.ndarray], out_dir: str | Path, *, row_group_rows: int = 1024,
                  file_rows: int | None = None, batch_axes: dict[str, int] | None = None) -> list[Path]:
    """``out_dir/part-NNNNN.parquet``: the arrays as columns (see the module's docstring)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    batch_axes = batch_axes or {}
    columns = {name: parquet_column(array, batch_axes.get(name, 0)) for name, array in arrays.items()}
    table = pa.table(columns)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    per_file = file_rows or max(1, table.num_rows)
    written = []
    for index, start in enumerate(range(0, max(1, table.num_rows), per_file)):
        path = out_dir / f"part-{index:05d}.parquet"
        pq.write_table(table.slice(start, per_file), path, row_group_size=row_group_rows)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.data_convert", description=__doc__.split("\n")[0])
    parser.add_argument("input", metavar="IN.npz")
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument("--format", choices=("npy", "parquet"), required=True)
    parser.add_argument("--row-group-rows", type=int, default=1024, metavar="N", help="Parquet rows per row group")
    parser.add_argument("--file-rows", type=int, default=None, metavar="N", help="Parquet rows per file (default: one file)")
    parser.add_argument("--batch-axis", action="append", default=[], metavar="NAME=K",
                        help="an array whose rows lie along axis K, not 0 (Parquet)")
    args = parser.parse_args(argv)
    try:
        axes = {name: int(k) for name, k in (item.split("=", 1) for item in args.batch_axis)}
    except ValueError:
        parser.error("--batch-axis takes NAME=K, K an integer")
    try:
        with np.load(args.input, allow_pickle=False) as npz:
            if args.format == "npy":  # one member in memory at a time
                written = write_npy(npz, args.out_dir)
            else:
                written = write_parquet({name: npz[name] for name in npz.files}, args.out_dir,
                                        row_group_rows=args.row_group_rows, file_rows=args.file_rows, batch_axes=axes)
    except (OSError, ValueError) as exc:
        print(f"data_convert: error: {args.input}: not a readable .npz file: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} file(s) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
