"""Placement: which rank is the root of each parameter.

The root initializes the parameter (its value is Broadcast from there) and, in the sharded
strategy, reduces its gradient, runs its optimizer update, keeps its optimizer state and
Broadcasts the new value.

- ``hash``: crc32 of the parameter's name modulo the world size. Stable across processes and
  machines (Python's ``hash()`` is salted per process and would make ranks disagree and hang).
  Balances parameter *counts* on average, but not bytes: one large embedding dominates its root.
- ``balanced`` (the default): parameters sorted by bytes (largest first), each given to the rank
  holding the fewest bytes so far (greedy longest-processing-time; Paddle's later assignment, MXNet
  sorts too). Also deterministic (ties broken by name). GPT-2-small at 4 ranks: imbalance 1.003
  against hash's 1.733, so `sharded`'s heaviest root keeps the optimizer state of 156 MiB of
  parameters instead of 269 (that root sets the step's peak memory and runs its longest update).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from transpiler.errors import TranspileError

METHODS = ("hash", "balanced")


@dataclass(frozen=True)
class Placement:
    method: str
    world_size: int
    roots: dict[str, int]  # parameter -> root rank
    bytes_per_rank: list[int]
    params_per_rank: list[int]

    @property
    def imbalance(self) -> float:
        """Largest per-rank bytes over the mean (1.0 is perfect)."""
        total = sum(self.bytes_per_rank)
        return max(self.bytes_per_rank) * self.world_size / total if total else 1.0

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "bytes_per_rank": self.bytes_per_rank,
            "params_per_rank": self.params_per_rank,
            "imbalance": round(self.imbalance, 6),
        }


def hash_root(name: str, world_size: int) -> int:
    return zlib.crc32(name.encode("utf-8")) % world_size


def place(sizes: Mapping[str, int], world_size: int, method: str) -> Placement:
    """Assign a root rank to every parameter; ``sizes`` maps parameter name to bytes."""
    if method not in METHODS:
        raise TranspileError(f"--placement '{method}' is not one of: {', '.join(METHODS)}")
    if method == "hash":
        roots = {name: hash_root(name, world_size) for name in sizes}
    else:
        load = [0] * world_size
        roots = {}
        # Name breaks ties so the result never depends on dict order.
        for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
            rank = min(range(world_size), key=lambda r: (load[r], r))
            roots[name] = rank
            load[rank] += sizes[name]
    bytes_per_rank = [0] * world_size
    params_per_rank = [0] * world_size
    for name, rank in roots.items():
        bytes_per_rank[rank] += sizes[name]
        params_per_rank[rank] += 1
    return Placement(method, world_size, roots, bytes_per_rank, params_per_rank)
