"""--data formats (runtime/data_sources.py): a directory of .npy files and Parquet give the same
batches as the .npz, each rank reads only its rows, and every bad file is a one-line error."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from runtime import data_sources
from runtime.data import Dataset, check_ids
from runtime.data_convert import main as convert
from runtime.data_convert import parquet_column, write_npy, write_parquet
from runtime.errors import RunError
from runtime.metrics import read_metrics
from runtime.plan import DataInput

INPUTS = (DataInput("x", "float32", ("batch", 2, 3), 0), DataInput("y", "int64", ("batch",), 0))


def _data(rows=37):
    return {"x": np.arange(rows * 6, dtype=np.float32).reshape(rows, 2, 3) * 0.5,
            "y": (np.arange(rows, dtype=np.int64) * 7) % 5}


def _write(kind, data, where, **options):
    if kind == "npz":
        np.savez(where.with_suffix(".npz"), **data)
        return where.with_suffix(".npz")
    if kind == "npy":
        write_npy(data, where)
    else:
        write_parquet(data, where, row_group_rows=options.get("row_group_rows", 5), file_rows=options.get("file_rows", 16))
    return where


@pytest.mark.parametrize("kind", ["npy", "parquet"])
def test_formats_give_the_npz_batches(tmp_path, kind):
    data = _data()
    npz = Dataset.load(_write("npz", data, tmp_path / "d"), INPUTS)
    other = Dataset.load(_write(kind, data, tmp_path / kind), INPUTS)
    assert other.rows == npz.rows == 37 and other.layouts == npz.layouts
    for shuffle in (False, True):
        for step in range(12):  # several epochs, batches straddling their boundaries
            for rank in range(2):
                a = npz.shard(step, batch=8, rank=rank, world_size=2, shuffle=shuffle, seed=5)
                b = other.shard(step, batch=8, rank=rank, world_size=2, shuffle=shuffle, seed=5)
                for name in a:
                    assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape
                    assert np.array_equal(a[name], b[name]), (kind, shuffle, step, rank, name)


class Counting:
    """A Source that records the rows each read asks for."""

    def __init__(self, inner):
        self.inner, self.path, self.requests = inner, inner.path, []

    def names(self):
        return self.inner.names()

    def describe(self, name, batch_axis):
        return self.inner.describe(name, batch_axis)

    def read(self, name, rows, batch_axis):
        self.requests.append((name, rows.copy()))
        return self.inner.read(name, rows, batch_axis)


@pytest.mark.parametrize("kind", ["npy", "parquet"])
def test_a_rank_reads_only_its_rows(tmp_path, kind):
    source = Counting(data_sources.open_source(_write(kind, _data(64), tmp_path / kind, row_group_rows=4, file_rows=32)))
    dataset = Dataset(source, INPUTS, "d")
    for step in range(3):
        source.requests.clear()
        dataset.shard(step, batch=16, rank=2, world_size=4, shuffle=True, seed=1)
        mine = dataset.positions_to_rows(np.arange(step * 16 + 8, step * 16 + 12), shuffle=True, seed=1)
        assert [name for name, _ in source.requests] == ["x", "y"]
        for _, rows in source.requests:
            assert rows.tolist() == sorted(mine.tolist())  # exactly its 4 rows, sorted, once each
    if kind == "parquet":
        groups = {int(r) // 4 for _, rows in source.requests for r in rows}
        source.inner._cache.clear()
        before = source.inner.groups_read
        dataset.shard(2, batch=16, rank=2, world_size=4, shuffle=True, seed=1)
        assert source.inner.groups_read - before == 2 * len(groups)  # only the row groups of its rows, per column


def test_npy_is_memory_mapped_and_read_in_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(data_sources, "PIECE_BYTES", 4 * 4096)
    monkeypatch.setattr(data_sources, "FOLIO_BYTES", 4096)
    rows = np.array([0, 1, 2, 3, 4, 5, 9, 20, 21, 36])
    assert [p.tolist() for p in data_sources._pieces(rows, 24)] == [rows.tolist()]  # 37 * 24 bytes: one piece
    assert [p.tolist() for p in data_sources._pieces(rows, 4096)] == [[0, 1, 2, 3], [4, 5, 9, 20], [21, 36]]
    dense = np.arange(0, 100)
    assert [len(p) for p in data_sources._pieces(dense, 1024)] == [8] * 12 + [4]  # (16 - 8 KiB) / 1 KiB rows
    dataset = Dataset.load(_write("npy", _data(), tmp_path / "npy"), INPUTS)
    assert isinstance(dataset.reader._map("x"), np.memmap)
    for order in (np.arange(37), np.array([36, 0, 17, 17, 5])):
        out = dataset.take(order)
        assert type(out["x"]) is np.ndarray and np.array_equal(out["x"], _data()["x"][order])


def test_parquet_batch_axis_and_tensor_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    seq = np.arange(5 * 4, dtype=np.float32).reshape(5, 4)  # rows along axis 1
    write_parquet({"s": seq}, tmp_path / "a", batch_axes={"s": 1})
    dataset = Dataset.load(tmp_path / "a", (DataInput("s", "float32", (5, "batch"), 1),))
    assert np.array_equal(dataset.take(np.array([3, 0, 3]))["s"], seq[:, [3, 0, 3]])
    tensors = pa.FixedShapeTensorArray.from_numpy_ndarray(_data()["x"])
    pq.write_table(pa.table({"x": tensors, "y": _data()["y"]}), tmp_path / "t.parquet", row_group_size=10)
    dataset = Dataset.load(tmp_path / "t.parquet", INPUTS)
    assert np.array_equal(dataset.take(np.array([36, 2]))["x"], _data()["x"][[36, 2]])


def _error(path, inputs=INPUTS):
    with pytest.raises(RunError) as caught:
        Dataset.load(path, inputs)
    assert "\n" not in str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize("kind", ["npy", "parquet"])
def test_validation_errors_name_the_path_and_input(tmp_path, kind):
    data = _data()
    assert _error(_write(kind, {"x": data["x"]}, tmp_path / "a")) == f"{tmp_path / 'a'}: missing input 'y' (it holds: x)"
    message = _error(_write(kind, {**data, "x": data["x"].astype(np.float64)}, tmp_path / "b"))
    assert message == f"{tmp_path / 'b'}: input 'x' has dtype float64, the model expects float32"
    message = _error(_write(kind, {**data, "x": data["x"][:, :, :2]}, tmp_path / "c"))
    assert message.startswith(f"{tmp_path / 'c'}: input 'x' has shape [37, 2, 2], the model expects [batch, 2, 3]")
    empty = {name: array[:0] for name, array in data.items()}
    assert _error(_write(kind, empty, tmp_path / "e")).endswith("input 'x' has no rows")


def test_row_count_mismatch_between_npy_files(tmp_path):
    data = _data()
    write_npy({**data, "y": data["y"][:30]}, tmp_path / "d")
    assert _error(tmp_path / "d").endswith("inputs have different row counts along their batch axes: 'x' 37, 'y' 30")


def test_unreadable_files_name_path_and_reason(tmp_path):
    (tmp_path / "n").mkdir()
    (tmp_path / "n" / "x.npy").write_bytes(b"\x93NUMPY garbage")
    np.save(tmp_path / "n" / "y.npy", _data()["y"])
    assert _error(tmp_path / "n").startswith(f"{tmp_path / 'n' / 'x.npy'}: not a readable .npy file: ")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    assert _error(tmp_path / "bad.parquet").startswith(f"{tmp_path / 'bad.parquet'}: not a readable Parquet file: ")
    (tmp_path / "empty").mkdir()
    assert "holds no .npy or .parquet files" in _error(tmp_path / "empty")
    assert "no such data file or directory" in _error(tmp_path / "missing")
    write_npy(_data(), tmp_path / "both")
    write_parquet(_data(), tmp_path / "both")
    assert "holds both .npy and .parquet files" in _error(tmp_path / "both")


def test_parquet_column_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = _data(4)
    pq.write_table(pa.table({"x": pa.array(data["x"].reshape(4, 6).tolist()), "y": data["y"]}), tmp_path / "v.parquet")
    assert "column 'x' (list<element: double>) holds variable-length lists" in _error(tmp_path / "v.parquet")
    pq.write_table(pa.table({"x": pa.array(["a"] * 4), "y": data["y"]}), tmp_path / "s.parquet")
    assert "column 'x' (string): not a numeric column" in _error(tmp_path / "s.parquet")
    (tmp_path / "m").mkdir()
    write_parquet(data, tmp_path / "m", file_rows=2)
    pq.write_table(pa.table({"y": data["y"]}), tmp_path / "m" / "part-00009.parquet")
    assert "part-00009.parquet: its columns differ from those of" in _error(tmp_path / "m")
    y = pa.array([0, 1, None, 3], pa.int64())
    pq.write_table(pa.table({"x": parquet_column(data["x"]), "y": y}), tmp_path / "n.parquet")
    dataset = Dataset.load(tmp_path / "n.parquet", INPUTS)
    with pytest.raises(RunError, match=r"n.parquet: column 'y', row 2: null value; every row needs a value$"):
        dataset.take(np.arange(4))


def test_missing_pyarrow_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    write_parquet(_data(), tmp_path / "p")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    assert "reading Parquet needs pyarrow, which is not installed; pip install pyarrow" in _error(tmp_path / "p")


def test_ids_are_checked_in_every_format(tmp_path):
    data = _data()
    data["y"][23] = 9
    for kind in ("npy", "parquet"):
        dataset = Dataset.load(_write(kind, data, tmp_path / kind), INPUTS)
        with pytest.raises(RunError, match=r"input 'y' row 23 holds 9 at \[23\], outside \[0, 5\) \(test\); 1 such"):
            check_ids(dataset, {"y": (5, None, "test")})


def test_converter_writes_both_layouts(tmp_path):
    np.savez(tmp_path / "d.npz", **_data())
    assert convert([str(tmp_path / "d.npz"), str(tmp_path / "npy"), "--format", "npy"]) == 0
    assert convert([str(tmp_path / "d.npz"), str(tmp_path / "pq"), "--format", "parquet", "--file-rows", "20"]) == 0
    assert sorted(p.name for p in (tmp_path / "pq").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    for kind in ("npy", "pq"):
        assert np.array_equal(Dataset.load(tmp_path / kind, INPUTS).take(np.arange(37))["x"], _data()["x"])


def _run(out, data, tmp_path, tag):
    trained = tmp_path / f"{tag}.onnx"
    done = subprocess.run([sys.executable, "-m", "transpiler.cli", "run", str(out), "--data", str(data),
                           "--eval-data", str(data), "--batch", "8", "--steps", "6", "--shuffle", "--seed", "3",
                           "--export", str(trained), "--metrics", str(tmp_path / f"{tag}.jsonl")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr
    records, summary = read_metrics(tmp_path / f"{tag}.jsonl")
    losses = [(r["loss"], r.get("eval_loss")) for r in records] + [summary["final_loss"]]
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(trained).graph.initializer}, losses


@pytest.mark.mpi
def test_gpt_on_four_ranks_trains_the_same_from_every_format(model_dir, tmp_path):
    """The held-out check of issue 29: the built-in GPT on 4 CPU ranks, shuffled, from a .npy
    directory and from Parquet equals the run from the .npz bit for bit."""
    src = model_dir("gpt")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "transpiler.cli", str(src / "model.onnx"), "--gpus", "4",
                           "--optimizer", "adamw", "-o", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert convert([str(src / "data.npz"), str(tmp_path / "npy"), "--format", "npy"]) == 0
    assert convert([str(src / "data.npz"), str(tmp_path / "pq"), "--format", "parquet", "--row-group-rows", "16",
                    "--file-rows", "100"]) == 0
    expected, losses = _run(out, src / "data.npz", tmp_path, "npz")
    assert losses[-2][1] is not None  # the evaluation ran, from the same format
    for kind in ("npy", "pq"):
        params, other = _run(out, tmp_path / kind, tmp_path, kind)
        assert other == losses
        assert params.keys() == expected.keys()
        for name in expected:
            assert np.array_equal(params[name], expected[name]), (kind, name)
