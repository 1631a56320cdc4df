"""runtime/gpu/cudnn.py ``fastest``: the algorithm the native Conv gradients run, chosen by each
algorithm's median time over cudnn.FIND_RUNS of cuDNN's Finds (on CPU: Find and the device memory
are stand-ins; the GPU tests run the real one)."""

from __future__ import annotations

from types import SimpleNamespace

from runtime.gpu import cudnn


def _perf(algo: int, time: float, memory: int = 0, math: int = cudnn.TENSOR_OP_MATH) -> cudnn.BwdFilterAlgoPerf:
    return cudnn.BwdFilterAlgoPerf(algo=algo, status=0, time=time, memory=memory, mathType=math)


def _device():
    allocated = []

    def memory(nbytes):
        allocated.append(nbytes)
        return SimpleNamespace(ptr=4096)

    cp = SimpleNamespace(cuda=SimpleNamespace(memory=SimpleNamespace(Memory=memory, OutOfMemoryError=MemoryError),
                                              runtime=SimpleNamespace(CUDARuntimeError=RuntimeError)))
    return cp, allocated


def test_the_median_over_the_finds_picks_the_algorithm_not_one_lucky_run():
    # Algorithm 1 wins the first Find by noise; algorithm 0 is faster in most of them.
    runs = [[_perf(1, 0.90), _perf(0, 0.95), _perf(2, 3.0)]]
    runs += [[_perf(0, 0.93), _perf(1, 1.10), _perf(2, 3.1)] for _ in range(cudnn.FIND_RUNS - 1)]
    calls = []

    def find(scratch, size):
        calls.append((scratch, size))
        return runs[len(calls) - 1]

    cp, allocated = _device()
    best = cudnn.fastest(cp, lambda algo: [10, 20, 300 << 20][algo], 3, find)
    assert best.algo == 0 and abs(best.time - 0.93) < 1e-6  # its median, not the first Find's 0.95
    # Every Find ran on one scratch block, as large as the largest need within the limit.
    assert calls == [(4096, 20)] * cudnn.FIND_RUNS and allocated == [20]


def test_an_algorithm_timed_with_two_math_types_is_two_candidates_and_none_found_is_none():
    # The FMA form of algorithm 3 wins the first Find; its tensor-op form wins the other four.
    runs = [[_perf(3, 0.9, math=cudnn.FMA_MATH), _perf(3, 1.0, math=cudnn.DEFAULT_MATH)]]
    runs += [[_perf(3, 1.0, math=cudnn.DEFAULT_MATH), _perf(3, 2.0, math=cudnn.FMA_MATH)]
             for _ in range(cudnn.FIND_RUNS - 1)]
    calls = iter(runs)
    cp, _ = _device()
    best = cudnn.fastest(cp, lambda algo: 0, 4, lambda scratch, size: next(calls))
    assert (best.algo, best.mathType, best.time) == (3, cudnn.DEFAULT_MATH, 1.0)
    assert cudnn.fastest(cp, lambda algo: None, 4, lambda scratch, size: []) is None


def test_an_algorithm_only_one_find_could_run_is_no_candidate():
    # Algorithm 1 ran (and looked fastest) in the first Find only: its one timing is noise, not a median.
    runs = [[_perf(1, 0.5), _perf(0, 0.9)]] + [[_perf(0, 0.9)] for _ in range(cudnn.FIND_RUNS - 1)]
    calls = iter(runs)
    cp, _ = _device()
    assert cudnn.fastest(cp, lambda algo: 0, 2, lambda scratch, size: next(calls)).algo == 0
