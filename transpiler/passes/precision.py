"""PrecisionPass: the forward rewritten for mixed precision (--precision bf16|fp16), before autodiff.

torch.autocast's rule on an ONNX graph (docs/precision.md), node by node in graph order:

- LOWER (``LOWER_OPS``: MatMul, Gemm, Conv, ConvTranspose, Einsum, Attention, PRelu: torch's CUDA
  lower-precision list) read their float inputs cast to the low dtype and compute in it;
- FP32 (``FP32_OPS``: softmax, the normalizations and their statistics, reductions, exp/log/pow
  and friends, the losses: torch's CUDA fp32 list) read float32; so does every node outside the
  default domain (BatchNormTraining, collectives);
- every other op follows its inputs, as torch's type promotion does: where the inputs that share
  its type parameter are all low precision it computes in low precision (0-d values and
  one-element constants join them, as Python scalars do in torch); where a low and a float32
  tensor meet (a bias added to a matrix product's output), the low one is cast up and the op stays
  float32.

A cast is made once per (value, dtype), right before the value's first reader that needs it, and
shared by all its readers; a low value that was cast up is given back as itself where a low one
is wanted again; a value that only moves a float32 one (a weight's Transpose) and is read by
LOWER ops only is not cast itself: the value it moves is, and the move runs in low precision. Parameters stay float32 graph inputs: their low copies are these casts, so
autodiff's Cast rule casts their gradients back to float32 (the master weights and the optimizer
never see the low dtype). The loss is computed by FP32 ops, so it and its gradient are float32.

Conv, ConvTranspose and the pools take bfloat16 from opset 22 on: a bf16 graph holding a Conv is
raised to opset 22 where nothing in it changed meaning between its opset and 22 (else its Convs stay
float32, said in the report). Einsum has no bfloat16 in any opset: with bf16 it stays float32.

fp16 also gets dynamic loss scaling: the forward multiplies the loss by the scale (state
``LOSS_SCALE_STATE``, zero on the first step meaning ``init_scale``) and the backward
differentiates that product (``Job.differentiated``); the step graph unscales, checks and skips
(transpiler/rank_step.py).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx.defs
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from transpiler.autodiff._context import fresh_name
from transpiler.errors import TranspileError
from transpiler.job import (
    DTYPES,
    GROWTH_TRACKER_STATE,
    LOSS_SCALE_CURRENT,
    LOSS_SCALE_STATE,
    SKIPPED_OUTPUT,
    Job,
)
from transpiler.native_ops import FUNCTIONS, add_op_functions

__all__ = ["FP32_OPS", "GROWTH_TRACKER_STATE", "LOSS_SCALE_CURRENT", "LOSS_SCALE_STATE", "LOWER_OPS",
           "PrecisionPass", "SKIPPED_OUTPUT", "autocast", "precision_json"]

FLOAT = ir.DataType.FLOAT

# torch.autocast's CUDA lower-precision list, as ONNX ops (torch: matmul, mm, bmm, linear, addmm,
# baddbmm, conv*, conv_transpose*, einsum via bmm, prelu, scaled_dot_product_attention).
LOWER_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention", "PRelu"})
# torch.autocast's CUDA float32 list, as ONNX ops (softmax, log_softmax, layer_norm, group_norm,
# norm, sum, prod, cumsum, exp, log, pow, reciprocal, rsqrt, softplus, the losses, ...), plus every
# reduction and BatchNorm's statistics (docs/precision.md).
FP32_OPS = frozenset({
    "Softmax", "LogSoftmax", "Hardmax",
    "LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization", "GroupNormalization",
    "InstanceNormalization", "BatchNormalization", "LpNormalization", "MeanVarianceNormalization",
    "ReduceSum", "ReduceMean", "ReduceProd", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "CumSum", "LpPool",
    "Exp", "Log", "Pow", "Reciprocal", "Softplus", "Tan", "Sinh", "Cosh", "Asin", "Acos", "Acosh", "Asinh", "Atanh",
    "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
})
# BatchNorm as torch runs it under autocast (CPU and CUDA: batch_norm is on neither list; its kernels
# take a low-precision input with float32 parameters): statistics and normalization in float32, the
# output Y rounded back to the input's dtype. Here: the input cast up, Y cast down after the node.
LOW_OUTPUT_NORMS = frozenset({("", "BatchNormalization"), ("graph_transpiler.batchnorm", "BatchNormTraining")})
# Ops that only move the elements of their input 0 (the others are shapes, axes, permutations).
_MOVES = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
# Ops whose meaning changed between opset 18 and 22: a graph holding one is not raised to opset 22.
_CHANGED_BY_22 = frozenset({"GroupNormalization", "DFT"})
_BF16_OPSET = 22

_RESERVED = (LOSS_SCALE_STATE, GROWTH_TRACKER_STATE, LOSS_SCALE_CURRENT, SKIPPED_OUTPUT)


class PrecisionPass(InPlacePass):
    """Rewrite every variant's forward (``job.variants``) for ``--precision``; nothing for fp32."""

    def __init__(self, job: Job):
        super().__init__()
        self.job = job

    def call(self, model: ir.Model) -> PassResult:
        options = self.job.options
        if options.precision == "fp32":
            return PassResult(model, modified=False)
        low = DTYPES[options.precision]
        for key, variant, _ in self.job.distinct_variants():
            _check_free(variant.graph)
            report = autocast(variant, low, set(self.job.problem.params))
            if options.loss_scaling is not None:
                self.job.differentiated = _scale_loss(variant.graph, self.job.problem.loss, options.loss_scaling.init_scale)
            self.job.precision_report.setdefault(key, report)
        return PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        """Every default-domain node is well typed: no type parameter holds float32 and the low dtype."""
        precision = self.job.options.precision
        if precision == "fp32":
            return
        for variant, _ in self.job.variants.values():
            opset = variant.graph.opset_imports.get("", 18)
            for node in variant.graph:
                if node.op_type in ("Cast", "CastLike") or node.domain not in ("", "ai.onnx"):
                    continue
                floats = {v.dtype for v in (*node.inputs, *node.outputs) if v is not None and v.dtype in _FLOATS}
                if len(floats) > 1 and _mixing_forbidden(node, opset):
                    raise PostconditionError(f"node '{node.name}' ({node.op_type}) mixes float32 and {precision} "
                                             "in one type parameter")


