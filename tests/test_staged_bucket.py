"""A ReduceScatter's staged bucket (runtime/gpu/session_collectives.py, STAGED_FLAT): onnxruntime
hands its start a buffer each run, which may move between uncaptured runs and holds whatever was
there before. ``StartRunner._stage`` must make the bucket's views into this run's buffer and zero
its padding tail (whose sum lands in the last rank's slice), and keep the views where the buffer did
not move. Checked on CPU with NumPy buffers that expose ``.data.ptr`` as CuPy's do."""

from __future__ import annotations

import types

import numpy as np
from onnx import helper

from runtime.collectives import COLLECTIVE_DOMAIN, TensorSpec, make_collective
from runtime.gpu.session_collectives import Bucket, StartRunner

WORLD, RANK = 4, 3  # the last rank: its slice holds the padding
SHAPES = [(3, 5), (7,)]  # 22 values: S = 6, N x S = 24, two of padding


class _Buffer(np.ndarray):
    """A NumPy array whose ``.data.ptr`` is its address, as a CuPy array's is."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


def _bucket() -> Bucket:
    node = helper.make_node("ReduceScatter", ["a", "b"], ["slice"], name="rs", domain=COLLECTIVE_DOMAIN, order=0,
                            reduction="mean")
    op = make_collective(node, [TensorSpec((6,), np.dtype(np.float32))], RANK, "test")
    bucket = Bucket(op, staged=True)
    bucket.layout = op.flat_layout(SHAPES, WORLD, RANK)
    return bucket


def _buffer(fill: float) -> _Buffer:
    return np.full(WORLD * 6, fill, np.float32).view(_Buffer)


def test_each_run_s_buffer_gets_the_views_and_a_zero_padding_tail():
    bucket = _bucket()
    assert bucket.layout.total == WORLD * 6
    for fill in (7.0, -3.0):  # two runs, two buffers, each full of an earlier value's bytes
        flat = _buffer(fill)
        StartRunner._stage(bucket, flat)
        assert bucket.flat is flat
        np.testing.assert_array_equal(flat[22:], 0)  # the padding, in the last rank's slice
        np.testing.assert_array_equal(flat[:22], fill)  # nothing else written: the inputs are copied in after
        bucket.inputs["a"][...] = 1.0
        bucket.inputs["b"][...] = 2.0
        np.testing.assert_array_equal(flat[:22], [1.0] * 15 + [2.0] * 7)
        np.testing.assert_array_equal(bucket.outputs["slice"], flat[RANK * 6:])
        assert np.shares_memory(bucket.mean_view, flat) and bucket.mean_view.size == 6


def test_a_buffer_that_did_not_move_keeps_its_views():
    bucket = _bucket()
    flat = _buffer(1.0)
    StartRunner._stage(bucket, flat)
    views = bucket.inputs
    flat[:] = 5.0
    StartRunner._stage(bucket, flat)
    assert bucket.inputs is views
    np.testing.assert_array_equal(flat[22:], 0)
