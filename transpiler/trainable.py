"""Which float initializers are trained, which are frozen and why; what the exporter changed.

Every float initializer the loss depends on through ops that pass a gradient is a candidate. A
candidate is **frozen** when its role or its name says it is not a parameter (docs/models.md,
"Exporting a model for training"):

- ``scalar``: a 0-d tensor. Exporters store Python scalars this way (dynamo's default export keeps
  GELU's 0.5 and 0.044715, the attention scale, RMSNorm's eps as 0-d initializers); a torch
  parameter of shape ``[]`` is rare and can be trained with ``--train``.
- ``exponent``: the exponent of a Pow (input 1), whatever its shape. Its gradient ``y*ln(x)`` is NaN
  for ``x < 0``: training ``x**3`` turns every parameter to NaN after one step.
- ``epsilon``: one element, ``0 < |v| <= 1e-3``, only ever added to a value that goes straight into a
  Sqrt (``sqrt(var + eps)`` with eps stored as shape ``[1]``). Other one-element tensors in an Add or
  Mul are parameters (linear regression's slope and intercept are shape ``[1]``).
- ``non-finite``: holds inf or NaN (a mask fill value such as ``-inf``): no update keeps it finite.
- name rules (``NAME_RULES``), on the last component of the name: rotary embeddings' ``inv_freq``
  and their precomputed ``cos``/``sin`` tables, BatchNorm's ``running_mean``/``running_var``/
  ``num_batches_tracked``, ``position_ids``, transformers' ``final_logits_bias`` buffer, and masks (``masked_bias``, ``*_mask``, or ``bias`` of
  an attention module whose values are all 0 or 1 with rank >= 2: GPT-2's ``attn.bias`` tril).

Besides: BatchNormalization's running mean and variance (inputs 3 and 4, by role) are buffers, state
updated every step (``buffer``); initializers the loss does not depend on are ``unreachable``;
``--freeze REGEX`` freezes (``freeze``) and ``--train REGEX`` trains what a rule above would freeze
(``train``). A tensor matched by both is an error.

Exporter rewrites, warned about (one line each, naming the tensors): parameters merged because they
started equal (``merged_parameters``), a tied weight split into itself and a transposed copy
(``transposed_copies``), BatchNorm folded into a convolution (``folded_batchnorm``).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from transpiler.autodiff._context import FLOAT_TYPES
from transpiler.errors import TranspileError

# code -> what it means, for the summary line and inspect (recorded in plan.json with each tensor).
REASONS = {
    "scalar": "0-d constant",
    "exponent": "Pow exponent",
    "non-finite": "holds inf/nan (a fill value)",
    "epsilon": "epsilon added before a Sqrt",
    "rotary": "rotary embedding buffer",
    "batchnorm-stat": "BatchNorm running statistic",
    "position-ids": "position ids buffer",
    "logits-bias-buffer": "logits bias buffer (transformers' final_logits_bias)",
    "mask": "attention mask buffer",
    "buffer": "BatchNorm running statistic, updated every step",
    "unreachable": "the loss does not depend on it",
    "freeze": "matches --freeze",
    "train": "matches --train",
}
# Reasons --train may override (the default rules); the others are facts about the graph.
RULE_REASONS = ("scalar", "exponent", "epsilon", "non-finite", "rotary", "batchnorm-stat", "position-ids",
                "logits-bias-buffer", "mask")

_LAST = r"(?:^|[./:_])"
NAME_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("rotary", re.compile(_LAST + r"inv_freq$")),
    ("rotary", re.compile(r"(?:^|[./:])(?:cos|sin)(?:_cached|_cache)?(?:_\d+)?$")),
    ("batchnorm-stat", re.compile(_LAST + r"(?:running_mean|running_var|num_batches_tracked)$")),
    ("position-ids", re.compile(_LAST + r"position_ids$")),
    ("mask", re.compile(r"(?:^|[./:])(?:masked_bias|\w*_mask|mask)$")),
    # transformers' BART family (BART, mBART, Pegasus, Marian, Blenderbot, PLBart) registers this
    # zeros logit bias with register_buffer: PyTorch never trains it, the exporters write it as a
    # plain initializer feeding an Add.
    ("logits-bias-buffer", re.compile(_LAST + r"final_logits_bias$")),
)
# GPT-2 registers its causal tril as ``attn.bias``: a mask only if its values say so.
_ATTENTION_BIAS = re.compile(r"(?:^|\.)(?:attn|attention|self_attn|self_attention)\.(?:bias|masked_bias)$")


@dataclass
class Selection:
    params: list[str]  # trained, in graph order
    status: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # name -> (trained|frozen|buffer, reason)

    @property
    def frozen(self) -> list[str]:
        return [n for n, (s, _) in self.status.items() if s == "frozen"]

    def counts(self) -> Counter:
        return Counter(r for s, r in self.status.values() if s != "trained")

    def summary(self) -> str:
        """One line: how many tensors are trained, how many frozen and why."""
        forced = sum(1 for s, r in self.status.values() if s == "trained" and r == "train")
        text = f"trainable: {len(self.params)} tensor(s) trained"
        if forced:
            text += f" ({forced} by --train)"
        frozen = Counter(r for s, r in self.status.values() if s == "frozen")
        text += f", {sum(frozen.values())} frozen"
        if frozen:
            text += " (" + ", ".join(f"{n} {REASONS[r]}" for r, n in frozen.most_common()) + ")"
        buffers = sum(1 for s, _ in self.status.values() if s == "buffer")
        if buffers:
            text += f", {buffers} buffer(s) ({REASONS['buffer']})"
        return text

    def to_json(self, graph: ir.Graph) -> list[dict]:
        out = []
        for name, (status, reason) in self.status.items():
            value = graph.initializers.get(name)
            shape = [int(d) if isinstance(d, int) else str(d) for d in value.shape] if value is not None and value.shape is not None else None
            out.append({"name": name, "shape": shape, "status": status, "reason": reason,
                        "why": REASONS.get(reason) if reason else None})
        return out


def _array(value: ir.Value) -> np.ndarray | None:
    const = value.const_value
    if const is None:
        return None
    try:
        return const.numpy()
    except Exception:  # an external tensor that cannot be read: no value rule applies
        return None


def rule_reason(value: ir.Value) -> str | None:
    """Why the default rules freeze this float initializer, or None (it is a parameter)."""
    name = value.name or ""
    # The most specific reason first: the role, then the name, then what the values or shape say.
    if any(use.node.op_type == "Pow" and use.idx == 1 for use in _uses_through_identity(value)):
        return "exponent"
    for reason, pattern in NAME_RULES:
        if pattern.search(name):
            return reason
    array = _array(value)
    if array is not None and array.size and not np.all(np.isfinite(array)):
        return "non-finite"
    if value.shape is not None and value.shape.rank() == 0:
        return "scalar"
    if array is not None and array.size == 1 and 0 < abs(float(array.flat[0])) <= 1e-3 and _is_epsilon(value):
        return "epsilon"
    if _ATTENTION_BIAS.search(name) and array is not None and array.ndim >= 2 and np.all((array == 0) | (array == 1)):
        return "mask"
    return None


def _is_epsilon(value: ir.Value) -> bool:
    """Every use adds it to something whose every consumer is a Sqrt: ``sqrt(var + eps)``."""
    uses = _uses_through_identity(value)
    for use in uses:
        if use.node.op_type != "Add":
            return False
        consumers = list(use.node.outputs[0].uses())
        if not consumers or any(c.node.op_type != "Sqrt" for c in consumers):
            return False
    return bool(uses)


def _uses_through_identity(value: ir.Value) -> list[ir.Usage]:
    """The uses of ``value``, following Identity nodes (TorchScript copies merged tensors with them)."""
    out, stack, seen = [], [value], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        for use in v.uses():
            if use.node.op_type == "Identity" and use.node.domain in ("", "ai.onnx"):
                stack.extend(use.node.outputs)
            else:
                out.append(use)
    return out


def _compile(option: str, pattern: str | None) -> re.Pattern[str] | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise TranspileError(f"{option} '{pattern}' is not a valid regular expression ({exc})") from None


def select(graph: ir.Graph, reachable: set[ir.Value], buffers: list[str], *, freeze: str | None = None,
           train: str | None = None, where: str = "") -> Selection:
    """Decide, for each float initializer of ``graph`` (BatchNormalization decomposed), whether it is
    trained; raise a one-line TranspileError for a --freeze/--train that matches nothing."""
    freeze_re, train_re = _compile("--freeze", freeze), _compile("--train", train)
    prefix = f"{where}: " if where else ""
    names = list(graph.initializers)
    if freeze_re and not any(freeze_re.search(n) for n in names):
        raise TranspileError(f"{prefix}--freeze '{freeze}' matches no initializer (the names look like: {', '.join(names[:5])})")
    if train_re and not any(train_re.search(n) for n in names):
        raise TranspileError(f"{prefix}--train '{train}' matches no initializer (the names look like: {', '.join(names[:5])})")
    both = [n for n in names if freeze_re and train_re and freeze_re.search(n) and train_re.search(n)]
    if both:
        raise TranspileError(f"{prefix}--freeze '{freeze}' and --train '{train}' both match {', '.join(both[:5])}"
                             f"{' ...' if len(both) > 5 else ''}; make them disjoint")
    params: list[str] = []
    status: dict[str, tuple[str, str | None]] = {}
    forced_unusable = []
    for name, value in graph.initializers.items():
        if value.dtype not in FLOAT_TYPES:
            continue
        if name in buffers:
            status[name] = ("buffer", "buffer")
            if train_re and train_re.search(name):
                forced_unusable.append(f"{name} (a BatchNorm running statistic, updated every step)")
            continue
        if value not in reachable:
            status[name] = ("frozen", "unreachable")
            if train_re and train_re.search(name):
                forced_unusable.append(f"{name} (the loss does not depend on it)")
            continue
        if freeze_re and freeze_re.search(name):
            status[name] = ("frozen", "freeze")
            continue
        reason = rule_reason(value)
        if train_re and train_re.search(name):
            status[name] = ("trained", "train" if reason else None)
            params.append(name)
        elif reason:
            status[name] = ("frozen", reason)
        else:
            status[name] = ("trained", None)
            params.append(name)
    if train_re and not any(s == "trained" and train_re.search(n) for n, (s, _) in status.items()):
        what = "; ".join(forced_unusable[:3]) or "only non-float initializers"
        raise TranspileError(f"{prefix}--train '{train}' matches nothing that can be trained: {what}")
    return Selection(params=params, status=status)


# ---------------------------------------------------------------------------------------------
# Exporter rewrites

# (op, input slots) where an initializer is a layer's own parameter. Add/Sub/Mul: a bias or a scale
# (0-d operands are constants, see above). Gather (an embedding table) is left out: embeddings are
# tied on purpose (GPT-2's wte with its LM head, T5's shared encoder/decoder embedding).
PARAMETER_SLOTS = {
    "LayerNormalization": (1, 2), "GroupNormalization": (1, 2), "InstanceNormalization": (1, 2),
    "BatchNormalization": (1, 2), "RMSNormalization": (1,), "Conv": (1, 2), "ConvTranspose": (1, 2),
    "Gemm": (0, 1, 2), "MatMul": (0, 1), "Add": (0, 1), "Sub": (0, 1), "Mul": (0, 1),
}
_COMMUTATIVE = {"Add", "Mul", "MatMul", "Gemm"}
EXPORT_SETTINGS = ("re-export with dynamo optimize=False (TorchScript: training=TrainingMode.TRAINING, "
                   "do_constant_folding=False)")
EXPORT_ADVICE = EXPORT_SETTINGS + ", or give the tensors distinct initial values"


def module_scope(node: ir.Node) -> str | None:
    """The torch module a node was exported from, where the exporter recorded it: dynamo's
    ``pkg.torch.onnx.name_scopes`` metadata, or TorchScript's node name ``/blocks.0/ln_1/Op``."""
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if scopes:
        try:
            parts = ast.literal_eval(scopes)
        except (ValueError, SyntaxError):
            parts = None
        if isinstance(parts, list) and len(parts) >= 2:
            return str(parts[-2])
    name = node.name or ""
    if name.startswith("/") and name.count("/") >= 2:
        return name.rsplit("/", 1)[0]
    return None