_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.BFLOAT16, ir.DataType.FLOAT16})


def precision_json(job: Job) -> dict | None:
    """plan.json's ``precision`` section (contract/plan.py), or None for fp32 everywhere."""
    options = job.options
    if options.precision == "fp32" and options.grad_dtype == "fp32":
        return None
    out: dict = {"compute": options.precision, "grad_dtype": options.grad_dtype,
                 "master_weights": "fp32", "optimizer_state": "fp32"}
    report = job.precision_report.get("ranks") or job.precision_report.get("single")
    if report:
        out["rewrite"] = report
    scaling = options.loss_scaling
    if scaling is not None:
        out["loss_scaling"] = {**scaling.to_json(), "scale_state": LOSS_SCALE_STATE,
                               "growth_tracker_state": GROWTH_TRACKER_STATE, "skipped_output": SKIPPED_OUTPUT}
    return out


# ---------------------------------------------------------------------------------------------
# The rewrite


def _schema(node: ir.Node, opset: int):
    if node.domain not in ("", "ai.onnx"):
        return None
    try:
        return onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return None


def _type_params(schema, node: ir.Node) -> tuple[list[str | None], list[str | None], dict[str, list[str]]]:
    """The formal type parameter of each input and output of ``node`` (None past the schema), and
    each parameter's allowed types."""
    def formal(params, index):
        if not params:
            return None
        if index < len(params):
            return params[index].type_str
        last = params[-1]
        return last.type_str if last.option == onnx.defs.OpSchema.FormalParameterOption.Variadic else None

    allowed = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
    return ([formal(schema.inputs, i) for i in range(len(node.inputs))],
            [formal(schema.outputs, i) for i in range(len(node.outputs))], allowed)


def _allows(schema, param: str, dtype: ir.DataType, allowed: dict[str, list[str]]) -> bool:
    name = {ir.DataType.BFLOAT16: "tensor(bfloat16)", ir.DataType.FLOAT16: "tensor(float16)",
            ir.DataType.FLOAT: "tensor(float)"}[dtype]
    return name in allowed.get(param, [param])


