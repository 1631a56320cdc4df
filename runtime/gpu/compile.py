"""A segment compiled for the CUDA EP: the passes between a cut segment and its onnxruntime session.

    InlineFunctions   nodes whose domain runs as its ONNX function become those functions' nodes
    Specialize        static input shapes; shape computations folded (runtime/specialize.py)
    LowerForCuda      rewrites the CUDA EP runs faster or at all (lowering.py)
    SessionCollectives  collective nodes made start/finish nodes run inside (session_collectives.py)
    WidenBfloat16     bfloat16 inputs and outputs cross the segment's edges as float32
    FixedOutputs      outputs that are constants or copies of an input taken out of the session
    TakeNativeNodes   native nodes made custom ops of the session (in_session.py)

Like the transpiler's passes (transpiler/passes/): each pass is one class with ``call`` and the
invariants around it as ``requires``/``ensures``; ``compile_segment`` runs them in order and an
error names the pass and the passes before it. Their state is one ``Compiled`` (the model and
what the passes take out of it); the session (session.py) is made from it.

Invariant: for inputs of the specialized shapes, the compiled model together with the fixed
outputs computes what the segment computes, up to the order of float32 sums (lowering.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx
import onnx.inliner

from runtime.collectives import COLLECTIVE_DOMAIN
from runtime.errors import RunError
from runtime.gpu import session_collectives
from runtime.gpu.elementwise_steps import round_bf16_numpy
from runtime.gpu.in_session import take_native_nodes
from runtime.gpu.lowering import CONCAT_MAX_INPUTS, lower_for_cuda, widen_bfloat16
from runtime.segments import Segment
from runtime.specialize import NEVER_FOLDED, specialize


@dataclass
class Compiled:
    """A segment on its way to a session."""

    model: onnx.ModelProto
    shapes: dict[str, tuple[int, ...]]  # of the segment's inputs, this run's
    inside: frozenset[str]  # native domains run inside the session
    where: str
    here: tuple[int, int, int]  # (segment, part, stage)
    constants: dict[str, Any] = field(default_factory=dict)  # output -> host value (FixedOutputs)
    copies: dict[str, str] = field(default_factory=dict)  # output -> the input it copies (FixedOutputs)
    custom_ops: list = field(default_factory=list)  # of the taken nodes (TakeNativeNodes)
    bfloat16_edges: frozenset[str] = frozenset()  # inputs and outputs that stay bfloat16 (WidenBfloat16)


class SegmentPass(ABC):
    """One step; ``requires`` and ``ensures`` raise AssertionError with what does not hold."""

    def requires(self, state: Compiled) -> None:  # noqa: B027 - no precondition unless a pass states one
        return None

    @abstractmethod
    def call(self, state: Compiled) -> None: ...

    def ensures(self, state: Compiled) -> None:  # noqa: B027 - no postcondition unless a pass states one
        return None


def _outputs(state: Compiled) -> set[str]:
    return {o.name for o in state.model.graph.output}


class InlineFunctions(SegmentPass):
    """Nodes of a native domain that runs neither here nor between sessions (switched off) run as
    their functions, inlined so that the later passes see their ops. Those of domains run inside
    the session keep theirs: for shape inference, and to run as functions where a node cannot be
    taken in (in_session.py)."""

    def call(self, state):
        model = state.model
        if model.functions:
            kept = [(f.domain, f.name) for f in model.functions if f.domain in state.inside]
            state.model = (onnx.inliner.inline_selected_functions(model, kept, exclude=True) if kept
                           else onnx.inliner.inline_local_functions(model))

    def ensures(self, state):
        stray = [f.name for f in state.model.functions if f.domain not in state.inside]
        assert not stray, f"functions left: {stray}"


class Specialize(SegmentPass):
    """``registry``: where the step's collectives run inside the session, the one whose communicator
    gives the world size that types an AllConcat's output (specialize.py)."""

    def __init__(self, registry=None):
        self.registry = registry

    def call(self, state):
        comm = None if self.registry is None else self.registry.comm
        state.model = specialize(state.model, state.shapes, world=None if comm is None else comm.size)

    def ensures(self, state):
        dynamic = [i.name for i in state.model.graph.input
                   if not all(d.HasField("dim_value") for d in i.type.tensor_type.shape.dim)]
        assert not dynamic, f"inputs without a static shape: {dynamic}"


