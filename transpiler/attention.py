"""Attention as one node: the exported pattern of scaled dot-product attention, after the precision
rewrite, replaced by ``graph_transpiler.attention::Attention`` (transpiler/attention_ops.py), whose
gradient rule writes one ``AttentionGrad`` (autodiff/rules/attention.py).

The pattern, as torch.onnx exports ``softmax(q @ k^T * scale masked_fill(~tril, -inf)) @ v`` and
PrecisionPass leaves it (bf16/fp16 matrix products, the softmax in float32 between two casts):

    Qh = Transpose(Xq, [0,2,1,3])   Kt = Transpose(Xk, [0,2,3,1])   Vh = Transpose(Xv, [0,2,1,3])
    S  = MatMul(Qh, Kt)  [-> Mul(S, c) | Div(S, c), c a one-element constant]
         [-> Where(mask, -inf, .) | Where(keep, ., -inf), the mask torch.tril's causal one]
    P  = Cast(Softmax(Cast(., to=float), axis=-1), to=low)
    O  = MatMul(P, Vh)  [-> Transpose(O, [0,2,1,3])]

Xq, Xk, Xv (batch, sequence, heads, head size) become the node's inputs as they are, and its output
Y is the trailing Transpose's (so the four layout copies of the forward, and their four in the
backward, go); where a transpose is not there the rewrite writes the one that makes the layout.
The causal mask is recognized as ``Trilu(ConstantOfShape(., nonzero), k=0, upper=0)`` (torch.tril
of ones), its ``Not``, casts to bool, or a constant equal to either.

Only for --precision bf16|fp16: the fused kernels that pay for the node (cuDNN's) compute in those
dtypes, and the float32 step stays what it was, bit for bit. Anything else in between (dropout on
the probabilities, an additive mask, a probability read elsewhere) leaves the pattern as it is.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from contract.ops import ATTENTION, ATTENTION_DOMAIN
from transpiler.autodiff._context import all_names, fresh_name

_LOW = frozenset({int(ir.DataType.BFLOAT16), int(ir.DataType.FLOAT16)})
_HEADS = [0, 2, 1, 3]  # (B, S, H, D) <-> (B, H, S, D)
_KEYS_T = [0, 3, 1, 2]  # (B, H, D, S) -> (B, S, H, D)
_HIDDEN = -1e30  # a fill at or below this hides its score (exp underflows to 0 in float32): -inf, finfo.min


def _producer(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.domain in ("", "ai.onnx") and node.op_type in op_types else None


def _constant(value: ir.Value | None) -> np.ndarray | None:
    """The value of a constant (an initializer, a Constant, or a Cast of either), as float64 or bool."""
    if value is None:
        return None
    if value.const_value is not None:
        array = value.const_value.numpy()
    elif (node := _producer(value, "Constant")) is not None:
        attr = node.attributes.get("value")
        if attr is not None:
            array = attr.as_tensor().numpy()
        elif "value_float" in node.attributes:
            array = np.array(node.attributes.get_float("value_float"))
        elif "value_int" in node.attributes:
            array = np.array(node.attributes.get_int("value_int"))
        else:
            return None
    elif (node := _producer(value, "Cast")) is not None:
        array = _constant(node.inputs[0])
        if array is not None and node.attributes.get_int("to") == int(ir.DataType.BOOL):
            array = array != 0
        return array
    else:
        return None
    return array if array.dtype == np.bool_ else np.asarray(array, dtype=np.float64)


def _perm(node: ir.Node) -> list[int] | None:
    perm = node.attributes.get_ints("perm", None)
    return list(perm) if perm is not None else None


def _keeps(cond: ir.Value) -> bool | None:
    """True where ``cond`` is true exactly for the scores a causal mask keeps (torch.tril), False
    where exactly for those it hides, None where it is not recognized."""
    flip = False
    while True:
        if (node := _producer(cond, "Cast")) is not None and node.attributes.get_int("to") == int(ir.DataType.BOOL):
            cond = node.inputs[0]
        elif (node := _producer(cond, "Not")) is not None:
            cond, flip = node.inputs[0], not flip
        else:
            break
    if (node := _producer(cond, "Trilu")) is not None:
        ones = _producer(node.inputs[0], "ConstantOfShape")
        k = _constant(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else np.zeros(())
        fill = ones.attributes.get("value") if ones is not None else None
        if (node.attributes.get_int("upper", 1) == 0 and k is not None and k.size == 1 and float(k.reshape(())) == 0
                and fill is not None and bool(np.all(fill.as_tensor().numpy() != 0))):
            return not flip
        return None
    array = _constant(cond)
    if array is None or array.ndim < 2 or array.shape[-1] != array.shape[-2]:
        return None
    tril = np.tril(np.ones(array.shape[-2:], dtype=bool))
    truth = array.astype(bool).reshape((-1, *array.shape[-2:]))
    if all((t == tril).all() for t in truth):
        return not flip
    if all((t == ~tril).all() for t in truth):
        return flip
    return None


def _only_use(value: ir.Value) -> ir.Node | None:
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 and not value.is_graph_output() else None


class _Match:
    """One attention pattern found from its Softmax (the module docstring), or the reason it is not one."""

    def __init__(self, softmax: ir.Node):
        self.nodes: list[ir.Node] = []  # the pattern's nodes, removed once the fused node replaces them
        self.ok = self._match(softmax)

    def _take(self, node: ir.Node | None) -> ir.Node | None:
        if node is not None:
            self.nodes.append(node)
        return node

    def _match(self, softmax: ir.Node) -> bool:
        if softmax.attributes.get_int("axis", -1) not in (-1, 3):
            return False
        self._take(softmax)
        widen = self._take(_producer(softmax.inputs[0], "Cast"))
        narrow = self._take(_only_use(softmax.outputs[0]))
        if widen is None or narrow is None or narrow.op_type != "Cast" or narrow.domain not in ("", "ai.onnx"):
            return False
        if widen.attributes.get_int("to") != int(ir.DataType.FLOAT) or narrow.attributes.get_int("to") not in _LOW:
            return False
        self.dtype = ir.DataType(narrow.attributes.get_int("to"))  # the heads' (the products read P in it)
        self.output = self._take(_only_use(narrow.outputs[0]))
        if self.output is None or self.output.op_type != "MatMul" or self.output.inputs[0] is not narrow.outputs[0]:
            return False
        scores = widen.inputs[0]
        if _only_use(scores) is not widen:
            return False
        self.causal = 0
        if (where := _producer(scores, "Where")) is not None:
            fills = [_constant(where.inputs[i]) for i in (1, 2)]
            hides = [f is not None and f.size > 0 and f.dtype != np.bool_ and bool(np.all(f <= _HIDDEN)) for f in fills]
            keeps = _keeps(where.inputs[0])
            if hides[0] == hides[1] or keeps is None or keeps != hides[1]:
                return False
            self.causal = 1
            scores = where.inputs[2 if hides[0] else 1]
            self._take(where)
            if _only_use(scores) is not where:
                return False
        self.scale = 1.0
        if (node := _producer(scores, "Mul", "Div")) is not None:
            factors = [_constant(v) for v in node.inputs]
            side = 1 if factors[1] is not None and factors[1].size == 1 else (
                0 if node.op_type == "Mul" and factors[0] is not None and factors[0].size == 1 else None)
            if side is not None:
                factor = float(factors[side].reshape(()))
                self.scale = factor if node.op_type == "Mul" else 1.0 / factor
                scores = node.inputs[1 - side]
                self._take(node)
                if _only_use(scores) is not node:
                    return False
        product = self._take(_producer(scores, "MatMul"))
        if product is None:
            return False
        self.q, self.kt = product.inputs
        self.v = self.output.inputs[1]
        return True


def _bshd(value: ir.Value, to_bshd: list[int], graph: ir.Graph, before: ir.Node, dtype: ir.DataType,
          taken: set[str]) -> ir.Value:
    """``value`` permuted by ``to_bshd`` into (B, S, H, D): the source of its own Transpose where the
    two permutations cancel, else one Transpose (of that source where there is one), its names not
    in ``taken``."""
    source, perm = value, to_bshd
    node = _producer(value, "Transpose")
    if node is not None and (first := _perm(node)) is not None and len(first) == 4:
        source, perm = node.inputs[0], [first[i] for i in to_bshd]
    if perm == [0, 1, 2, 3]:
        return source
    moved = ir.node("Transpose", [source], {"perm": perm}, name=fresh_name(taken, f"{value.name}/bshd"))
    moved.outputs[0].name = fresh_name(taken, f"{value.name}.bshd")
    moved.outputs[0].dtype = dtype
    graph.insert_before(before, moved)
    return moved.outputs[0]


def _remove_dead(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Remove ``nodes`` and then every producer of theirs left with no reader (the Q/K/V layout
    transposes, the mask's construction)."""
    frontier = [v.producer() for n in nodes for v in n.inputs if v is not None and v.producer() is not None]
    graph.remove(nodes, safe=True)  # detaches their inputs: the producers are taken first
    while frontier:
        node = frontier.pop()
        if node.graph is not graph or any(len(v.uses()) or v.is_graph_output() for v in node.outputs):
            continue
        frontier.extend(v.producer() for v in node.inputs if v is not None and v.producer() is not None)
        graph.remove(node, safe=True)


