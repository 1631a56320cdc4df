"""Bucketing: gradients grouped, in the order the backward produces them, so one collective moves
many small tensors (as PyTorch DDP and Horovod's tensor fusion do).

A bucket holds parameters of one root only (in the sharded strategy the whole bucket is reduced to,
and broadcast from, that root), and at most ``cap_bytes`` unless a single parameter is larger; the
first bucket of each root (or the first of all, where buckets do not follow roots) at most
``first_cap_bytes``, as DDP makes its first bucket 1 MiB: the first collective then starts after the
first gradients of the backward instead of after ``cap_bytes`` of them.
Buckets are ordered by when they become ready: the backward position of their last gradient.

The cap, unless --bucket-mb sets it (``auto_cap_mb``): an eighth of the trained parameters' bytes
(their float32 gradients, before --grad-dtype halves what travels), within [AUTO_MIN_MB, AUTO_MAX_MB]. Why: on 4 H200s (run h200x4-s64b, docs/benchmarks.md) the
GPT-2-small step (650 MB of gradients) was 29.4 / 28.2 / 27.8 / 27.8 ms at 10 / 25 / 50 / 100 MiB
(`allreduce`; `sharded` 30.0 at 25, 28.9 at 100): fewer collectives, fewer of the compute stream's
stalls at a collective's start, and the contention no larger. ResNet-18 (45 MB) went the other
way, 10.22 / 10.34 / 10.35 ms at 25 / 50 / 100: one bucket leaves nothing to overlap. So a model
keeps about eight buckets or more, and DDP's 25 MiB where that would make buckets smaller; the
upper bound keeps the last bucket, which nothing overlaps, from growing with the model past what
was measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

AUTO_MIN_MB = 25.0  # DDP's bucket_cap_mb
AUTO_MAX_MB = 100.0
AUTO_BUCKETS = 8


def auto_cap_mb(total_bytes: int) -> float:
    """The bucket cap in MiB for a model of ``total_bytes`` of gradients when --bucket-mb is not
    given (the module docstring)."""
    return min(max(total_bytes / AUTO_BUCKETS / 2**20, AUTO_MIN_MB), AUTO_MAX_MB)


@dataclass
class Bucket:
    id: int
    root: int
    params: list[str] = field(default_factory=list)
    bytes: int = 0

    def to_json(self) -> dict:
        return {"id": self.id, "root": self.root, "params": list(self.params), "bytes": self.bytes}


def make_buckets(
    order: Sequence[str],
    sizes: Mapping[str, int],
    roots: Mapping[str, int],
    cap_bytes: int,
    *,
    group_by_root: bool,
    first_cap_bytes: int | None = None,
    alone: frozenset[str] = frozenset(),
) -> list[Bucket]:
    """Group ``order`` (gradients in backward order) into buckets.

    With ``group_by_root`` each root has its own open bucket; otherwise parameters are grouped in
    order regardless of root and the bucket's root is that of its first parameter (it is used only
    to initialize the bucket's parameters with one Broadcast). Each parameter of ``alone`` gets a
    bucket of its own (--sparse-grads: its collective is not the others').
    """
    closed: list[tuple[int, Bucket]] = []  # (backward position of the last gradient, bucket)
    open_: dict[int, tuple[int, Bucket]] = {}
    started: set[int] = set()  # keys whose first bucket is closed
    for position, name in enumerate(order):
        if name in alone:  # a bucket of its own, ready with its gradient; the open ones go on filling
            closed.append((position, Bucket(id=-1, root=roots[name], params=[name], bytes=sizes[name])))
            continue
        key = roots[name] if group_by_root else 0
        if key in open_:
            _, bucket = open_[key]
            cap = cap_bytes if key in started or first_cap_bytes is None else first_cap_bytes
            if bucket.bytes + sizes[name] > cap:
                closed.append(open_.pop(key))
                started.add(key)
        if key not in open_:
            open_[key] = (position, Bucket(id=-1, root=roots[name]))
        _, bucket = open_[key]
        bucket.params.append(name)
        bucket.bytes += sizes[name]
        open_[key] = (position, bucket)
    closed.extend(open_.values())
    closed.sort(key=lambda item: item[0])
    buckets = [bucket for _, bucket in closed]
    for i, bucket in enumerate(buckets):
        bucket.id = i
    return buckets
