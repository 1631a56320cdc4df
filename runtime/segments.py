"""Cut a rank's graph at its collective nodes into compute segments (as late as possible).

With K collectives (domain graph_transpiler) ordered by their ``order`` attribute, a rank graph runs
as ``segment 0, collective 0, segment 1, collective 1, ..., collective K-1, segment K``. Segment k is
a standalone ONNX model holding the compute nodes placed in it.

Placement rule (ALAP): a compute node goes to segment ``min(order of the collectives downstream of
it)``, or K if none: the latest segment that still precedes the first collective needing it. So
segment k holds exactly what collective k needs that no earlier collective needed: on a GPU, the
bucket's collective starts as soon as its gradients exist while the rest of the backward runs in
later segments. A node must also come after every collective upstream of it (segment > that order);
ALAP placement satisfies this unless the ``order`` attributes contradict the data flow, which is an
error. Because a consumer's downstream collectives are a subset of its producer's, a producer is
never placed after its consumer, so every segment only reads values that already exist.

``split_tail=True`` (the GPU backend) also cuts the last segment into parts by the latest collective
upstream of each node: part j holds the tail nodes that need collective j-1 and no later one (part 0
those that need none). So the optimizer update of bucket j can run as soon as collective j is done,
while the collectives of later buckets are still in flight. Producers need a subset of their
consumers' upstream collectives, so the parts in increasing j are again a topological order.

``native_domains`` (the backend's ``Backend.native_domains``, e.g. the fused optimizer updates on the
GPU) takes the nodes of those domains out of the onnxruntime segments: each segment (or part) is cut
into stages, alternately onnxruntime nodes (even stages) and native nodes (odd stages, one
``NativeGroup`` item each, run by the backend itself). A native node's stage is the first odd one
not before the stages of its producers in the same segment (ASAP), so independent native nodes share
one stage: the nodes before them, one group, the nodes after. An onnxruntime node then goes to the
last even stage not after its readers in the part (ALAP), and not before its ASAP one: what the
backward computes from forward values alone (ReLU's mask) is computed where it is read instead of
being kept from the forward on. Native nodes of ``late_domains`` (the backend's
``Backend.late_native_domains``: the GPU's optimizer updates) go late the same way, to the last odd
stage their readers allow: a part's updates are then one group (one multi-tensor launch). Producers are in the same or an earlier stage, so the stages in order are a
topological order.

``collectives_inside`` (the nccl backend runs the collectives in its sessions) keeps the collective
nodes in the segments; with native stages, each run of collectives of one op type (in their order)
goes to an onnxruntime stage after the run before it (``_collectives_apart``), so that every rank's
sessions hold the same collectives whether or not an update of its own separates them (NCCL asks
every rank to capture the same calls in a CUDA graph).

Before the cut, Constant nodes become initializers (``contract.collectives.constants_as_initializers``,
which inspect applies too): an initializer is copied into every segment that reads it, so a constant
never crosses a cut as a run-time input that onnxruntime could not fold.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx
import numpy as np
import onnx
from onnx import helper, numpy_helper

from contract.collectives import SHAPED_BY_INPUT, CutError, constants_as_initializers, consumed, place_alap
from runtime.collectives import COLLECTIVE_DOMAIN, CollectiveOp, TensorSpec, make_collective
from runtime.errors import RunError
from runtime.onnx_types import value_types, with_inferred_types


@dataclass
class Segment:
    """Compute nodes that run between collective ``index - 1`` and collective ``index``."""

    index: int
    node_names: tuple[str, ...]
    inputs: tuple[str, ...]  # fed from graph inputs, earlier segments and collectives
    outputs: tuple[str, ...]  # read by later segments, collectives or the graph outputs
    model: onnx.ModelProto  # standalone: its initializers are the ones its nodes use
    part: int = 0  # with split_tail, the part of the last segment (see the module docstring)
    stage: int = 0  # with native_domains, its stage in the part (even; see the module docstring)


def place(item: Segment | NativeGroup) -> str:
    """Where a segment or native group is, for messages (and file names of diagnostics): "segment K",
    then " part J" and " stage S" where they are not 0 (a step cut by native nodes has many stages)."""
    return f"segment {item.index}" + (f" part {item.part}" if item.part else "") + (f" stage {item.stage}" if item.stage else "")


@dataclass
class NativeGroup:
    """Consecutive nodes of a backend-native domain, in graph order: stage ``stage`` (odd) of part
    ``part`` of segment ``index``. The backend runs them itself (``Backend.compile`` gives its runner)."""

    index: int
    part: int
    stage: int
    nodes: tuple[onnx.NodeProto, ...]
    inputs: tuple[str, ...]  # read from graph inputs, constants, earlier items
    outputs: tuple[str, ...]  # every output of its nodes

    def by_domain(self) -> list[NativeGroup]:
        """This group's nodes as groups of one domain each, to run in turn: a node joins the last
        group of its domain unless a group after that one computes one of its inputs or reads one
        (a node may write over its input in place: the fused optimizer update), else starts a new
        group at the end. So each group reads only values of groups before it (nodes come in graph
        order), and a stage of independent nodes of two domains makes two groups."""
        runs: list[tuple[str, list[onnx.NodeProto], set[str]]] = []  # (domain, nodes, names they read or write)
        for node in self.nodes:
            ins = set(_consumed(node))
            last = next((i for i in range(len(runs) - 1, -1, -1) if runs[i][0] == node.domain), None)
            if last is None or any(ins & touched for _, _, touched in runs[last + 1:]):
                runs.append((node.domain, [], set()))
                last = len(runs) - 1
            runs[last][1].append(node)
            runs[last][2].update(ins, (name for name in node.output if name))
        if len(runs) == 1:
            return [self]
        return [build_native(nodes, (self.index, self.part, self.stage)) for _, nodes, _ in runs]


@dataclass
class CutGraph:
    """A rank graph as the runtime executes it."""

    where: str  # the file, for error messages
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    items: list[Segment | NativeGroup | CollectiveOp]  # in execution order; empty segments are left out
    # Initializers read directly by a collective or named as a graph output (no segment carries them),
    # e.g. the initial parameter value a root's init graph feeds into its Broadcast.
    constants: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def segments(self) -> list[Segment]:
        return [item for item in self.items if isinstance(item, Segment)]

    @property
    def collectives(self) -> list[CollectiveOp]:
        return [item for item in self.items if isinstance(item, CollectiveOp)]

    @property
    def native_groups(self) -> list[NativeGroup]:
        return [item for item in self.items if isinstance(item, NativeGroup)]


def load_graph(path: Path) -> onnx.ModelProto:
    try:
        return onnx.load(str(path))
    except Exception as exc:  # onnx raises DecodeError, OSError, ValueError... for a bad file
        raise RunError(f"{path}: cannot load ONNX model: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def cut_graph(model: onnx.ModelProto, rank: int, where: str, *, split_tail: bool = False,
              native_domains: Iterable[str] = (), late_domains: Iterable[str] = (),
              collectives_inside: bool = False) -> CutGraph:
    """Cut ``model`` (rank ``rank``'s step or init graph; ``where`` names its file) into segments
    (and native groups of the nodes of ``native_domains``, those of ``late_domains`` staged late).
    ``model`` may be rewritten in place
    (its Constant nodes become initializers) where shape inference could not copy it.
    ``collectives_inside``: the collective nodes stay in the segments as other nodes do (checked,
    not cut at)."""
    model = with_inferred_types(model)
    constants_as_initializers(model.graph)
    graph = model.graph
    types = value_types(graph)
    nodes = list(graph.node)
    graph_inputs = [i.name for i in graph.input]
    graph_outputs = [o.name for o in graph.output]
    # An initializer that is also a graph input is only a default; the fed value wins (ONNX semantics).
    initializers = {t.name: t for t in graph.initializer if t.name not in set(graph_inputs)}
    if graph.sparse_initializer:
        raise RunError(f"{where}: sparse initializers are not supported by the runtime")

    _check_defined(nodes, graph_inputs, initializers, graph_outputs, where)
    collectives = _collectives(nodes, types, rank, where)
    inside = collectives if collectives_inside else {}
    if collectives_inside:  # the backend runs them inside its sessions (runtime/gpu/session_collectives.py)
        collectives = {}
    segment_of, earliest = _place_alap(nodes, collectives, where)
    k_count = len(collectives)
    # Part of the last segment each of its nodes goes to (always 0 without split_tail).
    part_of = {i: (earliest[i] if split_tail and k == k_count else 0) for i, k in segment_of.items()}

    stage_of = _stages(nodes, segment_of, part_of, frozenset(native_domains), frozenset(graph_outputs),
                       frozenset(late_domains))
    if inside and native_domains:  # without native stages every rank's step is one session
        _collectives_apart(nodes, inside, segment_of, part_of, stage_of, frozenset(native_domains))

    # Position in execution order, compared as tuples: segment k at (2k, part, stage), collective k
    # at (2k+1, 0, 0), graph outputs after all.
    end = (2 * k_count + 1, 0, 0)
    readers: dict[str, list[tuple[int, int, int]]] = {}
    for i, node in enumerate(nodes):
        pos = (2 * collectives[i].order + 1, 0, 0) if i in collectives else (2 * segment_of[i], part_of[i], stage_of[i])
        for name in _consumed(node):
            readers.setdefault(name, []).append(pos)
    for name in graph_outputs:
        readers.setdefault(name, []).append(end)

    by_order = sorted(collectives.values(), key=lambda op: op.order)
    members: dict[tuple[int, int, int], list[onnx.NodeProto]] = {}
    for i in sorted(segment_of):  # graph order is a topological order, and stays one per segment
        members.setdefault((segment_of[i], part_of[i], stage_of[i]), []).append(nodes[i])
    items: list[Segment | NativeGroup | CollectiveOp] = []
    for k in range(k_count + 1):
        for part in range(k_count + 1 if split_tail and k == k_count else 1):
            for stage in sorted({st for (kk, pp, st) in members if (kk, pp) == (k, part)}):
                group = members[k, part, stage]
                if stage % 2:
                    items.append(build_native(group, (k, part, stage)))
                    continue
                segment = _build_segment(model, (k, part, stage), group, readers, initializers, types, where)
                if segment is not None:
                    items.append(segment)
        if k < k_count:
            items.append(by_order[k])

    direct = {name for op in by_order for name in op.inputs} | set(graph_outputs)
    direct |= {name for item in items if isinstance(item, NativeGroup) for name in item.inputs}
    constants = {name: numpy_helper.to_array(initializers[name]) for name in direct if name in initializers}
    return CutGraph(where, tuple(graph_inputs), tuple(graph_outputs), items, constants)


def _check_defined(nodes, graph_inputs, initializers, graph_outputs, where: str) -> None:
    """Every value read is defined somewhere. Given that, ALAP placement (and collective order)
    guarantees it is produced before it is read, so this is the only availability check needed."""
    defined = set(graph_inputs) | set(initializers) | {name for node in nodes for name in node.output}
    for node in nodes:
        missing = [name for name in _consumed(node) if name not in defined]
        if missing:
            raise RunError(f"{where}: node '{node.name or node.op_type}' reads {', '.join(repr(m) for m in missing)}, "
                           "which nothing produces")
    missing = [name for name in graph_outputs if name not in defined]
    if missing:
        raise RunError(f"{where}: graph output(s) {', '.join(repr(m) for m in missing)} are never produced")


def _consumed(node: onnx.NodeProto) -> list[str]:
    """Values the node reads, including outer-scope values its subgraphs (If/Loop/Scan bodies) capture."""
    return consumed(node)


def _static_spec(name: str, types: dict[str, onnx.TypeProto], where: str) -> TensorSpec:
    t = types.get(name)
    if t is None or t.WhichOneof("value") != "tensor_type" or not t.tensor_type.HasField("shape"):
        raise RunError(f"{where}: collective output '{name}' has no tensor type with a shape (contract: every "
                       "collective output has a complete static type)")
    dims = t.tensor_type.shape.dim
    if any(not d.HasField("dim_value") for d in dims):
        raise RunError(f"{where}: collective output '{name}' has a symbolic shape; receivers need a static one")
    return TensorSpec(tuple(d.dim_value for d in dims), np.dtype(helper.tensor_dtype_to_np_dtype(t.tensor_type.elem_type)))


def _collectives(nodes: list[onnx.NodeProto], types, rank: int, where: str) -> dict[int, CollectiveOp]:
    """Executors of the collective nodes, keyed by node index; their orders must be 0..K-1."""
    # An op of SHAPED_BY_INPUT takes its output's shape from its input's when it runs: no spec.
    ops = {i: make_collective(n, [] if n.op_type in SHAPED_BY_INPUT else [_static_spec(o, types, where) for o in n.output],
                              rank, where)
           for i, n in enumerate(nodes) if n.domain == COLLECTIVE_DOMAIN}
    orders = sorted(op.order for op in ops.values())
    if orders != list(range(len(ops))):
        raise RunError(f"{where}: collective 'order' attributes are {orders}, expected 0..{len(ops) - 1} each once")
    return ops


def _place_alap(nodes: list[onnx.NodeProto], collectives: dict[int, CollectiveOp],
                where: str) -> tuple[dict[int, int], dict[int, int]]:
    """Segment index of every compute node (see the module docstring for the rule), and for each
    node 1 + the order of the latest collective upstream of it (0 if none): the contract's rule
    (contract/collectives.py, which inspection/ uses too), on this graph's data flow."""
    producer = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    edges = [(producer[name], i) for i, node in enumerate(nodes) for name in _consumed(node) if name in producer]
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(nodes)))
    dag.add_edges_from(edges)
    if not nx.is_directed_acyclic_graph(dag):
        raise RunError(f"{where}: the graph has a cycle")
    try:
        return place_alap(len(nodes), edges, {i: op.order for i, op in collectives.items()},
                          [n.name or n.op_type for n in nodes])
    except CutError as exc:
        raise RunError(f"{where}: {exc}") from None