def fuse_attention(graph: ir.Graph) -> list[str]:
    """Replace every attention pattern of ``graph`` (the module docstring) by one Attention node;
    the names of the nodes written."""
    written = []
    taken = all_names(graph)
    for softmax in [n for n in graph if n.op_type == "Softmax" and n.domain in ("", "ai.onnx")]:
        match = _Match(softmax)
        if not match.ok:
            continue
        at = match.output
        inputs = [_bshd(value, perm, graph, at, match.dtype, taken)
                  for value, perm in ((match.q, _HEADS), (match.kt, _KEYS_T), (match.v, _HEADS))]
        name = fresh_name(taken, softmax.name.rsplit("/", 1)[0] + "/FusedAttention")
        node = ir.node(ATTENTION, inputs, {"scale": match.scale, "causal": match.causal}, domain=ATTENTION_DOMAIN,
                       num_outputs=2, name=name)
        y, lse = node.outputs
        y.dtype, lse.dtype = match.dtype, ir.DataType.FLOAT
        y.name, lse.name = fresh_name(taken, f"{name}/Y"), fresh_name(taken, f"{name}/LSE")
        graph.insert_before(at, node)
        out = at.outputs[0]
        follow = _only_use(out)
        if (follow is not None and follow.op_type == "Transpose" and _perm(follow) == _HEADS
                and not follow.outputs[0].is_graph_output()):
            follow.outputs[0].replace_all_uses_with(y)  # the layout the node already writes
            match.nodes.append(follow)
        else:
            back = ir.node("Transpose", [y], {"perm": _HEADS}, name=fresh_name(taken, f"{name}/heads"))
            back.outputs[0].name = fresh_name(taken, f"{name}/heads_output")
            back.outputs[0].dtype = match.dtype
            graph.insert_before(at, back)
            out.replace_all_uses_with(back.outputs[0], replace_graph_outputs=True)
        _remove_dead(graph, match.nodes)
        written.append(name)
    return written
