"""docs/ops.md's index of every ONNX op, made from the gradient-rule registry and onnx's own schemas.

Every op of the default domain (its latest schema in the installed onnx) gets one row: the inputs
its rule gives a gradient to and the module holding the rule, or why it has none (marked
non-differentiable in ``rules/non_differentiable.py``; an integer, boolean or string result; no
float input; deprecated by ONNX; or not yet). The notes column comes from ``RULE_NOTES`` and
``NO_RULE_NOTES`` below, the only hand-written part.

    python -m transpiler.autodiff.ops_table            # print the section
    python -m transpiler.autodiff.ops_table --write    # rewrite it in docs/ops.md
    python -m transpiler.autodiff.ops_table --check    # exit 1 when docs/ops.md is not current

tests/test_ops_doc.py fails while docs/ops.md's section differs from what this makes, so a new
rule shows up there as soon as it is registered.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import onnx
import onnx_ir as ir
from onnx import defs

from . import rules as _rules  # noqa: F401  (importing the package registers every rule)
from ._registry import _RULES, GradientRule, non_differentiable_ops, registered_collective_ops, registered_ops

BEGIN = "<!-- ops:index:begin (written by `python -m transpiler.autodiff.ops_table --write`; do not edit) -->"
END = "<!-- ops:index:end -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "ops.md"

_FLOAT_TYPES = ("float", "double", "bfloat16")  # float16, float8*, float4* contain "float" too
_GRAPH, _GRAPHS = defs.OpSchema.AttrType.GRAPH, defs.OpSchema.AttrType.GRAPHS
_NON_DIFFERENTIABLE = defs.OpSchema.DifferentiationCategory.NonDifferentiable

# Per-op notes for the ops with a rule: attributes covered, conventions, what is rejected.
_BROADCAST = "numpy broadcasting undone by `unbroadcast`"
_FROM_OUTPUT = "derivative from the output"
_REDUCE_FLAGS = "axes, `keepdims`, `noop_with_empty_axes` as ReduceSum"
_INDICES = "any axis, negative and repeated indices"
_RECURRENT = ("every direction, `sequence_lens`, initial states, any subset of the outputs read (Y added when "
              "absent), `layout` 0/1 (onnxruntime itself runs only 0); one `Scan` over time (see below)")
RULE_NOTES: dict[str, str] = {
    "Add": _BROADCAST, "Sub": _BROADCAST, "Mul": _BROADCAST, "Div": _BROADCAST,
    "Pow": "integer exponents allowed (no gradient for them)",
    "Cast": "float to float only; the gradient cast back to the input type",
    "CastLike": "as `Cast`",
    "Relu": f"{_FROM_OUTPUT}: `Where(y > 0, dy, 0)`",
    "Tanh": _FROM_OUTPUT, "Sigmoid": _FROM_OUTPUT, "Exp": _FROM_OUTPUT, "Sqrt": _FROM_OUTPUT,
    "MatMul": "1-D operands and broadcast batch dims; a 2-D right operand: Gemm over the flattened rows (see below)",
    "Gemm": "`alpha`, `beta`, `transA`, `transB`; C optional, broadcast",
    "ReduceSum": "axes input or none; `keepdims`, `noop_with_empty_axes`",
    "ReduceMean": "axes input or none; `keepdims`, `noop_with_empty_axes`",
    "Sum": "variadic, broadcasting", "Mean": "variadic, broadcasting",
    "Einsum": "see below",
    "ReduceMax": "ties share the gradient equally (see below)",
    "ReduceMin": "ties share the gradient equally (see below)",
    "Conv": "`strides`, `pads`, `dilations`, `group`, `auto_pad` (all four), 1-D/2-D/3-D",
    "ConvTranspose": "explicit `pads`, `output_padding`, `strides`, `dilations`, `group`, `auto_pad=VALID`; "
                     "not `output_shape` or `SAME_*` (clear error)",
    "MaxPool": "Indices output added when absent; `storage_order=1` rejected",
    "AveragePool": "`pads`, `strides`, `dilations`, `count_include_pad`, `ceil_mode`, `auto_pad`",
    "LayerNormalization": "`axis`, `epsilon`; Mean/InvStdDev outputs added when absent",
    "RMSNormalization": "opset 23 (dynamo, `torch.nn.RMSNorm`); `axis`, `epsilon`; statistics recomputed in "
                        "X's precision",
    "BatchNormalization": "inference mode; fed its own batch statistics: the training-mode gradient to X, scale "
                          "and B only (see above)",
    "Dropout": "mask output added when absent; identity in inference mode or at ratio 0",
    "Softmax": "`axis` (opset >= 13 semantics); from the output",
    "LogSoftmax": "`axis` (opset >= 13 semantics); from the output",
    "Gelu": "`approximate` \"none\" and \"tanh\"",
    "Abs": "subgradient 0 at 0",
    "LeakyRelu": "`alpha`; `alpha` at 0",
    "Clip": "min/max optional; on the bounds as PyTorch's two conventions (see below): strictly inside "
            "(min < x < max) for torch's hardtanh (`nn.ReLU6`, `F.relu6`, `nn.Hardtanh`), the closed interval "
            "for `torch.clamp`",
    "Max": "variadic, broadcasting; ties share the gradient equally",
    "Min": "variadic, broadcasting; ties share the gradient equally",
    "SoftmaxCrossEntropyLoss": "`reduction` none/sum/mean, weights, `ignore_index`, the `log_prob` output "
                               "(added when absent)",
    "NegativeLogLikelihoodLoss": "`reduction` none/sum/mean, weights, `ignore_index`",
    "Gather": _INDICES, "GatherElements": _INDICES,
    "Slice": "starts/ends (constant or not), constant axes, steps incl. negative",
    "Split": "`split` input or `num_outputs`; unused outputs count as zeros",
    "Trilu": "`upper`, k",
    "Tile": "repeats constant or not",
    "Pad": "constant mode only (negative pads too); other modes rejected",
    "HardSigmoid": "as torch: the gradient strictly inside (0 < y < 1)",
    "HardSwish": "as torch: `x/3 + 1/2` on [-3, 3], 0 below, 1 above",
    "Reciprocal": "from the output (`-y^2`)",
    "InstanceNormalization": "statistics recomputed over the spatial axes (how both exporters write torch's "
                             "GroupNorm up to opset 20)",
    "GroupNormalization": "opset 21 (per-channel scale and bias); statistics recomputed on the `(N, G, -1)` view",
    "Resize": "nearest upsampling by whole factors (from the shapes, at run time where symbolic): `asymmetric` + "
              "`floor` (torch's `F.interpolate`), half-pixel modes with `round_prefer_*`; other modes rejected",
    "Attention": "opset 23; 4-D Q/K/V; bool or float `attn_mask` (a gradient for a float one), `is_causal`, "
                 "`scale`, grouped-query heads; not past key/value, `softcap`, or gradients of the extra outputs "
                 "(clear error)",
    "SplitToSequence": "the sequence's gradient is one dense tensor shaped like the split input (see below); "
                       "split sizes and axis constant",
    "SequenceAt": "of a `SplitToSequence` at a constant position: its gradient padded into the split tensor's "
                  "(see below)",
    "Elu": "`alpha`; the exponential branch at x = 0, as torch's `elu_backward`",
    "Selu": "`alpha`, `gamma`; the exponential branch at x = 0, as torch's `elu_backward`",
    "Celu": "`alpha`; the exponential branch at x = 0, as torch's `elu_backward`",
    "PRelu": "slope broadcast to X (torch's per-channel `[C, 1, 1]` too), its gradient summed back to its shape; "
             "the slope branch at x = 0, as torch",
    "Softplus": "`sigmoid(x)`",
    "Mish": "torch's `mish_backward` terms",
    "Swish": "opset 24; `alpha`",
    "ThresholdedRelu": "`alpha`",
    "Shrink": "`lambd`, `bias` (torch's hardshrink and softshrink): no gradient on [-lambd, lambd], bounds "
              "included as torch",
    "ReduceSumSquare": f"`2 x dy`; {_REDUCE_FLAGS}",
    "ReduceL1": f"`sign(x) dy`; {_REDUCE_FLAGS}",
    "ReduceL2": f"`x dy / y`, 0 where y = 0 (as torch's norm); {_REDUCE_FLAGS}",
    "ReduceLogSum": "`dy / sum(x)` (the sum recomputed, not `exp(y)`)",
    "ReduceLogSumExp": "`dy exp(x - y)`",
    "ReduceProd": "`dy y / x`, zeros handled: a group's only zero gets the product of the others, a group with two "
                  "or more zeros nothing",
    "DepthToSpace": "`blocksize`; both modes, DCR and CRD (torch's PixelShuffle): the inverse permutation",
    "SpaceToDepth": "`blocksize`: the inverse permutation",
    "GatherND": "`batch_dims`, negative and repeated index tuples (see below); the exporters' boolean-mask "
                "indexing `x[mask]` (`NonZero` -> `Transpose` -> `GatherND`)",
    "LSTM": f"{_RECURRENT}; not the peepholes `P`, `input_forget`, `clip` or non-default activations (clear error)",
    "GRU": f"`linear_before_reset` 0/1; {_RECURRENT}; not `clip` or non-default activations (clear error)",
}  # fmt: skip

# Why the ops that pass no gradient pass none: the groups of rules/non_differentiable.py.
NON_DIFFERENTIABLE_GROUPS: dict[str, tuple[str, ...]] = {
    "source or shape query": (
        "Constant", "ConstantOfShape", "Shape", "Size", "Range", "EyeLike", "RandomNormal", "RandomNormalLike",
        "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial"),
    "boolean or integer result": (
        "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN", "IsInf",
        "ArgMax", "ArgMin", "NonZero"),
    "piecewise constant (zero gradient)": ("Floor", "Ceil", "Round", "Sign", "Hardmax"),
    "encoding or bit operation": (
        "OneHot", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "NonMaxSuppression"),
}  # fmt: skip

# Notes for some ops without a rule (what the exporters write instead, what a rule would need).
_CONTROL_FLOW = "control flow: a rule would differentiate the body graph"
_QUANTIZED = "quantization: integer arithmetic"
NO_RULE_NOTES: dict[str, str] = {
    "If": _CONTROL_FLOW, "Loop": _CONTROL_FLOW, "Scan": _CONTROL_FLOW, "SequenceMap": _CONTROL_FLOW,
    "QuantizeLinear": _QUANTIZED, "DequantizeLinear": _QUANTIZED, "DynamicQuantizeLinear": _QUANTIZED,
    "QLinearMatMul": _QUANTIZED, "QLinearConv": _QUANTIZED, "ConvInteger": _QUANTIZED,
    "MatMulInteger": _QUANTIZED,
    "ConcatFromSequence": "no exporter wrote it for the zoo (torch 2.13): `stack` comes out as `Concat`",
    "SequenceConstruct": "no exporter wrote it for the zoo (torch 2.13)",
    "RotaryEmbedding": "the exporters write rotary embeddings as `Sin`/`Cos`/`Slice`/`Neg` (docs/models.md)",
    "Upsample": "a model below opset 18 is upgraded to 18 when loaded, which writes it as `Resize`",
    "Scatter": "a model below opset 18 is upgraded to 18 when loaded, which writes it as `ScatterElements`",
}  # fmt: skip


def latest_schemas() -> dict[str, defs.OpSchema]:
    """The newest schema of every default-domain op in the installed onnx, by op type."""
    latest: dict[str, defs.OpSchema] = {}
    for schema in defs.get_all_schemas_with_history():
        if schema.domain in ("", "ai.onnx") and (
            schema.name not in latest or schema.since_version > latest[schema.name].since_version
        ):
            latest[schema.name] = schema
    return latest


def _types(schema: defs.OpSchema, parameter: defs.OpSchema.FormalParameter) -> list[str]:
    constraints = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
    return constraints.get(parameter.type_str, [parameter.type_str])


def _can_be_float(schema: defs.OpSchema, parameters: Sequence[defs.OpSchema.FormalParameter]) -> bool:
    return any(f in t for p in parameters for t in _types(schema, p) for f in _FLOAT_TYPES)


def rule_module(rule: GradientRule) -> str:
    """The file under rules/ that holds ``rule`` (through the closures of ``linear`` and friends)."""
    pending: list[Callable] = [rule.compute]
    seen: set[int] = set()
    while pending:
        fn = pending.pop(0)
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        module = getattr(fn, "__module__", "") or ""
        if module.startswith(f"{_rules.__name__}."):
            return module.rsplit(".", 1)[1] + ".py"
        pending += [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if callable(c.cell_contents)]
    return "?"


def gradient_inputs(schema: defs.OpSchema, rule: GradientRule) -> str:
    """The schema's names of the inputs the rule can give a gradient to ("every input" if variadic)."""
    params = list(schema.inputs)
    variadic = bool(params) and params[-1].option == defs.OpSchema.FormalParameterOption.Variadic
    count = len(params) + (1 if variadic else 0)
    node = ir.Node("", schema.name, inputs=[ir.Value(name=f"in{i}") for i in range(count)], num_outputs=1)
    try:
        indices = sorted(set(rule.differentiable_inputs(node)))
    except Exception:  # a selector that needs a real graph: it decides per node
        return "per node"
    if variadic and indices == list(range(count)):
        return "every input"
    names = [params[min(i, len(params) - 1)].name for i in indices]
    return ", ".join(dict.fromkeys(names))


