"""Communicators: the in-process LocalGroup (threads) and the MPI packing helpers."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from runtime import LocalGroup, RunError, TensorSpec
from runtime.collectives.mpi import _dtype_groups, _pack, _unpack


def _run(size, fn):
    """Run fn(comm) on ``size`` thread-ranks; returns per-rank results or raises the first error."""
    group = LocalGroup(size)
    results, errors = [None] * size, [None] * size

    def body(r):
        try:
            results[r] = fn(group.communicator(r))
        except BaseException as exc:
            errors[r] = exc
            group.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    return results


def _bucket(rank):
    rng = np.random.default_rng(rank)
    return [rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal(5).astype(np.float32)]


def test_allreduce_mean_is_the_rank_order_sum_divided_by_size_on_every_rank():
    results = _run(3, lambda c: c.allreduce(_bucket(c.rank), "mean"))
    buckets = [_bucket(r) for r in range(3)]
    for i in range(2):
        expected = (buckets[0][i] + buckets[1][i] + buckets[2][i]) / np.float32(3)
        for r in range(3):
            assert results[r][i].dtype == np.float32
            np.testing.assert_array_equal(results[r][i], expected)  # bit-identical on every rank
    assert results[0][0] is not results[1][0]  # each rank owns its buffers


def test_reduce_delivers_to_root_only_and_broadcast_to_all():
    def body(c):
        reduced = c.reduce(_bucket(c.rank), 1, "sum")
        specs = [TensorSpec((3, 2), np.dtype(np.float32)), TensorSpec((5,), np.dtype(np.float32))]
        received = c.broadcast(reduced if c.rank == 1 else None, 1, specs)
        return reduced, received

    results = _run(3, body)
    assert results[0][0] is None and results[2][0] is None
    total = [sum(_bucket(r)[i] for r in range(3)) for i in range(2)]
    for r in range(3):
        for i in range(2):
            np.testing.assert_array_equal(results[r][1][i], total[i])


def test_allreduce_scalar_and_barrier():
    assert _run(4, lambda c: (c.barrier(), c.allreduce_scalar(float(c.rank)))[1]) == [1.5] * 4


def test_mismatched_collectives_are_an_error_not_a_hang():
    def body(c):
        return c.allreduce(_bucket(0), "sum") if c.rank == 0 else c.reduce(_bucket(0), 0, "sum")

    with pytest.raises(RunError, match="collective mismatch: rank 0 issued .*AllReduce.* rank 1 issued .*Reduce"):
        _run(2, body)


def test_failing_rank_releases_its_peers():
    def body(c):
        if c.rank == 1:
            raise RunError("boom")
        return c.allreduce(_bucket(0), "sum")

    with pytest.raises(RunError, match="boom"):
        _run(3, body)


def test_mean_of_integers_is_refused():
    with pytest.raises(RunError, match="needs a floating dtype"):
        _run(2, lambda c: c.allreduce([np.arange(3)], "mean"))


def test_mpi_packing_moves_a_bucket_in_one_buffer_per_dtype():
    arrays = [np.ones((2, 2), np.float32), np.arange(3, dtype=np.int64), np.full(3, 2, np.float32)]
    groups = _dtype_groups([a.dtype for a in arrays])
    assert list(groups.values()) == [[0, 2], [1]]
    out = [None] * 3
    for dtype, positions in groups.items():
        flat = _pack(arrays, positions, dtype)
        assert flat.ndim == 1 and flat.dtype == dtype
        _unpack(flat, positions, [a.shape for a in arrays], out)
    for a, b in zip(arrays, out):
        np.testing.assert_array_equal(a, b)
