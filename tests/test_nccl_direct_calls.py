"""The nccl backend's direct collectives (NcclCommunicator.all_reduce_many, reduce_many,
broadcast_many; runtime/gpu/session_collectives.py) as the NCCL calls they make, checked without a
GPU: a recording stand-in for CuPy's NCCL module and communicator. Each bucket is one group; each
tensor one call with the right send and receive buffers for the rank's role; a mean is ncclAvg
where the module has it, else the sum and a division of what this rank receives; a failure inside
the group still closes it and is one line naming the rank and the collective; alone (one rank, or a
pretend world) each result is the rank's own input."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest

from runtime.errors import RunError
from runtime.gpu.nccl import NcclCommunicator

FLOAT32, SUM, AVG = 7, 0, 4


class _Buffer:
    """What the calls read of a device array: its pointer, size and dtype."""

    def __init__(self, ptr: int, size: int = 16, dtype=np.float32):
        self.data, self.size, self.dtype = SimpleNamespace(ptr=ptr), size, np.dtype(dtype)


class _Stream(nullcontext):
    """The communication stream: a context (copies alone) with a pointer (the calls)."""

    ptr = 99


def _communicator(rank: int, size: int, *, avg: bool = True, fail: bool = False):
    log: list[tuple] = []
    module = SimpleNamespace(NCCL_SUM=SUM, NCCL_FLOAT32=FLOAT32, NCCL_FLOAT64=8, NCCL_FLOAT16=6, NCCL_INT64=5,
                             NCCL_INT32=2, NCCL_INT8=0, NCCL_UINT8=1,
                             groupStart=lambda: log.append(("groupStart",)), groupEnd=lambda: log.append(("groupEnd",)))
    if avg:
        module.NCCL_AVG = AVG

    def call(name):
        def record(*args):
            if fail:
                raise RuntimeError("unhandled cuda error")
            log.append((name, *args))
        return record

    comm = object.__new__(NcclCommunicator)  # no device: only what the direct calls use
    comm._nccl, comm.rank, comm.size = module, rank, size
    comm.comm = SimpleNamespace(allReduce=call("allReduce"), reduce=call("reduce"), broadcast=call("broadcast"))
    comm.stream = _Stream()
    comm.finish_mean = lambda view: log.append(("mean", view.data.ptr))
    return comm, log



def test_all_reduce_is_one_group_of_out_of_place_calls_and_the_mean_is_ncclavg():
    comm, log = _communicator(rank=1, size=4)
    comm.all_reduce_many([_Buffer(10), _Buffer(20, 8)], [_Buffer(11), _Buffer(21, 8)], True, "AllReduce 'b0'")
    assert log == [("groupStart",), ("allReduce", 10, 11, 16, FLOAT32, AVG, 99), ("allReduce", 20, 21, 8, FLOAT32, AVG, 99),
                   ("groupEnd",)]


def test_without_ncclavg_a_mean_is_the_sum_then_a_division_of_what_this_rank_receives():
    comm, log = _communicator(rank=0, size=4, avg=False)
    comm.all_reduce_many([_Buffer(10)], [_Buffer(11)], True, "b")
    assert log == [("groupStart",), ("allReduce", 10, 11, 16, FLOAT32, SUM, 99), ("groupEnd",), ("mean", 11)]
    for rank, divided in ((2, [("mean", 31)]), (1, [])):  # a Reduce divides on its root only
        comm, log = _communicator(rank=rank, size=4, avg=False)
        comm.reduce_many([_Buffer(30)], [_Buffer(31)] if rank == 2 else [], 2, True, "b")
        receive = 31 if rank == 2 else 30  # off the root NCCL reads no receive buffer: the send one is passed
        assert log == [("groupStart",), ("reduce", 30, receive, 16, FLOAT32, SUM, 2, 99), ("groupEnd",), *divided]


def test_broadcast_sends_from_the_root_and_receives_everywhere():
    comm, log = _communicator(rank=0, size=2)
    comm.broadcast_many([_Buffer(40)], [_Buffer(41)], 0, "b")
    assert log == [("groupStart",), ("broadcast", 40, 41, 16, FLOAT32, 0, 99), ("groupEnd",)]
    comm, log = _communicator(rank=1, size=2)
    comm.broadcast_many([], [_Buffer(41)], 0, "b")  # off the root: no inputs, its receive buffer passed twice
    assert log == [("groupStart",), ("broadcast", 41, 41, 16, FLOAT32, 0, 99), ("groupEnd",)]


def test_a_failure_inside_the_group_closes_it_and_names_the_rank_and_collective():
    comm, log = _communicator(rank=3, size=4, fail=True)
    with pytest.raises(RunError, match=r"^rank 3: NCCL failed in AllReduce 'b7' \(order 7\): unhandled cuda error$"):
        comm.all_reduce_many([_Buffer(10)], [_Buffer(11)], False, "AllReduce 'b7' (order 7)")
    assert log == [("groupStart",), ("groupEnd",)]


def test_alone_each_result_is_the_rank_own_input():
    comm, log = _communicator(rank=0, size=1)
    sends, recvs = [np.arange(4, dtype=np.float32), np.ones(2, np.float32)], [np.zeros(4, np.float32), np.zeros(2, np.float32)]
    comm.all_reduce_many(sends, recvs, True, "b")
    comm.broadcast_many([], [np.full(3, 7, np.float32)], 0, "b")  # a receiver alone keeps its buffer
    assert log == [] and all(np.array_equal(s, r) for s, r in zip(sends, recvs))


def test_bfloat16_buckets_travel_as_ncclbfloat16():
    """--grad-dtype bf16: a bfloat16 tensor is uint16 raw bits in CuPy; NCCL gets ncclBfloat16 (9,
    where CuPy's module does not name it) and sums bfloat16, with ncclAvg for a mean."""
    comm, log = _communicator(rank=0, size=2)
    comm.all_reduce_many([_Buffer(10, 8, np.uint16)], [_Buffer(11, 8, np.uint16)], True, "b")
    assert log == [("groupStart",), ("allReduce", 10, 11, 8, 9, AVG, 99), ("groupEnd",)]
    comm._nccl.NCCL_BFLOAT16 = 42  # a module that names it is believed
    comm.broadcast_many([_Buffer(40, 4, np.uint16)], [_Buffer(41, 4, np.uint16)], 0, "b")
    assert log[-2] == ("broadcast", 40, 41, 4, 42, 0, 99)


def test_a_bfloat16_mean_is_the_widened_quotient_rounded_once(monkeypatch):
    """zero's ReduceScatter (and a mean without ncclAvg) divides after the sum: on bfloat16's raw bits
    the kernel widens, divides in float32 and rounds to nearest even once, which is what the CPU
    communicators' bfloat16 mean (ml_dtypes) computes; checked here on the NumPy form of the
    kernel's steps, and that the call runs in place on the communication stream."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from runtime.gpu import nccl as nccl_module
    from runtime.gpu.elementwise_steps import round_bf16_numpy, widen_bf16_numpy

    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096),
                             [0.0, -0.0, np.inf, -np.inf, 3.0, 1e-40]]).astype(np.float32)
    bits = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    for size in (2, 3, 4, 6, 8):
        want = (bits.view(ml_dtypes.bfloat16) / ml_dtypes.bfloat16(size)).view(np.uint16)
        got = round_bf16_numpy(widen_bf16_numpy(bits) / np.float32(size))
        np.testing.assert_array_equal(got, want, err_msg=f"size {size}")
    calls = []
    kernel = lambda *args: calls.append(args)  # noqa: E731
    monkeypatch.setattr(nccl_module, "bf16_divide", lambda cp: kernel)
    comm = object.__new__(NcclCommunicator)
    comm.stream, comm.size, comm.cp = _Stream(), 4, None
    view = np.zeros(4, np.uint16)
    comm.finish_mean(view)
    assert len(calls) == 1 and calls[0][0] is view and calls[0][2] is view and calls[0][1] == np.float32(4)
