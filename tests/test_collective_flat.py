"""The flat form of every collective op (what the GPU program runs), on NumPy buffers, no GPU.

Each op class owns its flat buffer's layout (total size, this rank's shard, which views are the
node's inputs and outputs), its launch (which Communicator flat call, the mean division) and its
no-communication stand-in. The expectations below are computed by hand from the contract
(docs/contracts.md: ReduceScatter/AllGather pad T elements to N*S, S = ceil(T / N)).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from onnx import helper

from runtime import LocalGroup, RunError
from runtime.collectives import (
    _EXECUTORS,
    COLLECTIVE_DOMAIN,
    CollectiveOp,
    Communicator,
    TensorSpec,
    make_collective,
)

F32 = np.dtype(np.float32)
WORLD, RANK = 3, 1
A, B = (3, 2), (5,)  # a bucket of 6 + 5 = 11 elements


def _op(op_type: str, inputs, outputs, out_shapes, rank: int = RANK, **attrs) -> CollectiveOp:
    node = helper.make_node(op_type, list(inputs), list(outputs), name=f"{op_type.lower()}0", domain=COLLECTIVE_DOMAIN,
                            order=0, **attrs)
    return make_collective(node, [TensorSpec(s, F32) for s in out_shapes], rank, "rank1.onnx")


# A bucket that moves whole (AllReduce, Reduce, Broadcast) starts each tensor at a multiple of
# FLAT_ALIGN = 64 elements (cuDNN needs 16-byte aligned weights): b at 64, 69 elements in all.
# op, input shapes, total, shard, input name -> (start, stop, shape), output name -> ..., mean view (start, stop),
# the flat call (method, args after buf), whether this rank divides by N for reduction="mean".
CASES = {
    "AllReduce": (lambda: _op("AllReduce", ["a", "b"], ["ya", "yb"], [A, B], reduction="mean"), [A, B],
                  69, 0, {"a": (0, 6, A), "b": (64, 69, B)}, {"ya": (0, 6, A), "yb": (64, 69, B)},
                  (0, 69), ("all_reduce_flat", ()), True),
    "Reduce(root)": (lambda: _op("Reduce", ["a", "b"], ["ya", "yb"], [A, B], root=1, reduction="mean"), [A, B],
                     69, 0, {"a": (0, 6, A), "b": (64, 69, B)}, {"ya": (0, 6, A), "yb": (64, 69, B)},
                     (0, 69), ("reduce_flat", (1,)), True),
    "Reduce(non-root)": (lambda: _op("Reduce", ["a", "b"], [], [], root=0, reduction="mean"), [A, B],
                         69, 0, {"a": (0, 6, A), "b": (64, 69, B)}, {},
                         (0, 69), ("reduce_flat", (0,)), False),
    "Broadcast(root)": (lambda: _op("Broadcast", ["a", "b"], ["ya", "yb"], [A, B], root=1), [A, B],
                        69, 0, {"a": (0, 6, A), "b": (64, 69, B)}, {"ya": (0, 6, A), "yb": (64, 69, B)},
                        (0, 69), ("broadcast_flat", (1,)), False),
    "Broadcast(non-root)": (lambda: _op("Broadcast", [], ["ya", "yb"], [A, B], root=2), [],
                            69, 0, {}, {"ya": (0, 6, A), "yb": (64, 69, B)},
                            (0, 69), ("broadcast_flat", (2,)), False),
    # T = 11, N = 3: S = 4, the buffer is 12 (one zero of padding); rank 1 owns [4, 8).
    "ReduceScatter": (lambda: _op("ReduceScatter", ["a", "b"], ["s"], [(4,)], reduction="mean"), [A, B],
                      12, 4, {"a": (0, 6, A), "b": (6, 11, B)}, {"s": (4, 8, (4,))},
                      (4, 8), ("reduce_scatter_flat", ()), True),
    # Each rank's slice is S = 4: the buffer is N * S = 12; rank 1's input is [4, 8), the outputs the first 11.
    "AllGather": (lambda: _op("AllGather", ["s"], ["ya", "yb"], [A, B]), [(4,)],
                  12, 4, {"s": (4, 8, (4,))}, {"ya": (0, 6, A), "yb": (6, 11, B)},
                  (0, 12), ("all_gather_flat", ()), False),
    # No output spec (its shape is the input's, N times the rows): a [2, 3] input at N = 3 is rank 1's
    # slice [6, 12) of an 18-element buffer, viewed as [2, 3]; the output the whole buffer as [6, 3].
    "AllConcat": (lambda: _op("AllConcat", ["x"], ["y"], []), [(2, 3)],
                  18, 6, {"x": (6, 12, (2, 3))}, {"y": (0, 18, (6, 3))},
                  (0, 18), ("all_gather_flat", ()), False),
}


def _expect_views(views: dict, buf: np.ndarray, expected: dict) -> None:
    assert list(views) == list(expected)
    for name, (start, stop, shape) in expected.items():
        view = views[name]
        assert view.shape == shape, name
        assert np.shares_memory(view, buf), f"{name} is a copy, not a view of the bucket"
        np.testing.assert_array_equal(view.ravel(), buf[start:stop], err_msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_flat_layout_sizes_shards_and_views(case):
    make, in_shapes, total, shard, ins, outs, (m0, m1), _, _ = CASES[case]
    op = make()
    layout = op.flat_layout(in_shapes, WORLD, RANK)
    assert (layout.total, layout.shard) == (total, shard)
    buf = np.arange(total, dtype=np.float32)
    _expect_views(op.flat_inputs(layout, buf), buf, ins)
    _expect_views(op.flat_outputs(layout, buf), buf, outs)
    mean_view = op.flat_mean_view(layout, buf)
    assert np.shares_memory(mean_view, buf)
    np.testing.assert_array_equal(mean_view, buf[m0:m1])


class _Recorder(Communicator):
    """Records the flat calls a launch makes; the list API is never reached."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.calls = rank, size, []

    def all_reduce_flat(self, buf, label):
        self.calls.append(("all_reduce_flat", buf, (), label))

    def reduce_flat(self, buf, root, label):
        self.calls.append(("reduce_flat", buf, (root,), label))

    def broadcast_flat(self, buf, root, label):
        self.calls.append(("broadcast_flat", buf, (root,), label))

    def reduce_scatter_flat(self, buf, label):
        self.calls.append(("reduce_scatter_flat", buf, (), label))

    def all_gather_flat(self, buf, label):
        self.calls.append(("all_gather_flat", buf, (), label))

    def finish_mean(self, view):
        self.calls.append(("finish_mean", view, (), None))

    allreduce = reduce = broadcast = reduce_scatter = all_gather = barrier = allreduce_scalars = abort = None


