"""Elementwise fusion, the steps: what one fused node computes (elementwise_fusion.py makes the
nodes, elementwise.py runs them) and its three forms: the CUDA body of its kernel, an ONNX
function of standard ops, and a NumPy form for the CPU tests. A pure-ONNX module.

A node's ``steps`` are ``(op, refs)`` in order, a ref ``("x", i)`` the node's input i, ``("t", k)``
step k's value, ``("c", value)`` a float32 constant; step ``results[j]`` is output j. Every step
computes in float32, as onnxruntime's kernel for that node does, with the round-to-nearest
intrinsics (``__fadd_rn``...), which the compiler never contracts into an FMA, and the same CUDA
math functions (``expf``, ``erff``, ``tanhf``, ``powf``).

bfloat16 (``--precision bf16``): a chain may begin with casts of bfloat16 values up to float32
(``Cast(to=float)``, step ``WIDEN``) and end with casts of its results down (``Cast(to=bfloat16)``,
step ``ROUND``), and a node computing in bfloat16 (the attention scores' scale and causal mask) is
its op on the widened inputs, then ``ROUND``: what onnxruntime's bfloat16 kernels compute (float
arithmetic, the result rounded once). A bfloat16
input or output is passed to the kernel as its 16 raw bits (``uint16``: CuPy and NumPy have no
bfloat16); widening is exact (the bits shifted into a float's high half), rounding is to nearest
even, as onnxruntime's Cast and ``__float2bfloat16_rn`` round (a NaN stays a NaN; its payload may
differ from theirs, as a NaN's payload may between any two kernels). So the fused
chain computes exactly what the graph's casts and float32 nodes do, in one kernel where
onnxruntime runs one per cast (a bf16 GPT's step spent a fifth of its kernel time in casts).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

DOMAIN = "graph_transpiler.elementwise"
OP_TYPE = "Fused"
RELU_MASK = "ReluMask"  # the step of fuse_relu_masks's nodes
WIDEN = "WidenBf16"  # Cast(to=float) of a bfloat16 value: the value itself (inputs are widened as read)
ROUND = "RoundBf16"  # Cast(to=bfloat16): rounded to nearest even, held as the float it equals
FLOAT, BF16, BOOL = TensorProto.FLOAT, TensorProto.BFLOAT16, TensorProto.BOOL
# How a fused node's input or output of each element type is held in CuPy (which has no bfloat16:
# its raw bits), for the kernel's parameters and the in-session views of onnxruntime's buffers.
CUPY_DTYPES = {FLOAT: np.dtype(np.float32), BF16: np.dtype(np.uint16), BOOL: np.dtype(np.bool_)}

_erf = np.vectorize(math.erf, otypes=[np.float32])


def round_bf16_numpy(x: np.ndarray) -> np.ndarray:
    """float32 -> the bfloat16 nearest (ties to even) as 16 raw bits; a NaN stays a NaN (quiet, its
    payload's high bits kept: the kernel's rule, not necessarily onnxruntime's)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, ((bits >> 16) | np.uint32(0x40)).astype(np.uint16), rounded)


def widen_bf16_numpy(bits: np.ndarray) -> np.ndarray:
    """16 raw bfloat16 bits -> the float32 they equal (exact)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class _Op:
    arity: int | None  # None: variadic (Sum)
    cuda: Callable[[list[str]], str]
    numpy: Callable[[list[np.ndarray]], np.ndarray]


def _fold(fmt: str, args: list[str]) -> str:
    expr = args[0]
    for arg in args[1:]:
        expr = fmt.format(expr, arg)
    return expr


OPS: dict[str, _Op] = {
    "Add": _Op(2, lambda a: f"__fadd_rn({a[0]}, {a[1]})", lambda a: a[0] + a[1]),
    "Sub": _Op(2, lambda a: f"__fsub_rn({a[0]}, {a[1]})", lambda a: a[0] - a[1]),
    "Mul": _Op(2, lambda a: f"__fmul_rn({a[0]}, {a[1]})", lambda a: a[0] * a[1]),
    "Div": _Op(2, lambda a: f"__fdiv_rn({a[0]}, {a[1]})", lambda a: a[0] / a[1]),
    "Sum": _Op(None, lambda a: _fold("__fadd_rn({0}, {1})", a), lambda a: sum(a[1:], a[0])),
    "Neg": _Op(1, lambda a: f"(-{a[0]})", lambda a: -a[0]),
    "Abs": _Op(1, lambda a: f"fabsf({a[0]})", lambda a: np.abs(a[0])),
    "Exp": _Op(1, lambda a: f"expf({a[0]})", lambda a: np.exp(a[0])),
    "Erf": _Op(1, lambda a: f"erff({a[0]})", lambda a: _erf(a[0])),
    "Tanh": _Op(1, lambda a: f"tanhf({a[0]})", lambda a: np.tanh(a[0])),
    "Sqrt": _Op(1, lambda a: f"__fsqrt_rn({a[0]})", lambda a: np.sqrt(a[0])),
    "Reciprocal": _Op(1, lambda a: f"__fdiv_rn(1.0f, {a[0]})", lambda a: np.float32(1) / a[0]),
    "Relu": _Op(1, lambda a: f"fmaxf({a[0]}, 0.0f)", lambda a: np.maximum(a[0], np.float32(0))),
    "Pow": _Op(2, lambda a: f"powf({a[0]}, {a[1]})", lambda a: np.power(a[0], a[1])),
    "Where": _Op(3, lambda a: f"({a[0]} ? {a[1]} : {a[2]})", lambda a: np.where(a[0], a[1], a[2])),  # a[0]: bool
    # Where(Greater(y, 0), dy, 0) as one step (fuse_relu_masks): no ONNX op has this name, so no
    # graph node is ever clustered as one; nor as WIDEN or ROUND (casts become those).
    RELU_MASK: _Op(2, lambda a: f"({a[0]} > 0.0f ? {a[1]} : 0.0f)",
                   lambda a: np.where(a[0] > 0, a[1], np.float32(0))),
    WIDEN: _Op(1, lambda a: f"({a[0]})", lambda a: a[0]),
    ROUND: _Op(1, lambda a: f"gt_round_bf16({a[0]})", lambda a: widen_bf16_numpy(round_bf16_numpy(a[0]))),
}
# Device functions every fused kernel may call (ElementwiseKernel's preamble), and the other raw
# kernels that read or write bfloat16 bits: widen, round, the bits, V adjacent values widened.
PREAMBLE = r"""
__device__ __forceinline__ float gt_widen_bf16(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }
__device__ __forceinline__ float gt_round_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __uint_as_float((u | 0x00400000u) & 0xffff0000u);
    return __uint_as_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}