def merged_parameters(graph: ir.Graph, params: list[str]) -> list[str]:
    """One warning per trained tensor that feeds several layers a network would not share.

    Exporters deduplicate initializers with equal values (dynamo's default ``optimize=True``,
    TorchScript's constant folding in eval mode), so parameters that start equal (every LayerNorm
    weight at ones, every zero bias) come out as one. Reported when a tensor is a layer parameter
    (``PARAMETER_SLOTS``) of two or more nodes of the same op, its elements are all equal (a
    constant fill: independently drawn values never coincide, so a random tensor used twice is a
    real tie), and the nodes do not all come from one module (one module called twice shares its
    weights legitimately; known from the exporter's scope metadata, else assumed different).
    """
    warnings = []
    for name in params:
        value = graph.initializers[name]
        if value.shape is None or value.shape.rank() == 0:
            continue
        by_role: dict[tuple, list[ir.Node]] = {}
        for use in _uses_through_identity(value):
            slots = PARAMETER_SLOTS.get(use.node.op_type)
            if use.node.domain not in ("", "ai.onnx") or not slots or use.idx not in slots:
                continue
            role = (use.node.op_type,) if use.node.op_type in _COMMUTATIVE and use.node.op_type != "Gemm" else (use.node.op_type, use.idx)
            nodes = by_role.setdefault(role, [])
            if use.node not in nodes:
                nodes.append(use.node)
        array = None
        for role, nodes in by_role.items():
            if len(nodes) < 2:
                continue
            scopes = [module_scope(n) for n in nodes]
            if all(s is not None for s in scopes) and len(set(scopes)) == 1:
                continue
            if array is None:
                array = _array(value)
            if array is None or array.size == 0 or not np.all(array == array.flat[0]):
                continue
            where = sorted({s for s in scopes if s is not None})
            places = ", ".join(where[:6]) + (" ..." if len(where) > 6 else "") if where else \
                ", ".join(n.name or "?" for n in nodes[:6]) + (" ..." if len(nodes) > 6 else "")
            warnings.append(
                f"'{name}' (all {array.flat[0]:g}) feeds {len(nodes)} {role[0]} nodes ({places}): the exporter merged "
                f"parameters that started equal, so they would be trained as one tensor; {EXPORT_ADVICE}")
            break
    return warnings