def _stages(nodes: list[onnx.NodeProto], segment_of: dict[int, int], part_of: dict[int, int],
            native: frozenset[str], outputs: frozenset[str] = frozenset(),
            late: frozenset[str] = frozenset()) -> dict[int, int]:
    """Stage of every compute node in its (segment, part): odd for nodes of ``native`` domains, the
    first not before its producers' (for those of ``late`` domains, the last not after their readers'); even
    for onnxruntime nodes, the last not after its readers' (``outputs``: the graph's, which may go to
    the part's last stage) (module docstring)."""
    stage: dict[int, int] = {}
    if not native:
        return dict.fromkeys(segment_of, 0)
    producer = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    for i in sorted(segment_of):  # graph order: producers first
        here = (segment_of[i], part_of[i])
        low = max((stage[j] for j in (producer.get(name) for name in _consumed(nodes[i]))
                   if j in stage and (segment_of[j], part_of[j]) == here), default=0)
        parity = 1 if nodes[i].domain in native else 0
        stage[i] = low + ((low - parity) % 2)
    # Then onnxruntime nodes as late as their readers allow (reverse graph order: readers first), so
    # that what the backward computes from forward values alone (ReLU's mask) is computed where it is
    # read instead of being kept from the forward on; native nodes stay ASAP (a weight gradient
    # frees its inputs early), but for ``late`` ones (below). A node whose value leaves the part
    # may go to the part's last stage.
    readers: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in _consumed(node):
            if (j := producer.get(name)) is not None:
                readers.setdefault(j, []).append(i)
    last: dict[tuple[int, int], int] = {}
    for i in segment_of:
        here = (segment_of[i], part_of[i])
        last[here] = max(last.get(here, 0), stage[i])
    # The optimizer updates (``late``) go late too: all of a part's then share its last native
    # stage, one group and one multi-tensor launch, instead of one per stage their gradients finish
    # in (ResNet-18 on one GPU: 17 launches).
    for i in sorted(segment_of, reverse=True):
        parity = 1 if nodes[i].domain in native else 0
        if (parity and nodes[i].domain not in late) or not (readers.get(i) or outputs & set(nodes[i].output)):
            continue
        here = (segment_of[i], part_of[i])
        # The latest stage of the node's parity at or before each bound: a reader of the same kind
        # may share the node's stage (one session, or one native group run in dependency order).
        bounds = [stage[j] if (segment_of.get(j), part_of.get(j)) == here else last[here] for j in readers.get(i, [])]
        if outputs & set(nodes[i].output):
            bounds.append(last[here])
        high = min(bounds)
        stage[i] = max(stage[i], high - (high - parity) % 2)
    return stage


