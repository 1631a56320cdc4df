"""The data-parallel strategies: one module each, one table.

    STRATEGIES["allreduce"]      the reference: AllReduce, every rank updates everything (default)
    STRATEGIES["sharded"]        Reduce to the bucket's root, update there, Broadcast (the seed design)
    STRATEGIES["zero"]           ReduceScatter, each rank updates 1/N of the bucket, AllGather
    STRATEGIES["local"]          one device, no collective (--gpus 1, the single-device graphs)

The interface is ``transpiler.strategies.base.Strategy``. A new strategy is a new module here and
one entry in ``_ALL``; nothing else names strategies (docs/architecture.md has a worked example).
"""

from __future__ import annotations

from transpiler.strategies.allreduce import AllReduce
from transpiler.strategies.base import Strategy
from transpiler.strategies.local import Local
from transpiler.strategies.sharded import Sharded
from transpiler.strategies.zero import Zero

__all__ = ["DEFAULT_STRATEGY", "STRATEGIES", "Strategy", "strategy_for", "user_strategies"]

# In the order --strategy's error message lists them.
_ALL: tuple[Strategy, ...] = (Sharded(), AllReduce(), Zero(), Local())

STRATEGIES: dict[str, Strategy] = {s.name: s for s in _ALL}
# Measured on 4 H100s (docs/benchmarks.md, "N GPUs", run h100x4-s24): allreduce is the fastest or
# tied on every model and holds the least memory on two of three; it is also DDP's default.
DEFAULT_STRATEGY = AllReduce.name
_SINGLE_DEVICE = next(s for s in _ALL if s.single_device)


def user_strategies() -> tuple[str, ...]:
    """The names --strategy accepts."""
    return tuple(name for name, s in STRATEGIES.items() if s.user_selectable)


def strategy_for(name: str, world_size: int) -> Strategy:
    """The strategy that builds a graph for ``world_size`` ranks: one device needs no collective."""
    return _SINGLE_DEVICE if world_size == 1 else STRATEGIES[name]