def _mixing_forbidden(node: ir.Node, opset: int) -> bool:
    """Whether two inputs/outputs of one type parameter hold float32 and the low dtype."""
    schema = _schema(node, opset)
    if schema is None:
        return False
    ins, outs, _ = _type_params(schema, node)
    by_param: dict[str, set] = {}
    for param, value in (*zip(ins, node.inputs), *zip(outs, node.outputs)):
        if param is not None and value is not None and value.dtype in _FLOATS:
            by_param.setdefault(param, set()).add(value.dtype)
    return any(len(dtypes) > 1 for dtypes in by_param.values())


class _Casts:
    """Casts made once per (value, dtype), shared by every reader; an up-cast low value is given back
    as itself where the low dtype is wanted again."""

    def __init__(self, graph: ir.Graph, opset: int):
        self.graph = graph
        self.opset = opset
        self.made: dict[tuple[ir.Value, ir.DataType], ir.Value] = {}
        self.origin: dict[ir.Value, ir.Value] = {}  # up-cast output -> the low value it came from
        self.names = {v.name for v in graph.inputs} | set(graph.initializers)
        self.names |= {o.name for n in graph for o in n.outputs} | {n.name for n in graph}
        self.count = 0

    def unique(self, base: str) -> str:
        return fresh_name(self.names, base)

    def to(self, value: ir.Value, dtype: ir.DataType, before: ir.Node) -> ir.Value:
        if value.dtype == dtype:
            return value
        source = self.origin.get(value)
        if source is not None and source.dtype == dtype:
            return source
        key = (value, dtype)
        if key not in self.made and dtype != FLOAT and self._hoist(value, dtype):
            self.made[key] = value
        if key not in self.made:
            label = {ir.DataType.BFLOAT16: "bf16", ir.DataType.FLOAT16: "fp16", FLOAT: "fp32"}[dtype]
            node = ir.node("Cast", [value], {"to": dtype}, name=self.unique(f"{value.name}/autocast_{label}"))
            out = node.outputs[0]
            out.name = self.unique(f"{value.name}.{label}")
            out.dtype = dtype
            out.shape = ir.Shape(value.shape) if value.shape is not None else None
            self.graph.insert_before(before, node)
            self.made[key] = out
            self.count += 1
            if dtype == FLOAT:
                self.origin[out] = value
        return self.made[key]


    def _hoist(self, value: ir.Value, dtype: ir.DataType) -> bool:
        """Where ``value`` only moves elements of one float32 value (a weight's Transpose: the
        TorchScript exporter's MatMul(x, Transpose(W)); an attention's query, Reshape then
        Transpose of a Linear's output) and only LOWER ops read it, directly or through more
        moves, cast that value instead and let the moves run in ``dtype``: the same numbers (the
        cast is per element), half the bytes moved, and the gradient leaves the backward as a cast
        of a low-precision value (sent as it is with --grad-dtype). Where the cast sits after the
        moves instead, it is a pass of its own over the activation on the GPU (GPT-2-small: 36 a
        step), and the backward casts the gradient up and down again around the moves."""
        producer = value.producer()
        if (producer is None or producer.op_type not in _MOVES or producer.domain not in ("", "ai.onnx")
                or len(producer.outputs) != 1 or producer.inputs[0] is None or producer.inputs[0].dtype != FLOAT
                or not self._low_readers(value, dtype)):
            return False
        producer.replace_input_with(0, self.to(producer.inputs[0], dtype, producer))
        value.dtype = dtype
        return True

    def _low_readers(self, value: ir.Value, dtype: ir.DataType) -> bool:
        """Whether every reader of ``value`` is a LOWER op that takes ``dtype``, or a move of it
        (as its input 0) whose own readers are all so; never a graph output on the way."""
        uses = list(value.uses())
        if not uses or value.is_graph_output():
            return False
        for use in uses:
            node = use.node
            if node.domain not in ("", "ai.onnx"):
                return False
            if node.op_type in _MOVES and use.idx == 0 and len(node.outputs) == 1:
                if not self._low_readers(node.outputs[0], dtype):
                    return False
            elif node.op_type not in LOWER_OPS or not _takes(node.op_type, self.opset, dtype):
                return False
        return True

    def after(self, value: ir.Value, dtype: ir.DataType, producer: ir.Node) -> ir.Value:
        """Every reader of ``value`` (a float32 output of ``producer``) reads it cast to ``dtype``."""
        uses = list(value.uses())
        label = {ir.DataType.BFLOAT16: "bf16", ir.DataType.FLOAT16: "fp16"}[dtype]
        node = ir.node("Cast", [value], {"to": dtype}, name=self.unique(f"{value.name}/autocast_{label}"))
        out = node.outputs[0]
        out.name = self.unique(f"{value.name}.{label}")
        out.dtype, out.shape = dtype, ir.Shape(value.shape) if value.shape is not None else None
        self.graph.insert_after(producer, node)
        self.count += 1
        for use in uses:
            use.node.replace_input_with(use.idx, out)
        return out