def _non_differentiable_reason(op: str, schema: defs.OpSchema | None) -> str:
    for reason, ops in NON_DIFFERENTIABLE_GROUPS.items():
        if op in ops:
            return reason
    if schema is not None and not _can_be_float(schema, schema.outputs):
        return "boolean or integer result"
    return "marked non-differentiable"


def _no_rule_reason(schema: defs.OpSchema) -> str:
    if schema.deprecated:
        return "deprecated by ONNX"
    if not _can_be_float(schema, schema.outputs):
        return "integer, boolean or string result"
    has_body = any(a.type in (_GRAPH, _GRAPHS) for a in schema.attributes.values())
    if not has_body and not _can_be_float(schema, schema.inputs):  # a body's results may be float
        return "no float input"
    return "not yet"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def index_rows() -> list[tuple[str, str, str, str]]:
    """(op, gradient, rule file, note) for every default-domain op, sorted by name."""
    schemas = latest_schemas()
    rules, silent = registered_ops(), non_differentiable_ops()
    rows = []
    for op in sorted(set(schemas) | rules | silent, key=lambda name: (name.lower(), name)):
        schema = schemas.get(op)
        if op in rules:
            rule = _RULES[op]
            into = gradient_inputs(schema, rule) if schema is not None else "per node"
            rows.append((op, f"into {into}", f"`{rule_module(rule)}`", RULE_NOTES.get(op, "")))
        elif op in silent:
            rows.append((op, f"none: {_non_differentiable_reason(op, schema)}", "`non_differentiable.py`",
                         NO_RULE_NOTES.get(op, "")))
        else:
            reason, note = _no_rule_reason(schema), NO_RULE_NOTES.get(op, "")
            if reason == "not yet" and not note and all(o.differentiation_category == _NON_DIFFERENTIABLE
                                                        for o in schema.outputs):
                note = "the ONNX spec marks its outputs non-differentiable"
            rows.append((op, f"none: {reason}", "", note))
    return rows


