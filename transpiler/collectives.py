"""Building the collective ops of domain ``graph_transpiler`` and the check that every rank issues the
same sequence of them. Their schema (domain, ops, attributes) is contract/collectives.py; docs/contracts.md."""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

from contract.collectives import ATTRIBUTES, DOMAIN, OPS, PHASES, REDUCTIONS, SENDS_BUCKET, VERSION
from transpiler.errors import TranspileError

__all__ = ["DOMAIN", "OPS", "VERSION", "append_collective", "bucket_tensors", "check_same_sequence",
           "collective_nodes", "signature"]


def bucket_tensors(node: ir.Node) -> list[ir.Value]:
    """The bucket's full tensors as this rank sees them: what a Reduce-like op sends, what a
    Broadcast-like op receives (a non-root Reduce has no outputs, a non-root Broadcast no inputs)."""
    return list(node.inputs if node.op_type in SENDS_BUCKET else node.outputs)


def _attrs(order: int, bucket: int, phase: str, root: int | None, reduction: str | None) -> dict:
    attrs: dict = {"order": order, "bucket": bucket, "phase": phase}
    if root is not None:
        attrs["root"] = root
    if reduction is not None:
        attrs["reduction"] = reduction
    return attrs


def _typed_outputs(node: ir.Node, like: Sequence[ir.Value], names: Sequence[str]) -> list[ir.Value]:
    # A receiving rank allocates its buffers from these types, so they must be complete and static.
    for out, ref, name in zip(node.outputs, like, names):
        out.name = name
        out.dtype = ref.dtype
        out.shape = ir.Shape(ref.shape)
    return list(node.outputs)


def append_collective(
    graph: ir.Graph,
    op: str,
    inputs: Sequence[ir.Value],
    *,
    like: Sequence[ir.Value],
    output_names: Sequence[str] | None,
    order: int,
    bucket: int,
    phase: str,
    root: int | None = None,
    reduction: str | None = None,
) -> list[ir.Value]:
    """Append one collective node moving a bucket; ``like`` gives the tensors' types.

    ``output_names`` is None on a rank that receives nothing (a non-root Reduce).
    """
    attrs = _attrs(order, bucket, phase, root, reduction)
    # The contract's schema (contract/collectives.py): what the runtime's executors will read.
    assert op in OPS and set(attrs) == set(ATTRIBUTES[op]), (op, sorted(attrs))
    assert phase in PHASES and reduction in (None, *REDUCTIONS), (phase, reduction)
    node = ir.node(
        op,
        list(inputs),
        attrs,
        domain=DOMAIN,
        num_outputs=0 if output_names is None else len(output_names),
        name=f"{phase}/{op}_{order}",
    )
    graph.append(node)
    return _typed_outputs(node, like, output_names or [])


def collective_nodes(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph if n.domain == DOMAIN]


def signature(graph: ir.Graph) -> list[tuple]:
    """What must agree across ranks: op, bucket, root, reduction, and each tensor's dtype and size."""
    sig = []
    for node in sorted(collective_nodes(graph), key=lambda n: n.attributes["order"].as_int()):
        attrs = {k: a.value for k, a in node.attributes.items()}
        tensors = bucket_tensors(node)
        sig.append(
            (
                node.op_type,
                attrs.get("order"),
                attrs.get("bucket"),
                attrs.get("root"),
                attrs.get("reduction"),
                tuple((str(v.dtype), str(v.shape)) for v in tensors),
            )
        )
    return sig


def check_same_sequence(graphs: Sequence[ir.Graph], phase: str) -> None:
    """Raise if the ranks' collective sequences differ (that would hang at run time)."""
    reference = signature(graphs[0])
    checked = {id(graphs[0])}
    for rank, graph in enumerate(graphs[1:], start=1):
        if id(graph) in checked:  # ranks sharing a graph (Strategy.rank_key): one check each
            continue
        checked.add(id(graph))
        sig = signature(graph)
        if sig != reference:
            where = next((i for i, (a, b) in enumerate(zip(reference, sig)) if a != b), min(len(sig), len(reference)))
            raise TranspileError(
                f"internal error: rank {rank}'s {phase} collectives differ from rank 0's at position {where}"
                f" ({sig[where] if where < len(sig) else 'missing'} vs {reference[where] if where < len(reference) else 'missing'})"
            )
