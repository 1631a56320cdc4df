"""What each rank moves and computes: collectives with their bytes (ring traffic model), the
compute segments of the runtime's cut, and the nominal cost model the timeline uses.

Traffic model (bytes each rank sends and receives per step; docs/inspect.md): the bandwidth-optimal
ring algorithms NCCL uses. With N ranks and a bucket of B bytes:

- AllReduce (ring: reduce-scatter then all-gather): every rank sends and receives 2(N-1)/N * B.
- Reduce (pipelined chain root+1 -> root+2 -> ... -> root): every rank but the root sends B; every
  rank but the chain's head (root+1) receives B.
- Broadcast (pipelined chain root -> root+1 -> ... -> root-1): every rank but the chain's tail
  (root-1) sends B; every rank but the root receives B.
- N = 1: nothing moves.
"""

from __future__ import annotations

from collections import Counter

import onnx

from contract.collectives import DOMAIN, CutError, constants_as_initializers, consumed, place_alap
from contract.ops import CONV_GRAD_DOMAIN, CONV_WEIGHT_GRAD
from inspection.errors import InspectError
from inspection.model import Types, attr, op_name

TRAFFIC_MODEL = "ring"
# Cost model of the schedule (no measured times on CPU): nominal device and link speeds. They only
# set the relative lengths of the boxes in the timeline; --timings replaces them with measurements.
COMPUTE_FLOPS_PER_S = 1e12
NODE_OVERHEAD_S = 5e-6
LINK_BYTES_PER_S = 10e9
COLLECTIVE_LATENCY_S = 10e-6


def traffic(op: str, nbytes: int, root: int | None, rank: int, world: int) -> tuple[int, int]:
    """(sent, received) bytes of ``rank`` for one collective under the ring model (module docstring)."""
    if world <= 1:
        return 0, 0
    if op == "AllReduce":
        v = 2 * (world - 1) * nbytes // world
        return v, v
    if op == "Reduce":
        head = (root + 1) % world
        return (0 if rank == root else nbytes), (0 if rank == head else nbytes)
    if op == "Broadcast":
        tail = (root - 1) % world
        return (0 if rank == tail else nbytes), (0 if rank == root else nbytes)
    # ReduceScatter / AllGather (zero strategy, docs/contracts.md): ring, (N-1)/N of the full buffer.
    v = (world - 1) * nbytes // world
    return v, v


def graph_collectives(model: onnx.ModelProto, rank: int, world: int, plan_seq: list[dict] | None) -> list[dict]:
    """The collective nodes of a rank graph in execution order, with what this rank moves."""
    types = Types(model.graph)
    nodes = sorted((n for n in model.graph.node if n.domain == DOMAIN), key=lambda n: attr(n, "order", 0))
    out = []
    for node in nodes:
        order = attr(node, "order")
        root = attr(node, "root")
        # The tensors moved are the same on every rank; a rank holds one side of the wire
        # (a non-root Reduce has no outputs, a non-root Broadcast no inputs).
        names = list(node.output) if node.output else list(node.input)
        if node.op_type == "ReduceScatter":  # the full bucket goes in, a 1/N slice comes out
            names = list(node.input)
        sides = [n for n in names if n]
        params = None
        if plan_seq is not None and order is not None and order < len(plan_seq):
            params = plan_seq[order]["params"]
        tensors = []
        for i, name in enumerate(sides):
            dtype, shape = types.info.get(name, ("?", None))
            tensors.append({"name": name, "param": params[i] if params and i < len(params) else None,
                            "dtype": dtype, "shape": shape, "bytes": types.nbytes(name)})
        nbytes = sum(t["bytes"] or 0 for t in tensors)
        sent, recv = traffic(node.op_type, nbytes, root, rank, world)
        out.append({
            "order": order, "op": node.op_type, "name": node.name, "phase": attr(node, "phase"),
            "bucket": attr(node, "bucket"), "root": root, "reduction": attr(node, "reduction"),
            "is_root": root == rank if root is not None else None,
            "inputs": [n for n in node.input if n], "outputs": [n for n in node.output if n],
            "tensors": tensors, "bytes": nbytes, "sent_bytes": sent, "recv_bytes": recv,
            # A tensor whose size the batch sets (an AllConcat's rows): its bytes are not in the sums.
            "batch_sized": any(t["bytes"] is None for t in tensors),
        })
    return out