def transposed_copies(graph: ir.Graph, params: list[str]) -> list[str]:
    """One warning per pair of trained 2-D tensors where one is exactly the other transposed.

    dynamo's default export folds ``Transpose(W)`` into a new initializer (``val_94 = W.T``), which is
    harmless for a weight used once but unties a tied one: GPT-2's ``wte`` feeds the token lookup as
    itself and the LM head as a transposed copy, and the two would be trained apart. Random values
    do not come out as each other's transpose by chance; constant fills (all elements equal) and
    symmetric matrices equal to their partner are left out, as their equality says nothing.
    """
    groups: dict[tuple, list[tuple[str, np.ndarray]]] = {}
    for name in params:
        value = graph.initializers[name]
        if value.shape is None or value.shape.rank() != 2:
            continue
        array = _array(value)
        if array is None or array.size < 2 or np.all(array == array.flat[0]):
            continue
        key = (tuple(sorted(array.shape)), float(array.max()), float(array.min()))
        groups.setdefault(key, []).append((name, array))
    warnings = []
    for members in groups.values():
        for i, (a_name, a) in enumerate(members):
            for b_name, b in members[i + 1:]:
                if a.shape == b.shape[::-1] and np.array_equal(a.T, b) and not np.array_equal(a, b):
                    warnings.append(
                        f"'{b_name}' is '{a_name}' transposed: the exporter folded a Transpose of a shared "
                        f"(tied) weight into a copy, so the two would be trained apart; {EXPORT_SETTINGS}")
    return warnings