class LowerForCuda(SegmentPass):
    def call(self, state):
        state.model = widen_bfloat16(lower_for_cuda(state.model))

    def ensures(self, state):
        wide = [n.name for n in state.model.graph.node if n.op_type == "Concat" and len(n.input) > CONCAT_MAX_INPUTS]
        assert not wide, f"Concats of more than {CONCAT_MAX_INPUTS} inputs: {wide}"


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else attribute.graphs:
                yield from _all_nodes(sub)


class SessionCollectives(SegmentPass):
    """The collective nodes the cut kept in the segment become start and finish nodes
    run inside the session (runtime/gpu/session_collectives.py); their output specs are recorded
    in ``registry`` for the starts, which lay the buckets out."""

    def __init__(self, registry):
        self.registry = registry

    def requires(self, state):
        Specialize().ensures(state)

    def call(self, state):
        comm = self.registry.comm  # None where no communicator is joined (a segment of no collectives)
        state.model, originals = session_collectives.rewrite(state.model, state.where,
                                                             world=None if comm is None else comm.size)
        self.registry.record(state.model, originals)

    def ensures(self, state):
        assert not any(n.domain == COLLECTIVE_DOMAIN for n in state.model.graph.node), "a collective node is left"


class WidenBfloat16(SegmentPass):
    """A bfloat16 value (--precision bf16) crosses a segment's edges as float32, exactly (every
    bfloat16 is a float32), except those the program passes as bfloat16 (``bfloat16_edges``:
    buffers.bfloat16_edges, held as raw bits): NumPy and CuPy have no bfloat16, so the native
    runners between sessions read float32. A bfloat16 input is read as float32 and cast once
    inside, a bfloat16 output cast once at the end; inside, the session computes as the graph
    says. A native node run between sessions then reads and writes float32 (its kernels' dtype),
    which is exact on the way in and rounds nothing the graph did not."""

    def call(self, state):
        graph = state.model.graph
        low, wide = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
        kept = state.bfloat16_edges
        ins = {v.name for v in graph.input if v.type.tensor_type.elem_type == low} - kept
        outs = {v.name for v in graph.output if v.type.tensor_type.elem_type == low} - ins - kept
        if not ins and not outs:
            return
        inner = {name: f"{name}.bf16" for name in ins | outs}
        for node in graph.node:
            node.output[:] = [inner.get(n, n) if n in outs else n for n in node.output]
        for node in _all_nodes(graph):  # readers, in subgraphs too (outer-scope references)
            node.input[:] = [inner.get(n, n) for n in node.input]
        for info in graph.value_info:
            info.name = inner.get(info.name, info.name)
        for value in [*graph.input, *graph.output]:
            if value.name in inner:
                value.type.tensor_type.elem_type = wide
        first = [onnx.helper.make_node("Cast", [n], [inner[n]], to=low, name=f"{n}.narrow") for n in sorted(ins)]
        last = [onnx.helper.make_node("Cast", [inner[n]], [n], to=wide, name=f"{n}.widen") for n in sorted(outs)]
        nodes = first + list(graph.node) + last
        del graph.node[:]
        graph.node.extend(nodes)

    def ensures(self, state):
        edges = [v.name for v in [*state.model.graph.input, *state.model.graph.output]
                 if v.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 and v.name not in state.bfloat16_edges]
        assert not edges, f"bfloat16 inputs or outputs left: {edges}"