__device__ __forceinline__ unsigned short gt_bf16_bits(float rounded) { return (unsigned short)(__float_as_uint(rounded) >> 16); }
__device__ __forceinline__ float gt_value(unsigned short b) { return gt_widen_bf16(b); }
__device__ __forceinline__ float gt_value(float f) { return f; }
// V adjacent values from p (4: one aligned 16-byte float32 or 8-byte bfloat16 load), widened.
template <int V, typename X>
__device__ __forceinline__ void gt_load(const X* __restrict__ p, float* v) {
    if (V == 4 && sizeof(X) == 4) {
        const float4 a = *reinterpret_cast<const float4*>(p);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    } else if (V == 4) {
        const uint2 a = *reinterpret_cast<const uint2*>(p);
        v[0] = __uint_as_float(a.x << 16); v[1] = __uint_as_float(a.x & 0xffff0000u);
        v[2] = __uint_as_float(a.y << 16); v[3] = __uint_as_float(a.y & 0xffff0000u);
    } else {
        for (int k = 0; k < V; ++k) v[k] = gt_value(p[k]);
    }
}
"""


def _literal(value: float) -> str:
    """A float32 scalar in CUDA source, bit-exact."""
    bits = int(np.array(value, np.float32).view(np.uint32))
    return f"__int_as_float(0x{bits:08x})"


def cuda_statements(steps: list, results: list[int], input_types: list[int], output_types: list[int],
                    x: Callable[[int], str] = "x{}".format, t: Callable[[int], str] = "t{}".format,
                    y: Callable[[int], str] = "y{}".format) -> list[str]:
    """The CUDA statements of ``steps`` for one element: step k as the float ``t(k)``, input i read
    as ``x(i)`` (its raw bits where it is bfloat16), output j written to ``y(j)`` (raw bits likewise).
    The ElementwiseKernel body (``make_fused``'s ``code``) and each lane of the vectorized kernels
    (elementwise.py) are these statements, so the two compute the same."""
    lines = []
    for k, (op_type, refs) in enumerate(steps):
        args = [t(i) if kind == "t" else _literal(i) if kind == "c" else
                f"gt_widen_bf16({x(i)})" if input_types[i] == BF16 else x(i) for kind, i in refs]
        lines.append(f"float {t(k)} = {OPS[op_type].cuda(args)};")
    lines += [f"{y(j)} = gt_bf16_bits({t(k)});" if output_types[j] == BF16 else f"{y(j)} = {t(k)};"
              for j, k in enumerate(results)]
    return lines


def make_fused(inputs: list[str], outputs: list[str], name: str, ops: list[str], steps: list,
               results: list[int], input_types: list[int] | None = None,
               output_types: list[int] | None = None) -> onnx.NodeProto:
    """A DOMAIN node computing ``steps`` (the module docstring) with step ``results[j]`` as output
    j; ``input_types``/``output_types``: each one's ONNX dtype, FLOAT or BF16, or BOOL for a Where's
    condition (default all FLOAT).
    Attributes: ``steps``, ``results`` and the types (what the function, the NumPy form and the
    graph readers read back, ``fused_steps``), ``code`` the CUDA body over parameters ``x0..`` /
    ``y0..``, and ``ops`` the op types it stands for."""
    input_types = list(input_types or [FLOAT] * len(inputs))
    output_types = list(output_types or [FLOAT] * len(outputs))
    lines = cuda_statements(steps, results, input_types, output_types)
    return helper.make_node(OP_TYPE, inputs, outputs, name=name, domain=DOMAIN, code=" ".join(lines), ops=ops,
                            steps=json.dumps(steps), results=results, input_types=input_types,
                            output_types=output_types)


def fused_steps(node: onnx.NodeProto) -> tuple[list, list[int]]:
    """A fused node's steps and, per output, the index of the step it is (``make_fused``)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return json.loads(attrs["steps"].decode()), list(attrs["results"])


def fused_types(node: onnx.NodeProto) -> tuple[list[int], list[int]]:
    """Each input's and output's ONNX dtype (``make_fused``)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return list(attrs["input_types"]), list(attrs["output_types"])


def function(node: onnx.NodeProto, opset: int) -> onnx.FunctionProto:
    """A fused node's steps as an ONNX function of inputs ``x0..`` and outputs ``y0..``: each step one
    node of its op (the relu mask: Greater and Where; WIDEN and ROUND: their Casts), each constant a
    Constant node of its float32 value. It computes what the kernel computes, up to float32
    rounding of the math functions. As in the kernel, every step's value ``t{k}`` is float32: a
    bfloat16 input is read widened (``w{i}``), a ROUND step is the bfloat16 ``r{k}`` widened back."""
    steps, results = fused_steps(node)
    input_types, output_types = fused_types(node)
    body: list[onnx.NodeProto] = [helper.make_node("Cast", [f"x{i}"], [f"w{i}"], to=FLOAT)
                                  for i, t in enumerate(input_types) if t == BF16]
    for k, (op_type, refs) in enumerate(steps):
        args = []
        for j, (kind, value) in enumerate(refs):
            if kind == "c":
                args.append(f"c{k}_{j}")
                body.append(helper.make_node("Constant", [], [args[-1]], value_float=float(value)))
            else:
                args.append(f"w{value}" if kind == "x" and input_types[value] == BF16 else f"{kind}{value}")
        if op_type == RELU_MASK:
            body += [helper.make_node("Constant", [], [f"zero{k}"], value_float=0.0),
                     helper.make_node("Greater", [args[0], f"zero{k}"], [f"mask{k}"]),
                     helper.make_node("Where", [f"mask{k}", args[1], f"zero{k}"], [f"t{k}"])]
        elif op_type == WIDEN:
            body.append(helper.make_node("Cast", args, [f"t{k}"], to=FLOAT))
        elif op_type == ROUND:
            body += [helper.make_node("Cast", args, [f"r{k}"], to=BF16), helper.make_node("Cast", [f"r{k}"], [f"t{k}"], to=FLOAT)]
        else:
            body.append(helper.make_node(op_type, args, [f"t{k}"]))
    outputs = [f"y{j}" for j in range(len(results))]
    body += [helper.make_node("Identity", [f"r{k}" if t == BF16 else f"t{k}"], [y])
             for y, k, t in zip(outputs, results, output_types)]
    digest = hashlib.sha256(f"{len(node.input)}|{json.dumps(steps)}|{results}|{input_types}|{output_types}".encode()).hexdigest()[:12]
    return helper.make_function(DOMAIN, f"{OP_TYPE}_{digest}", [f"x{i}" for i in range(len(node.input))], outputs,
                                body, [helper.make_opsetid("", opset)])


def final_factors(node: onnx.NodeProto, output: str) -> list[str]:
    """The node's inputs that its ``output`` is the product of, where that output's last step is a
    Mul of node inputs or of earlier steps (only the inputs are returned); else none."""
    if output not in node.output:
        return []
    steps, results = fused_steps(node)
    op_type, refs = steps[results[list(node.output).index(output)]]
    if op_type != "Mul":
        return []
    return [node.input[i] for kind, i in refs if kind == "x"]


def evaluate_numpy(node: onnx.NodeProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """A fused node's outputs computed with the NumPy form of its ops (float32), for tests; a
    bfloat16 input or output is its raw bits (uint16), as the kernel takes and writes it."""
    steps, results = fused_steps(node)
    input_types, output_types = fused_types(node)
    widened = [widen_bf16_numpy(x) if t == BF16 else np.asarray(x, bool) if t == BOOL else np.asarray(x, np.float32)
               for x, t in zip(inputs, input_types)]
    values: list[np.ndarray] = []
    for op_type, refs in steps:
        args = [values[i] if kind == "t" else np.float32(i) if kind == "c" else widened[i] for kind, i in refs]
        values.append(np.asarray(OPS[op_type].numpy(args), np.float32))
    return [round_bf16_numpy(values[k]) if t == BF16 else values[k] for k, t in zip(results, output_types)]