def folded_batchnorm(graph: ir.Graph) -> list[str]:
    """A warning where BatchNormalization was visibly folded into a convolution by the exporter.

    Seen two ways, and only when the graph has no BatchNormalization left: dynamo's metadata names a
    BatchNorm module on a Conv node (``pkg.torch.onnx.class_hierarchy``), or a Conv's weight is an
    anonymous constant-folding result (TorchScript names them ``onnx::Conv_<n>``). A model exported
    without either trace cannot be told from one that never had BatchNorm.
    """
    nodes = list(graph)
    if any(n.op_type == "BatchNormalization" for n in nodes):
        return []
    folded = []
    for node in nodes:
        if node.op_type not in ("Conv", "ConvTranspose"):
            continue
        hierarchy = node.metadata_props.get("pkg.torch.onnx.class_hierarchy", "") + \
            node.metadata_props.get("namespace", "")
        weight = node.inputs[1] if len(node.inputs) > 1 else None
        if "BatchNorm" in hierarchy or "batch_norm" in hierarchy or (
                weight is not None and weight.is_initializer() and (weight.name or "").startswith("onnx::Conv")):
            folded.append(f"{node.name or '?'} (weight '{weight.name if weight is not None else '?'}')")
    if not folded:
        return []
    return [f"BatchNormalization was folded into {len(folded)} convolution(s) by the exporter: "
            f"{', '.join(folded[:4])}{' ...' if len(folded) > 4 else ''}; the trained model has no batch "
            f"statistics; {EXPORT_SETTINGS}"]
