"""Collectives: the Communicator interface, its backends, and one executor class per collective op.

To add a collective: write ``runtime/collectives/<op>.py`` with a ``CollectiveOp`` subclass (its list
form ``run`` and its flat form: ``flat_layout``, ``call_flat``, ...; see op.py) and list it in
``_EXECUTORS`` below; every backend then runs it through the Communicator calls it makes.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx

from contract.collectives import DOMAIN as COLLECTIVE_DOMAIN
from runtime.collectives.allconcat import AllConcat
from runtime.collectives.allgather import AllGather
from runtime.collectives.allreduce import AllReduce
from runtime.collectives.base import Communicator, TensorSpec
from runtime.collectives.broadcast import Broadcast
from runtime.collectives.local import LocalCommunicator, LocalGroup
from runtime.collectives.op import CollectiveOp
from runtime.collectives.reduce import Reduce
from runtime.collectives.reducescatter import ReduceScatter
from runtime.errors import RunError

_EXECUTORS: dict[str, type[CollectiveOp]] = {cls.op_type: cls for cls in (AllReduce, Reduce, Broadcast, ReduceScatter, AllGather, AllConcat)}
# The collectives that send updated parameters (`sharded`'s Broadcasts, `zero`'s AllGathers).
PUBLISHING = frozenset({Broadcast.op_type, AllGather.op_type})


def publishes_updates(model: onnx.ModelProto) -> bool:
    """Whether a step graph publishes updated parameters through a collective. By op type, not by
    what a rank's own updates write, so every rank of a plan answers alike (a rank that roots no
    parameter has no update but the same Broadcasts)."""
    return any(n.domain == COLLECTIVE_DOMAIN and n.op_type in PUBLISHING for n in model.graph.node)


def make_collective(node: onnx.NodeProto, output_specs: Sequence[TensorSpec], rank: int, where: str) -> CollectiveOp:
    """The executor for one collective node of rank ``rank``'s graph (``where`` names the file)."""
    cls = _EXECUTORS.get(node.op_type)
    if cls is None:
        raise RunError(f"{where}: node '{node.name}' is collective '{node.op_type}', which this runtime does not "
                       f"implement (implemented: {', '.join(sorted(_EXECUTORS))}; add one in runtime/collectives/)")
    return cls(node, output_specs, rank, where)


__all__ = [
    "COLLECTIVE_DOMAIN",
    "CollectiveOp",
    "Communicator",
    "LocalCommunicator",
    "LocalGroup",
    "TensorSpec",
    "make_collective",
    "publishes_updates",
]