def node_flops(node: onnx.NodeProto, types: Types) -> int:
    """A rough FLOP count: 2*M*N*K for MatMul/Gemm/Conv, one per output element otherwise."""
    if node.op_type in ("Constant", "Shape", "Size", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"):
        return 0
    out = sum(types.numel(o) or 0 for o in node.output if o)
    if node.op_type == "MatMul" and node.input:
        a = types.shape(node.input[0])
        k = a[-1] if a and isinstance(a[-1], int) else 1
        return 2 * out * k
    if node.op_type == "Gemm" and node.input:
        a = types.shape(node.input[0])
        trans_a = attr(node, "transA", 0)
        k = a[0 if trans_a else -1] if a and len(a) == 2 and isinstance(a[0 if trans_a else -1], int) else 1
        return 2 * out * k
    if node.domain == CONV_GRAD_DOMAIN and node.op_type == CONV_WEIGHT_GRAD and len(node.input) == 2:
        # dW(M, C, k...) = sum over every dY element of C*prod(k) products with X's window.
        x = types.shape(node.input[0]) or []
        k = x[1] if len(x) > 1 and isinstance(x[1], int) else 1
        for d in attr(node, "kernel_shape", []):
            k *= d
        return 2 * (types.numel(node.input[1]) or 0) * k
    if node.op_type in ("Conv", "ConvTranspose") and len(node.input) > 1:
        w = types.shape(node.input[1]) or []
        k = 1
        for d in w[1:]:
            k *= d if isinstance(d, int) else 1
        return 2 * out * k
    return out


def compute_seconds(flops: int, n_nodes: int) -> float:
    return flops / COMPUTE_FLOPS_PER_S + n_nodes * NODE_OVERHEAD_S


def collective_seconds(sent: int, recv: int) -> float:
    return COLLECTIVE_LATENCY_S + max(sent, recv) / LINK_BYTES_PER_S


def cut_segments(model: onnx.ModelProto, rank: int, where: str, rows: int) -> list[dict]:
    """The runtime's ALAP cut of a rank graph (runtime/segments.py; the rule itself is
    contract.collectives.place_alap) as plain dicts: per segment its nodes (by first output name),
    op counts, an estimated cost, and the collective after it. Segments whose results nobody reads
    are left out, as the runtime leaves them out."""
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)  # (no weights loaded here: a cheap copy, the caller's graph untouched)
    constants_as_initializers(graph)  # as the runtime cuts: constants in every segment
    nodes = list(graph.node)
    graph_inputs = {i.name for i in graph.input}
    initializers = {t.name for t in graph.initializer if t.name not in graph_inputs}
    producer = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    reads = [consumed(node) for node in nodes]
    edges = [(producer[name], i) for i, names in enumerate(reads) for name in names if name in producer]
    orders = {i: int(attr(n, "order", 0)) for i, n in enumerate(nodes) if n.domain == DOMAIN}
    try:
        segment_of, _ = place_alap(len(nodes), edges, orders, [n.name or n.op_type for n in nodes])
    except CutError as exc:
        raise InspectError(f"{where}: {exc}") from None
    k_count = len(orders)
    # Position in execution order: segment k at 2k, collective k at 2k+1, graph outputs after all.
    readers: dict[str, list[int]] = {}
    for i, names in enumerate(reads):
        pos = 2 * orders[i] + 1 if i in orders else 2 * segment_of[i]
        for name in names:
            readers.setdefault(name, []).append(pos)
    for o in graph.output:
        readers.setdefault(o.name, []).append(2 * k_count + 1)
    types = Types(graph, rows)
    out = []
    for k in range(k_count + 1):
        members = [i for i in sorted(segment_of) if segment_of[i] == k]
        produced = {name for i in members for name in nodes[i].output if name}
        outputs = [name for i in members for name in nodes[i].output
                   if name and any(p > 2 * k for p in readers.get(name, ()))]
        if not outputs:
            continue
        seg = [nodes[i] for i in members]
        flops = sum(node_flops(n, types) for n in seg)
        out.append({
            "index": k,
            "nodes": len(seg),
            "node_keys": [n.output[0] for n in seg if n.output],
            "ops": dict(Counter(op_name(n) for n in seg).most_common()),
            "flops": flops,
            "est_seconds": compute_seconds(flops, len(seg)),
            "inputs": list(dict.fromkeys(name for i in members for name in reads[i]
                                         if name not in produced and name not in initializers)),
            "outputs": outputs,
            "followed_by": k if k < k_count else None,
        })
    return out