@pytest.mark.parametrize("case", list(CASES))
def test_flat_launch_calls_the_op_s_flat_method_then_the_mean(case):
    make, in_shapes, total, _, _, _, _, (method, args), divides = CASES[case]
    op = make()
    layout = op.flat_layout(in_shapes, WORLD, RANK)
    buf = np.zeros(total, np.float32)
    mean_view = op.flat_mean_view(layout, buf)
    comm = _Recorder(RANK, WORLD)
    op.launch_flat(comm, buf, mean_view, "label")
    assert comm.calls[0][0] == method and comm.calls[0][1] is buf and comm.calls[0][2] == args
    assert comm.calls[0][3] == "label"
    if divides:  # the contract's mean: the sum, then / N, on the part this rank holds
        assert [c[0] for c in comm.calls] == [method, "finish_mean"] and comm.calls[1][1] is mean_view
    else:
        assert len(comm.calls) == 1


def test_sum_reductions_are_not_divided():
    op = _op("AllReduce", ["a"], ["y"], [A], reduction="sum")
    comm = _Recorder(RANK, WORLD)
    op.launch_flat(comm, np.zeros(6, np.float32), None, "label")
    assert [c[0] for c in comm.calls] == ["all_reduce_flat"]


def test_every_registered_collective_has_the_flat_form_and_a_case_here():
    covered = {key.split("(")[0] for key in CASES}
    assert covered == set(_EXECUTORS), "add the new op's hand-computed flat layout to CASES"
    for op_type, cls in _EXECUTORS.items():
        assert not inspect.isabstract(cls), f"{op_type} leaves {sorted(cls.__abstractmethods__)} unimplemented"
        assert cls.call_flat is not CollectiveOp.call_flat, f"{op_type} has no flat launch"
        for method in ("flat_layout", "flat_inputs", "flat_outputs", "flat_mean_view", "launch_flat"):
            assert callable(getattr(cls, method)), (op_type, method)


def test_nccl_communicator_implements_every_flat_call():
    from runtime.gpu.nccl import NcclCommunicator  # imports without CuPy: it is loaded in __init__

    for method in ("all_reduce_flat", "reduce_flat", "broadcast_flat", "reduce_scatter_flat", "all_gather_flat",
                   "finish_mean"):
        assert getattr(NcclCommunicator, method) is not getattr(Communicator, method), method


@pytest.mark.parametrize("method, args", [("all_reduce_flat", ("x",)), ("reduce_flat", (0, "x")),
                                          ("broadcast_flat", (0, "x")), ("reduce_scatter_flat", ("x",)),
                                          ("all_gather_flat", ("x",)), ("finish_mean", ())])
def test_communicators_without_flat_buffers_say_so(method, args):
    comm = LocalGroup(1).communicator(0)
    with pytest.raises(RunError, match=f"LocalCommunicator has no flat-buffer collectives \\({method}"):
        getattr(comm, method)(np.zeros(4, np.float32), *args)


def test_an_op_without_a_flat_launch_cannot_be_built():
    class Partial(CollectiveOp):
        op_type = "Partial"

        def run(self, comm, inputs):
            return []

    node = helper.make_node("Partial", [], [], domain=COLLECTIVE_DOMAIN, order=0)
    with pytest.raises(TypeError, match="call_flat"):
        Partial(node, [], 0, "rank0.onnx")


@pytest.mark.gpu
def test_a_one_rank_nccl_communicator_makes_no_nccl_communicator_and_keeps_every_buffer():
    """A world of one joins no NCCL communicator (one held 0.56 GiB on an H200): each flat
    collective leaves its buffer as it is, which is its result on one rank."""
    cupy = pytest.importorskip("cupy")
    from runtime.gpu.cuda import gpu_count
    from runtime.gpu.nccl import NcclCommunicator

    if gpu_count() < 1:
        pytest.skip("needs a GPU")
    comm = NcclCommunicator(None, 0)
    comm.connect()
    try:
        assert comm.comm is None
        buf = cupy.arange(12, dtype=cupy.float32)
        for call in (lambda: comm.all_reduce_flat(buf, "AllReduce"), lambda: comm.reduce_flat(buf, 0, "Reduce"),
                     lambda: comm.broadcast_flat(buf, 0, "Broadcast"), lambda: comm.reduce_scatter_flat(buf, "RS"),
                     lambda: comm.all_gather_flat(buf, "AG")):
            call()
            comm.stream.synchronize()
            np.testing.assert_array_equal(cupy.asnumpy(buf), np.arange(12, dtype=np.float32))
        np.testing.assert_array_equal([v.get() for v in comm.allreduce([cupy.ones(3, cupy.float32)], "mean")][0], [1, 1, 1])
    finally:
        comm.close()