def index_markdown() -> str:
    """The generated section of docs/ops.md, markers included."""
    rows = index_rows()
    counts: dict[str, int] = {}
    for _, gradient, _, _ in rows:
        kind = "with a rule" if gradient.startswith("into") else gradient.removeprefix("none: ")
        counts[kind] = counts.get(kind, 0) + 1
    order = ["with a rule", *NON_DIFFERENTIABLE_GROUPS, "integer, boolean or string result", "no float input",
             "deprecated by ONNX", "not yet"]
    summary = ", ".join(f"{counts[k]} {k}" for k in [*order, *sorted(set(counts) - set(order))] if k in counts)
    not_yet = [f"`{op}`" for op, gradient, _, _ in rows if gradient == "none: not yet"]
    lines = [
        BEGIN,
        "",
        f"Every op of the default domain in onnx {onnx.__version__} (opset {defs.onnx_opset_version()}), from "
        f"`transpiler.autodiff.ops_table`: {len(rows)} ops; {summary}.",
        "",
        "| op | gradient | rule | notes |",
        "|---|---|---|---|",
        *(f"| `{op}` | {_cell(gradient)} | {rule} | {_cell(note)} |" for op, gradient, rule, note in rows),
        "",
        f"Not yet: {', '.join(not_yet)}." if not_yet else "Every op with a float input and result has a rule.",
    ]
    custom = sorted(registered_collective_ops())
    if custom:
        lines += ["", "The transpiler's own ops (custom domains) with a rule: "
                  + ", ".join(f"`{op}` (`{rule_module(_RULES[op])}`)" for op in custom) + "."]
    lines += ["", END]
    return "\n".join(lines)


def replace_section(doc_text: str, section: str) -> str:
    """``doc_text`` with its generated section (BEGIN..END) replaced by ``section``."""
    if doc_text.count(BEGIN) != 1 or doc_text.count(END) != 1:
        raise ValueError(f"docs/ops.md must hold the markers {BEGIN!r} and {END!r} once each")
    head, rest = doc_text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + section + tail


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transpiler.autodiff.ops_table", description=__doc__.split("\n")[0])
    parser.add_argument("--doc", type=Path, default=DOC, help="the markdown file holding the section (docs/ops.md)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="rewrite the section in --doc")
    group.add_argument("--check", action="store_true", help="exit 1 when the section in --doc is not current")
    args = parser.parse_args(argv)
    section = index_markdown()
    if not (args.write or args.check):
        print(section)
        return 0
    text = args.doc.read_text()
    updated = replace_section(text, section)
    if args.check:
        if updated != text:
            print(f"{args.doc}: the ops index is not current (run python -m transpiler.autodiff.ops_table --write)",
                  file=sys.stderr)
            return 1
        return 0
    if updated != text:
        args.doc.write_text(updated)
    print(f"{args.doc}: ops index written ({len(index_rows())} ops)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