def _collectives_apart(nodes: list[onnx.NodeProto], ops: dict[int, CollectiveOp], segment_of: dict[int, int],
                       part_of: dict[int, int], stage: dict[int, int], native: frozenset[str]) -> None:
    """With the collectives inside the segments: the collectives, in their order, fall into runs of
    one op type (a `sharded` step: Reduces, then with --precision fp16 the overflow AllReduce, then
    Broadcasts); each run goes to an onnxruntime stage after the stages of the run before it in the
    part, and what reads it follows. The runs are the same on every rank, so every rank's sessions
    hold the same collectives, whatever the rank's own update puts between them: NCCL asks every
    rank to capture the same calls in a CUDA graph (the root of no parameter under `sharded` ran its
    Reduces and Broadcasts in one session while the others ran two, and hung at 4 GPUs). Stages
    keep their parity and stay a topological order (each node at or after its producers' in the
    part); nodes only move later. ``ops``: the collective nodes' executors, by node index."""
    collectives = sorted((i for i in ops if i in stage), key=lambda i: ops[i].order)
    run_of, run = {}, -1
    for n, i in enumerate(collectives):
        run += n == 0 or nodes[i].op_type != nodes[collectives[n - 1]].op_type
        run_of[i] = run
    here = lambda i: (segment_of[i], part_of[i])  # noqa: E731
    producer = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    # Runs in order: each in one stage, at or after the latest of its own collectives' and the run
    # before it's plus 2 (the next even one); every node at or after its producers' stages (graph
    # order: producers first).
    for r in range(run + 1):
        floor: dict[tuple[int, int], int] = {}
        for i in collectives:
            if run_of[i] <= r:
                floor[here(i)] = max(floor.get(here(i), 0), stage[i] + (2 if run_of[i] < r else 0))
        for i, node in enumerate(nodes):
            if i not in stage:
                continue
            low = floor.get(here(i), 0) if run_of.get(i) == r else 0
            low = max([low] + [stage[j] for j in map(producer.get, _consumed(node)) if j in stage and here(j) == here(i)])
            if low > stage[i]:
                parity = 1 if node.domain in native else 0
                stage[i] = low + ((low - parity) % 2)