def _scalar(value: ir.Value, params: set[str]) -> bool:
    """A value that does not decide the dtype of an op it meets (torch: a 0-d tensor or Python
    number beside a dimensioned tensor): 0-d, or a one-element constant that is not trained."""
    shape = value.shape
    if shape is not None and shape.rank() == 0:
        return True
    if value.name in params or shape is None or not all(isinstance(d, int) for d in shape):
        return False
    producer = value.producer()
    constant = value.is_initializer() or (producer is not None and producer.op_type == "Constant")
    return constant and int(np.prod(shape.numpy(), dtype=np.int64)) == 1


def autocast(model: ir.Model, low: ir.DataType, params: set[str]) -> dict:
    """Rewrite ``model``'s graph in place (the module docstring); return what was done."""
    graph = model.graph
    opset, opset_note = _raise_opset(model, low)
    casts = _Casts(graph, opset)
    ops: dict[str, Counter] = {"low": Counter(), "fp32": Counter(), "low_output": Counter()}
    for node in list(graph):
        if node.op_type in ("Cast", "CastLike", "Constant") and node.domain in ("", "ai.onnx"):
            if node.op_type == "CastLike" and node.inputs[1] is not None and node.inputs[1].dtype is not None:
                node.outputs[0].dtype = node.inputs[1].dtype  # its target may have become low precision
            continue
        schema = _schema(node, opset)
        floats = [(i, v) for i, v in enumerate(node.inputs) if v is not None and v.dtype in (FLOAT, low)]
        if schema is None or node.op_type in FP32_OPS:
            # float32 op (or one we know nothing of: outside the default domain): low inputs cast up.
            low_input = bool(floats) and floats[0][0] == 0 and floats[0][1].dtype == low
            for i, value in floats:
                if value.dtype == low:
                    node.replace_input_with(i, casts.to(value, FLOAT, node))
            if low_input and (node.domain if node.domain != "ai.onnx" else "", node.op_type) in LOW_OUTPUT_NORMS:
                casts.after(node.outputs[0], low, node)
                ops["low_output"][node.op_type] += 1
            elif floats:
                ops["fp32"][node.op_type] += 1
            continue
        ins, outs, allowed = _type_params(schema, node)
        groups: dict[str, list[int]] = {}
        for i, _ in floats:
            if ins[i] is not None:
                groups.setdefault(ins[i], []).append(i)
        ran_low = False
        for param, indices in groups.items():
            values = [node.inputs[i] for i in indices]
            if node.op_type in LOWER_OPS and node.domain in ("", "ai.onnx"):
                use_low = _allows(schema, param, low, allowed)
            else:
                deciding = [v for v in values if not _scalar(v, params)] or values
                use_low = all(v.dtype == low for v in deciding) and _allows(schema, param, low, allowed)
            if not use_low and all(v.dtype == FLOAT for v in values):
                continue
            target = low if use_low else FLOAT
            for i in indices:
                node.replace_input_with(i, casts.to(node.inputs[i], target, node))
            for out, out_param in zip(node.outputs, outs):
                if out_param == param and out.dtype in (FLOAT, low):
                    out.dtype = target
            ran_low |= use_low
        if groups:
            ops["low" if ran_low else "fp32"][node.op_type] += 1
    return {"dtype": {ir.DataType.BFLOAT16: "bf16", ir.DataType.FLOAT16: "fp16"}[low], "opset": opset,
            **({"note": opset_note} if opset_note else {}),
            "low_precision_ops": dict(sorted(ops["low"].items())), "fp32_ops": dict(sorted(ops["fp32"].items())),
            "fp32_ops_with_low_output": dict(sorted(ops["low_output"].items())),
            "casts": casts.count}


