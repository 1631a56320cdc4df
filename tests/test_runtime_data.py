"""Data loading, validation errors, deterministic batches and sharding."""

from __future__ import annotations

import numpy as np
import pytest

from runtime import Dataset, RunError, shard_size
from runtime.plan import DataInput

INPUTS = (DataInput("x", "float32", ("batch", 3), 0), DataInput("y", "int64", ("batch",), 0))


def _data(rows=10):
    return {"x": np.arange(rows * 3, dtype=np.float32).reshape(rows, 3), "y": np.arange(rows, dtype=np.int64)}


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("y"), r"d.npz: missing input 'y' \(it holds: x\)"),
    (lambda d: d.update(x=d["x"].astype(np.float64)), "d.npz: input 'x' has dtype float64, the model expects float32"),
    (lambda d: d.update(x=d["x"][:, :2]), r"d.npz: input 'x' has shape \[10, 2\], the model expects \[batch, 3\]"),
    (lambda d: d.update(y=d["y"][:7]), "d.npz: inputs have different row counts along their batch axes: 'x' 10, 'y' 7"),
    (lambda d: d.update(x=d["x"][:0], y=d["y"][:0]), "d.npz: input 'x' has no rows"),
])
def test_validation_errors_name_the_file_and_input(tmp_path, change, message):
    data = _data()
    change(data)
    np.savez(tmp_path / "d.npz", **data)
    with pytest.raises(RunError, match=message):
        Dataset.load(tmp_path / "d.npz", INPUTS)


def test_unreadable_files_are_one_line_errors(tmp_path):
    with pytest.raises(RunError, match="no such data file"):
        Dataset.load(tmp_path / "missing.npz", INPUTS)
    (tmp_path / "bad.npz").write_text("not a zip")
    with pytest.raises(RunError, match=r"bad.npz: not a readable .npz file"):
        Dataset.load(tmp_path / "bad.npz", INPUTS)


def test_batch_must_split_into_equal_shards():
    assert shard_size(8, 4) == 2
    with pytest.raises(RunError, match="global batch 6 does not split into 4 equal shards"):
        shard_size(6, 4)


def test_global_batches_wrap_modulo_the_data_and_shards_are_contiguous():
    ds = Dataset(_data(10), INPUTS, "<data>")
    # batch 2 of size 4 is rows 8, 9, 0, 1; rank 1 of 2 takes the second half.
    np.testing.assert_array_equal(ds.shard(2, batch=4, rank=0, world_size=2)["y"], [8, 9])
    np.testing.assert_array_equal(ds.shard(2, batch=4, rank=1, world_size=2)["y"], [0, 1])
    full = ds.shard(2, batch=4, rank=0, world_size=1)
    np.testing.assert_array_equal(full["x"][:, 0], [24, 27, 0, 3])


def test_shuffle_is_a_seeded_permutation_per_epoch():
    ds = Dataset(_data(10), INPUTS, "<data>")
    epoch0 = np.concatenate([ds.shard(b, batch=5, rank=0, world_size=1, shuffle=True, seed=7)["y"] for b in (0, 1)])
    epoch1 = np.concatenate([ds.shard(b, batch=5, rank=0, world_size=1, shuffle=True, seed=7)["y"] for b in (2, 3)])
    assert sorted(epoch0) == list(range(10)) == sorted(epoch1)  # each epoch reads every row once
    assert list(epoch0) != list(epoch1)  # ... in a fresh order
    np.testing.assert_array_equal(epoch0, np.random.default_rng([7, 0]).permutation(10))
    # Shards of the global batch concatenate to the batch, on any world size.
    halves = [ds.shard(3, batch=4, rank=r, world_size=2, shuffle=True, seed=7)["y"] for r in (0, 1)]
    np.testing.assert_array_equal(np.concatenate(halves), ds.shard(3, batch=4, rank=0, world_size=1, shuffle=True, seed=7)["y"])


def test_epochs_round_up_to_whole_steps():
    ds = Dataset(_data(10), INPUTS, "<data>")
    assert ds.steps_for_epochs(1, 4) == 3 and ds.steps_for_epochs(2, 5) == 4
