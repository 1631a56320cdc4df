"""How many onnxruntime intra-op threads a CPU rank runs: its share of the cores it may run on.

onnxruntime's default, a thread per core in every session, oversubscribes a host that runs several
ranks. A launcher may also have bound each rank to cores of its own (Slurm's --cpu-bind, a user's
mpirun), or every rank may inherit one restricted set (a container's, a job's allowance): the
share is of the rank's own set, divided among the local ranks whose sets overlap it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def allowed_cores() -> frozenset[int]:
    """The cores this process may run on (every core where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def threads_per_rank(own: frozenset[int], local: Sequence[frozenset[int]]) -> int:
    """Threads for a rank allowed ``own`` cores, among the host's ranks allowed ``local`` (its own
    included): ``own`` shared evenly by the ranks that may run on any of it, at least one."""
    sharing = sum(1 for cores in local if cores & own) or 1
    return max(1, len(own) // sharing)