def _raise_opset(model: ir.Model, low: ir.DataType) -> tuple[int, str | None]:
    """The default-domain opset the rewrite uses: raised to 22 where a LOWER op takes the low dtype
    only from there (bf16 Conv) and nothing in the graph changed meaning on the way."""
    graph = model.graph
    opset = graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 18))
    if opset >= _BF16_OPSET:
        return opset, None
    wanting = sorted({n.op_type for n in graph if n.op_type in LOWER_OPS and n.domain in ("", "ai.onnx")
                      and not _takes(n.op_type, opset, low) and _takes(n.op_type, _BF16_OPSET, low)})
    if not wanting:
        return opset, None
    blockers = sorted({n.op_type for n in graph if n.op_type in _CHANGED_BY_22 and n.domain in ("", "ai.onnx")})
    if blockers:
        return opset, (f"{', '.join(wanting)} stay float32: they take {low.name.lower()} from opset {_BF16_OPSET}, "
                       f"and {', '.join(blockers)} changed meaning between opset {opset} and {_BF16_OPSET}")
    graph.opset_imports[""] = _BF16_OPSET
    graph.opset_imports.pop("ai.onnx", None)
    # The model-local functions of the transpiler's own ops are built for the model's opset: again.
    for key in [k for k in model.functions if (k[0], k[1]) in FUNCTIONS]:
        del model.functions[key]
    add_op_functions(model)
    return _BF16_OPSET, f"opset raised from {opset} to {_BF16_OPSET} ({', '.join(wanting)} take bfloat16 from there)"


def _takes(op_type: str, opset: int, dtype: ir.DataType) -> bool:
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return False
    name = {ir.DataType.BFLOAT16: "tensor(bfloat16)", ir.DataType.FLOAT16: "tensor(float16)"}[dtype]
    param = schema.outputs[0].type_str
    return any(c.type_param_str == param and name in c.allowed_type_strs for c in schema.type_constraints)


# ---------------------------------------------------------------------------------------------
# fp16: the loss times the loss scale


def _check_free(graph: ir.Graph) -> None:
    names = {v.name for v in graph.inputs} | set(graph.initializers) | {o.name for n in graph for o in n.outputs}
    taken = [n for n in _RESERVED if n in names]
    if taken:
        raise TranspileError(f"the model has a value named {taken[0]!r}, a name --precision gives to the training "
                             "graph's loss scaling; rename it in the model")


def _scale_loss(graph: ir.Graph, loss_name: str, init_scale: float) -> str:
    """Append ``loss * scale`` (scale: the state input, 0 meaning ``init_scale``) as a graph output;
    return its name, the value the backward differentiates."""
    loss = next(v for v in graph.outputs if v.name == loss_name)
    state = ir.val(LOSS_SCALE_STATE, FLOAT, ir.Shape([]))
    graph.inputs.append(state)

    def constant(number: float, name: str) -> ir.Value:
        node = ir.node("Constant", [], {"value": ir.tensor(np.array(number, dtype=np.float32))}, name=f"amp/{name}")
        graph.append(node)
        out = node.outputs[0]
        out.name, out.dtype, out.shape = f"amp.{name}", FLOAT, ir.Shape([])
        return out

    def op(op_type: str, inputs: list[ir.Value], name: str, dtype: ir.DataType = FLOAT) -> ir.Value:
        node = ir.node(op_type, inputs, name=f"amp/{op_type}_{name}")
        graph.append(node)
        out = node.outputs[0]
        out.name, out.dtype, out.shape = name, dtype, ir.Shape([])
        return out

    first = op("Equal", [state, constant(0.0, "zero")], "amp.first_step", ir.DataType.BOOL)
    current = op("Where", [first, constant(init_scale, "init_scale"), state], LOSS_SCALE_CURRENT)
    scaled = op("Mul", [loss, current], f"{loss_name}.scaled")
    graph.outputs.append(scaled)
    return scaled.name