class FixedOutputs(SegmentPass):
    """Outputs onnxruntime would not compute on the stream take no part in the session: a value
    computable from constants alone (onnxruntime folds it into an initializer) and an Identity of
    an input (it removes the Identity). It copies such an output into its bound buffer with a
    blocking cudaMemcpy when a run starts, which is illegal while a CUDA graph is captured (CUDA
    error 906, "operation would make the legacy stream depend on a capturing blocking stream").
    Segments cut finely (elementwise fusion) pass constants and copies between them; here a
    constant is computed once on the host (onnxruntime's CPU EP: ``ort``) and the session writes
    it into its buffers once, and a copy is a device copy on the compute stream each step."""

    def __init__(self, ort):
        self.ort = ort

    def call(self, state):
        model = state.model
        graph = model.graph
        known = {t.name for t in graph.initializer}
        inputs = {i.name for i in graph.input}
        source: dict[str, str] = {}  # Identity output -> the graph input it copies
        for node in graph.node:
            ins = [n for n in node.input if n]
            if node.op_type == "Identity" and node.domain in ("", "ai.onnx") and ins:
                if ins[0] in inputs or ins[0] in source:
                    source[node.output[0]] = source.get(ins[0], ins[0])
            if node.domain in ("", "ai.onnx") and node.op_type not in NEVER_FOLDED and all(n in known for n in ins):
                known.update(o for o in node.output if o)
        constant = [o.name for o in graph.output if o.name in known]
        state.copies = {o.name: source[o.name] for o in graph.output if o.name in source and o.name not in known}
        if constant:
            # A model of the constant nodes alone (no graph inputs), evaluated once on the host. A
            # bfloat16 output (one of WidenBfloat16's kept edges) comes out widened, NumPy having no
            # bfloat16, and is held as its raw bits, as the program holds it.
            low = {o.name for o in graph.output if o.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16}
            nodes = [n for n in graph.node if n.output and all(o in known for o in n.output if o)]
            nodes += [onnx.helper.make_node("Cast", [n], [f"{n}.widened"], to=onnx.TensorProto.FLOAT)
                      for n in constant if n in low]
            fetched = [f"{n}.widened" if n in low else n for n in constant]
            fold = onnx.helper.make_graph(nodes, "constants", [], [onnx.helper.make_empty_tensor_value_info(n) for n in fetched],
                                          list(graph.initializer))
            fold_model = onnx.helper.make_model(fold, opset_imports=model.opset_import, ir_version=model.ir_version,
                                                functions=model.functions)
            options = self.ort.SessionOptions()
            options.log_severity_level = 3
            values = self.ort.InferenceSession(fold_model.SerializeToString(), options,
                                               providers=["CPUExecutionProvider"]).run(fetched, {})
            state.constants = {n: round_bf16_numpy(v) if n in low else v for n, v in zip(constant, values)}
        fixed = set(constant) | set(state.copies)
        if fixed:
            kept = [o for o in graph.output if o.name not in fixed]
            del graph.output[:]
            graph.output.extend(kept)

    def ensures(self, state):
        both = _outputs(state) & (set(state.constants) | set(state.copies))
        assert not both, f"fixed outputs still computed by the session: {sorted(both)}"


class TakeNativeNodes(SegmentPass):
    """``runner(group, where)`` makes the runner of a one-node NativeGroup (native.py)."""

    def __init__(self, runner: Callable, device):
        self.runner, self.device = runner, device

    def requires(self, state):
        Specialize().ensures(state)  # the ops are made for static shapes

    def call(self, state):
        if state.inside and state.model.graph.output:
            state.model, state.custom_ops = take_native_nodes(state.model, state.inside, self.runner, self.device,
                                                              state.where, state.here)

    def ensures(self, state):
        functions = {(f.domain, f.name) for f in state.model.functions}
        orphans = [n.name for n in state.model.graph.node
                   if n.domain in state.inside and (n.domain, n.op_type) not in functions]
        assert not orphans, f"native nodes neither taken nor runnable as functions: {orphans}"


def compile_segment(segment: Segment, shapes: dict[str, tuple[int, ...]], where: str, passes: list[SegmentPass],
                    inside: frozenset[str], bfloat16_edges: frozenset[str] = frozenset()) -> Compiled:
    """Run ``passes`` on ``segment``'s model specialized to ``shapes``. A RunError from a pass (a
    node the user's graph gets wrong) passes through; any other failure names the pass."""
    state = Compiled(segment.model, dict(shapes), frozenset(inside), where, (segment.index, segment.part, segment.stage),
                     bfloat16_edges=frozenset(bfloat16_edges))
    ran: list[str] = []
    for step in passes:
        name = type(step).__name__
        try:
            step.requires(state)
            step.call(state)
            step.ensures(state)
        except RunError:
            raise
        except Exception as exc:  # a bug in a pass (or onnx's inliner or inference on this graph)
            after = f" (after {', '.join(ran)})" if ran else ""
            kind = "an invariant failed" if isinstance(exc, AssertionError) else type(exc).__name__
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise RunError(f"{where}: compiling for the CUDA EP, {name}{after}: {kind}: {message}") from None
        ran.append(name)
    return state


def default_passes(ort, runner: Callable, device, registry=None) -> list[SegmentPass]:
    """``registry``: a session_collectives.Registry where the step's collectives run inside."""
    inside = [SessionCollectives(registry)] if registry is not None else []
    return [InlineFunctions(), Specialize(registry), LowerForCuda(), *inside, WidenBfloat16(), FixedOutputs(ort),
            TakeNativeNodes(runner, device)]
