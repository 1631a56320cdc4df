"""A CPU rank's onnxruntime threads (runtime/cores.py): its share of the cores it may run on, among
the ranks of its host that may run on them too, whether the launcher bound each rank to cores of its
own or every rank inherited one set."""

from __future__ import annotations

import pytest

from runtime import cores
from runtime.cores import threads_per_rank


def _cores(first: int, count: int) -> frozenset[int]:
    return frozenset(range(first, first + count))


@pytest.mark.parametrize(("own", "local", "threads"), [
    (_cores(0, 32), [_cores(0, 32)] * 2, 16),  # unbound (our mpiexec): the host's cores halved
    (_cores(0, 4), [_cores(0, 4)] * 2, 2),  # one restricted set (a container's 4 of 64) shared by 2
    (_cores(0, 1), [_cores(0, 1), _cores(1, 1)], 1),  # bound to a core each (Open MPI's default for 2)
    (_cores(8, 8), [_cores(0, 8), _cores(8, 8)], 8),  # bound to 8 cores each: all of its own
    (_cores(0, 2), [_cores(0, 2)] * 64, 1),  # more ranks than cores: one thread each
])
def test_a_rank_runs_its_share_of_the_cores_it_may_run_on(own, local, threads):
    assert threads_per_rank(own, local) == threads


def test_where_the_os_cannot_say_every_core_is_allowed(monkeypatch):
    monkeypatch.delattr(cores.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(cores.os, "cpu_count", lambda: 6)
    assert cores.allowed_cores() == _cores(0, 6)