def build_native(members: list[onnx.NodeProto], here: tuple[int, int, int]) -> NativeGroup:
    produced = {name for node in members for name in node.output if name}
    inputs = [name for name in dict.fromkeys(name for node in members for name in _consumed(node)) if name not in produced]
    outputs = [name for node in members for name in node.output if name]
    k, part, stage = here
    return NativeGroup(k, part, stage, tuple(members), tuple(inputs), tuple(outputs))


def _build_segment(model: onnx.ModelProto, here: tuple[int, int, int], members: list[onnx.NodeProto],
                   readers: dict[str, list[tuple[int, int, int]]], initializers: dict[str, onnx.TensorProto],
                   types: dict[str, onnx.TypeProto], where: str) -> Segment | None:
    k, part, stage = here
    produced = {name for node in members for name in node.output if name}
    consumed = list(dict.fromkeys(name for node in members for name in _consumed(node)))
    embedded = [name for name in consumed if name in initializers and name not in produced]
    inputs = [name for name in consumed if name not in produced and name not in initializers]
    # Only values someone after this segment reads leave it; the rest die inside the session.
    position = (2 * k, part, stage)
    outputs = [name for node in members for name in node.output if name and any(p > position for p in readers.get(name, ()))]
    kept = [n for n in members if n.domain == COLLECTIVE_DOMAIN]
    if not outputs and kept:
        # A collective kept here must run on every rank, read or not (an AllConcat of rows this rank
        # does not update, under `sharded`): its outputs leave the session, unread.
        outputs = [name for node in kept for name in node.output if name]
    if not outputs:
        return None  # no nodes, or only nodes whose results nobody reads

    def value_info(name: str, required: bool) -> onnx.ValueInfoProto:
        if name in types:
            return helper.make_value_info(name, types[name])
        if required:
            raise RunError(f"{where}: value '{name}' enters segment {k} but has no type in the graph (add it to value_info)")
        return helper.make_empty_tensor_value_info(name)

    # A collective kept in the segment (collectives_inside): its outputs' types, which inference
    # cannot give (no schema), and its domain.
    graph = helper.make_graph(
        members,
        f"{model.graph.name or 'graph'}_segment{k}" + (f"_part{part}" if part else "") + (f"_stage{stage}" if stage else ""),
        inputs=[value_info(name, True) for name in inputs],
        outputs=[value_info(name, False) for name in outputs],
        initializer=[initializers[name] for name in embedded],
        value_info=[value_info(o, True) for n in kept for o in n.output if o not in outputs],
    )
    opsets = [op for op in model.opset_import if op.domain != COLLECTIVE_DOMAIN or kept]
    # onnx's helpers stamp the newest IR version (14 with onnx 1.23), which onnxruntime 1.31 refuses;
    # a segment needs only the IR version its opsets require, so it never asks for more than that.
    ir_version = min(model.ir_version, helper.find_min_ir_version_for(opsets, ignore_unknown=True))
    segment_model = helper.make_model(graph, opset_imports=opsets, ir_version=ir_version, functions=model.functions)
    return Segment(k, tuple(node.name for node in members), tuple(inputs), tuple(outputs), segment_model, part, stage)
