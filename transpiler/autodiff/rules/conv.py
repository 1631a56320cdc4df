"""Convolutions and pooling, in standard ops only (plain onnxruntime has no ConvGrad/PoolGrad).

- Conv input gradient: ConvTranspose of dY with the same weight. With static spatial dims the pads
  and ``output_padding`` make it land exactly on the input shape; otherwise the full transposed
  convolution is cropped with one Pad (negative pads crop) computed at run time.
- Conv weight gradient: where it applies (group 1, 2 spatial axes, static sizes; X float32, or
  bfloat16/float16 under --precision), one ``ConvWeightGrad`` node (transpiler/conv_grad.py:
  cuDNN's backward-filter on the GPU, its function elsewhere); otherwise inline, by the per-tap
  GEMMs or a Conv whose "batch" is the input channels and whose "channels" are the batch (input
  transposed to (C/g, g*N, ...)), with dY transposed to (M, N, ...) as the kernel, strides and
  dilations swapped, then cropped to the kernel size and transposed back.
- ConvTranspose: the adjoint of the above (input gradient = Conv, weight gradient = the same
  weight-gradient Conv with input and output roles swapped).
- MaxPool: its Indices output (added when absent) + ScatterElements(reduction="add").
- AveragePool: dY scaled by 1/divisor per window, then ConvTranspose with a ones kernel on a
  (N*C, 1, ...) view; the divisor is measured on a ones image, so count_include_pad, pads and
  ceil_mode follow whatever the forward op does.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from contract.ops import CONV_GRAD_DOMAIN, CONV_WEIGHT_GRAD
from transpiler.autodiff._context import RuleContext, annotate
from transpiler.autodiff._registry import register


def _static(dims: Sequence[Any] | None) -> list[int] | None:
    if dims is None:
        return None
    dims = list(dims)
    return dims if all(isinstance(d, int) for d in dims) else None


def _spatial(value: ir.Value) -> list[int] | None:
    return None if value.shape is None else _static(list(value.shape)[2:])


def _window_attrs(ctx: RuleContext, k: int) -> tuple[list[int], list[int], list[int], str]:
    attributes = ctx.node.attributes
    strides = list(attributes.get_ints("strides", None) or [1] * k)
    dilations = list(attributes.get_ints("dilations", None) or [1] * k)
    pads = list(attributes.get_ints("pads", None) or [0] * (2 * k))
    auto_pad = attributes.get_string("auto_pad", "NOTSET") or "NOTSET"
    return strides, dilations, pads, auto_pad


def _int_vec(ctx: RuleContext, value: list[int] | ir.Value) -> ir.Value:
    return ctx.const(value) if isinstance(value, list) else value


def _resolve_pads(
    ctx: RuleContext,
    x: ir.Value,
    kernel: list[int] | None,
    kernel_value: ir.Value,
    strides: list[int],
    dilations: list[int],
    pads: list[int],
    auto_pad: str,
) -> tuple[list[int] | ir.Value, list[int] | ir.Value]:
    """(begin pads, end pads) of a forward window op: ints, or int64 vectors computed at run time
    (auto_pad SAME_* with dynamic spatial dims)."""
    k = len(strides)
    if auto_pad == "NOTSET":
        return pads[:k], pads[k:]
    if auto_pad == "VALID":
        return [0] * k, [0] * k
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        raise ctx.error(f"unknown auto_pad {auto_pad!r}")
    upper = auto_pad == "SAME_UPPER"
    ins, outs = _spatial(x), _spatial(ctx.output)
    if ins is not None and outs is not None and kernel is not None:
        totals = [
            max(0, (o - 1) * s + (kk - 1) * d + 1 - i)
            for i, o, kk, s, d in zip(ins, outs, kernel, strides, dilations)
        ]
        begin = [t // 2 if upper else t - t // 2 for t in totals]
        return begin, [t - b for t, b in zip(totals, begin)]
    # total = max(0, (out - 1) * s + (kernel - 1) * d + 1 - in), all as int64 vectors.
    one = ctx.const([1] * k)
    span = ctx.op("Add", [ctx.op("Mul", [ctx.op("Sub", [kernel_value, one]), ctx.const(dilations)]), one])
    out_len = ctx.op("Shape", [ctx.output], {"start": 2})
    reach = ctx.op("Add", [ctx.op("Mul", [ctx.op("Sub", [out_len, one]), ctx.const(strides)]), span])
    total = ctx.op("Max", [ctx.op("Sub", [reach, ctx.shape_of(x, 2)]), ctx.const([0] * k)])
    half = ctx.op("Div", [total, ctx.const([2] * k)])
    rest = ctx.op("Sub", [total, half])
    return (half, rest) if upper else (rest, half)


def _transpose_window(
    ctx: RuleContext,
    dy: ir.Value,
    w: ir.Value,
    x: ir.Value,
    out_dims: list[int] | None,
    kernel: list[int] | None,
    strides: list[int],
    dilations: list[int],
    pads: tuple[list[int] | ir.Value, list[int] | ir.Value],
    group: int,
) -> ir.Value:
    """The adjoint of a strided window op with kernel ``w``, landing on ``x``'s spatial shape."""
    attrs = {"strides": strides, "dilations": dilations, "group": group}
    begin, end = pads
    ins = _spatial(x)
    spans = None if kernel is None else [(kk - 1) * d + 1 for kk, d in zip(kernel, dilations)]
    if ins is not None and out_dims is not None and spans is not None and isinstance(begin, list):
        assert isinstance(end, list)
        extra = [
            i + b + e - sp - s * (o - 1)
            for i, b, e, sp, s, o in zip(ins, begin, end, spans, strides, out_dims)
        ]
        if all(0 <= r < s for r, s in zip(extra, strides)):
            # ConvTranspose output = s*(O-1) + output_padding + span - pads = the input size.
            return ctx.op(
                "ConvTranspose", [dy, w], {**attrs, "pads": [*begin, *end], "output_padding": extra}
            )
        # A window reaching past the padded input (ceil_mode): crop statically.
        full = ctx.op("ConvTranspose", [dy, w], attrs)
        ends = [i + b - (s * (o - 1) + sp) for i, b, s, o, sp in zip(ins, begin, strides, out_dims, spans)]
        crop = ctx.const([0, 0, *(-b for b in begin), 0, 0, *ends])
        return ctx.op("Pad", [full, crop])
    # Dynamic: the full transposed window op covers padded positions [0, L); keep [begin, begin+in).
    full = ctx.op("ConvTranspose", [dy, w], attrs)
    begin_v = _int_vec(ctx, begin)
    length = ctx.op("Shape", [full], {"start": 2})
    end_v = ctx.op("Sub", [ctx.op("Add", [ctx.shape_of(x, 2), begin_v]), length])
    zeros = ctx.const([0, 0])
    crop = ctx.op("Concat", [zeros, ctx.op("Neg", [begin_v]), zeros, end_v], {"axis": 0})
    return ctx.op("Pad", [full, crop])


@dataclass(frozen=True)
class _Window:
    """A convolution's window: strides, dilations, the pads resolved to (begin, end) per spatial
    axis (lists, or run-time values where the shapes are not static), and the group count."""

    strides: list[int]
    dilations: list[int]
    pads: tuple[list[int] | ir.Value, list[int] | ir.Value]
    group: int


def _weight_grad(ctx: RuleContext, x: ir.Value, dy: ir.Value, w: ir.Value, window: _Window) -> ir.Value:
    """dW of Y = Conv(X, W): X (N, Cin, ...), dY (N, Cout, ...), W (Cout, Cin/g, k...)."""
    if WEIGHT_GRAD == "auto" and WEIGHT_GRAD_NODE:
        node = _weight_grad_node(ctx, x, dy, w, window)
        if node is not None:
            return node
    if WEIGHT_GRAD == "gemm" or (WEIGHT_GRAD == "auto" and _output_positions(dy) >= GEMM_MIN_OUTPUT_POSITIONS):
        by_gemm = _weight_grad_by_gemm(ctx, x, dy, w, window)
        if by_gemm is not None:
            return by_gemm
    return _weight_grad_by_conv(ctx, x, dy, w, window)


# "gemm": one GEMM per kernel tap where it applies (group 1, static shapes), else "conv"; "conv":
# always the Conv over transposed tensors; "auto" (default): "gemm" where the output has at least
# GEMM_MIN_OUTPUT_POSITIONS spatial positions, else "conv". Measured on one H200 at ResNet-18 shapes
# (batch 256, TF32; benchmarks/formulations_gpu.py): per-tap GEMMs win 5x at 32x32 outputs and 2.6x
# at 16x16, tie at 8x8, and lose 2x at 4x4, where cuDNN's Conv with a 4x4 "kernel" is cheap and the
# per-tap copies of X are not. A module setting, so the benchmark can build every form.
WEIGHT_GRAD = "auto"
GEMM_MIN_OUTPUT_POSITIONS = 64
# With "auto": where it applies (group 1, two spatial axes, static pads and kernel), one
# ConvWeightGrad node (transpiler/conv_grad.py), which the GPU backend runs as cuDNN's backward-filter
# and everything else as its function (the Conv form). False: the standard-op forms above inline.
WEIGHT_GRAD_NODE = True
# X's (and dY's) element types the node is written for: those the GPU runner's cuDNN descriptors take.
NODE_DTYPES = frozenset({ir.DataType.FLOAT, ir.DataType.BFLOAT16, ir.DataType.FLOAT16})


def _weight_grad_node(ctx: RuleContext, x: ir.Value, dy: ir.Value, w: ir.Value, window: _Window) -> ir.Value | None:
    """One ``graph_transpiler.conv::ConvWeightGrad`` node, or None where it does not apply. The model
    needs its function: whoever builds the backward calls ``native_ops.add_op_functions`` on the model."""
    begin, end = window.pads
    kernel = None if w.shape is None else _static(list(w.shape)[2:])
    # The types cuDNN's backward-filter takes (runtime/gpu/conv_grad.py): float32, and bfloat16 and
    # float16 (--precision: dW in X's dtype, accumulated in float32, then the Cast rule's cast back to
    # the float32 parameter's gradient); others (double) keep the inline forms.
    if (window.group != 1 or kernel is None or len(kernel) != 2 or ctx.rank(x) != 4
            or x.dtype not in NODE_DTYPES or dy.dtype not in (None, x.dtype)):
        return None
    if not (isinstance(begin, list) and isinstance(end, list)):
        return None
    # cuDNN pads symmetrically: the node applies where padding both sides by ``begin`` gives dY's
    # size (any extra end padding would be unread rows), which needs static spatial sizes.
    ins, outs = _spatial(x), _spatial(dy)
    if ins is None or outs is None:
        return None
    for i, o, b, kk, s, d in zip(ins, outs, begin, kernel, window.strides, window.dilations):
        if (i + 2 * b - d * (kk - 1) - 1) // s + 1 != o:
            return None
    attributes = {"kernel_shape": kernel, "strides": window.strides, "dilations": window.dilations,
                  "pads": [*begin, *end]}
    (dw,) = ctx.op_multi(CONV_WEIGHT_GRAD, [x, dy], attributes, num_outputs=1, domain=CONV_GRAD_DOMAIN)
    annotate(dw, w)
    return dw


def _output_positions(dy: ir.Value) -> int:
    """Spatial positions of the output gradient (0 when not static)."""
    outs = _spatial(dy)
    return int(np.prod(outs)) if outs is not None else 0


def _weight_grad_by_gemm(ctx: RuleContext, x: ir.Value, dy: ir.Value, w: ir.Value, window: _Window) -> ir.Value | None:
    """dW[o, c, t] = sum over (n, p) of dY[n, o, p] * Xpad[n, c, p*s + t*d]: for each kernel tap t,
    one GEMM (Cout, N*P) x (N*P, Cin) of dY with the strided window of X that tap reads.

    cuBLAS runs these long-K products at full speed (split-K), where the Conv formulation makes
    cuDNN run an "fprop" whose kernel is the whole output gradient. X is transposed to
    (Cin, N, ...) and padded once, dY transposed to (Cout, N*P) once; each tap costs a strided
    Slice of X (a copy of X's size) and a Gemm with transB=1; a tap that reads exactly the unpadded
    input (a 1x1 kernel at stride 1, the centre tap of a 'same' convolution) needs no Slice. None where it does not apply (groups, dynamic spatial dims or pads): the Conv form then.
    """
    strides, dilations, group = window.strides, window.dilations, window.group
    begin, end = window.pads
    kernel = None if w.shape is None else _static(list(w.shape)[2:])
    ins, outs = _spatial(x), _spatial(dy)
    if group != 1 or kernel is None or ins is None or outs is None:
        return None
    if not (isinstance(begin, list) and isinstance(end, list)):
        return None
    k = len(strides)
    spatial = list(range(2, k + 2))
    # Padded length each tap's window must fit in: (O - 1) * s + (kernel - 1) * d + 1.
    need = [(o - 1) * s + (kk - 1) * d + 1 for o, s, kk, d in zip(outs, strides, kernel, dilations)]
    end = [max(e, n - i - b) for e, n, i, b in zip(end, need, ins, begin)]
    unpadded = ctx.op("Transpose", [x], {"perm": [1, 0, *spatial]})  # (Cin, N, D...)
    xt = unpadded
    if any(begin) or any(end):
        xt = ctx.op("Pad", [xt, ctx.const([0, 0, *begin, 0, 0, *end])])
    rows = ctx.const([0, -1])  # (C, N, ...) -> (C, N*P); 0 copies C, -1 takes the rest
    dyt = ctx.op("Reshape", [ctx.op("Transpose", [dy], {"perm": [1, 0, *spatial]}), rows])  # (Cout, N*P)
    same_size = all(s == 1 for s in strides) and list(ins) == list(outs)
    taps = []
    for tap in itertools.product(*(range(kk) for kk in kernel)):
        if same_size and all(t * d == b for t, d, b in zip(tap, dilations, begin)):
            # This tap reads exactly the unpadded input (the centre of a 'same' conv, or a 1x1).
            window = unpadded
        else:
            starts = [t * d for t, d in zip(tap, dilations)]
            ends = [st + (o - 1) * s + 1 for st, o, s in zip(starts, outs, strides)]
            window = ctx.op(
                "Slice", [xt, ctx.const(starts), ctx.const(ends), ctx.const(spatial), ctx.const(strides)]
            )
        gemm = ctx.op("Gemm", [dyt, ctx.op("Reshape", [window, rows])], {"transB": 1})  # (Cout, Cin)
        taps.append(gemm)
    if len(taps) == 1:
        return ctx.op("Reshape", [taps[0], ctx.shape_of(w)], like=w)
    last = ctx.const([2])
    stacked = ctx.op("Concat", [ctx.op("Unsqueeze", [t, last]) for t in taps], {"axis": 2})  # (Cout, Cin, taps)
    return ctx.op("Reshape", [stacked, ctx.shape_of(w)], like=w)


def _weight_grad_by_conv(ctx: RuleContext, x: ir.Value, dy: ir.Value, w: ir.Value, window: _Window) -> ir.Value:
    strides, dilations, group = window.strides, window.dilations, window.group
    k = len(strides)
    spatial = list(range(2, k + 2))
    if group == 1:
        xt = ctx.op("Transpose", [x], {"perm": [1, 0, *spatial]})  # (Cin, N, D...)
    else:
        # (N, g, Cin/g, D...) -> (Cin/g, g, N, D...) -> (Cin/g, g*N, D...)
        split = ctx.op("Concat", [ctx.const([0, group, -1]), ctx.shape_of(x, 2)], {"axis": 0})
        xt = ctx.op("Reshape", [x, split])
        xt = ctx.op("Transpose", [xt], {"perm": [2, 1, 0, *range(3, k + 3)]})
        merge = ctx.op("Concat", [ctx.const([0, -1]), ctx.shape_of(x, 2)], {"axis": 0})
        xt = ctx.op("Reshape", [xt, merge])
    dyt = ctx.op("Transpose", [dy], {"perm": [1, 0, *spatial]})  # (Cout, N, O...)
    begin, end = window.pads
    attrs: dict[str, Any] = {"strides": dilations, "dilations": strides, "group": group}
    if isinstance(begin, list) and isinstance(end, list):
        attrs["pads"] = [*begin, *end]
    else:
        zeros = ctx.const([0, 0])
        pad_vec = ctx.op("Concat", [zeros, _int_vec(ctx, begin), zeros, _int_vec(ctx, end)], {"axis": 0})
        xt = ctx.op("Pad", [xt, pad_vec])
    dwt = ctx.op("Conv", [xt, dyt], attrs)  # (Cin/g, Cout, >= k...)
    # The last window of the forward may leave input rows unread: those give extra kernel taps.
    dwt = ctx.op("Slice", [dwt, ctx.const([0] * k), ctx.shape_of(w, 2), ctx.const(spatial)])
    return ctx.op("Transpose", [dwt], {"perm": [1, 0, *spatial]}, like=w)


def _bias_grad(ctx: RuleContext, dy: ir.Value, k: int, bias: ir.Value) -> ir.Value:
    return ctx.op("ReduceSum", [dy, ctx.const([0, *range(2, k + 2)])], {"keepdims": 0}, like=bias)


@register("Conv")
def _conv(ctx: RuleContext) -> list[ir.Value | None]:
    x, w = ctx.inputs[0], ctx.inputs[1]
    k = ctx.rank(x) - 2
    strides, dilations, pads, auto_pad = _window_attrs(ctx, k)
    group = ctx.node.attributes.get_int("group", 1)
    kernel = ctx.node.attributes.get_ints("kernel_shape", None)
    kernel = list(kernel) if kernel is not None else (None if w.shape is None else _static(list(w.shape)[2:]))
    kernel_value = ctx.const(kernel) if kernel is not None else ctx.shape_of(w, 2)
    resolved = _resolve_pads(ctx, x, kernel, kernel_value, strides, dilations, pads, auto_pad)
    dy = ctx.dy
    return ctx.wanted_grads(
        lambda: _transpose_window(
            ctx, dy, w, x, _spatial(ctx.output), kernel, strides, dilations, resolved, group
        ),
        lambda: _weight_grad(ctx, x, dy, w, _Window(strides, dilations, resolved, group)),
        lambda: _bias_grad(ctx, dy, k, ctx.inputs[2]),
    )


@register("ConvTranspose")
def _conv_transpose(ctx: RuleContext) -> list[ir.Value | None]:
    # Y = ConvTranspose(X, W) is the adjoint of Conv(., W) (same strides, dilations, pads, group):
    # dX = Conv(dY, W); dW is the Conv weight gradient with dY as the input and X as the output.
    x, w = ctx.inputs[0], ctx.inputs[1]
    k = ctx.rank(x) - 2
    strides, dilations, pads, auto_pad = _window_attrs(ctx, k)
    attributes = ctx.node.attributes
    if attributes.get_ints("output_shape", None) is not None or auto_pad.startswith("SAME"):
        raise ctx.error("output_shape and auto_pad=SAME_* are not supported; export with explicit pads")
    if auto_pad == "VALID":
        pads = [0] * (2 * k)
    group = attributes.get_int("group", 1)
    resolved = (pads[:k], pads[k:])
    dy = ctx.dy
    attrs = {"strides": strides, "dilations": dilations, "group": group, "pads": pads}
    return ctx.wanted_grads(
        lambda: ctx.op("Conv", [dy, w], attrs, like=x),
        lambda: _weight_grad(ctx, dy, x, w, _Window(strides, dilations, resolved, group)),
        lambda: _bias_grad(ctx, dy, k, ctx.inputs[2]),
    )


@register("MaxPool", inputs=(0,))
def _max_pool(ctx: RuleContext) -> list[ir.Value | None]:
    x = ctx.inputs[0]
    if ctx.node.attributes.get_int("storage_order", 0) != 0:
        raise ctx.error("storage_order=1 (column-major Indices) is not supported")

    def grad() -> ir.Value:
        # Indices are flat positions in X (batch and channel included): scatter-add dY there.
        indices = ctx.forward_output(1, "indices", ir.DataType.INT64, ctx.output.shape)
        flat = ctx.const([-1])
        size = ctx.op("Reshape", [ctx.op("Size", [x]), flat])
        zero = ir.tensor(np.zeros([1], dtype=ctx.dtype(x).numpy()))
        zeros = ctx.op("ConstantOfShape", [size], {"value": zero})
        scattered = ctx.op(
            "ScatterElements",
            [zeros, ctx.op("Reshape", [indices, flat]), ctx.op("Reshape", [ctx.dy, flat])],
            {"axis": 0, "reduction": "add"},
        )
        return ctx.op("Reshape", [scattered, ctx.shape_of(x)], like=x)

    return ctx.wanted_grads(grad)


@register("AveragePool", inputs=(0,))
def _average_pool(ctx: RuleContext) -> list[ir.Value | None]:
    x, y = ctx.inputs[0], ctx.output
    k = ctx.rank(x) - 2
    strides, dilations, pads, auto_pad = _window_attrs(ctx, k)
    kernel = list(ctx.node.attributes.get_ints("kernel_shape"))
    ceil_mode = ctx.node.attributes.get_int("ceil_mode", 0)
    dtype = ctx.dtype(x).numpy()

    def grad() -> ir.Value:
        resolved = _resolve_pads(ctx, x, kernel, ctx.const(kernel), strides, dilations, pads, auto_pad)
        ones_kernel = ctx.const(np.ones([1, 1, *kernel], dtype=dtype))
        image_shape = ctx.op("Concat", [ctx.const([1, 1]), ctx.shape_of(x, 2)], {"axis": 0})
        ones = ctx.op("ConstantOfShape", [image_shape], {"value": ir.tensor(np.ones([1], dtype=dtype))})
        # Y = S(X) / D with S the window sum over real (unpadded) elements. S(ones) counts them;
        # AveragePool(ones) = S(ones) / D, so 1/D = AveragePool(ones) / S(ones) whatever the
        # divisor convention (count_include_pad, ceil_mode windows) of the forward.
        begin, end = resolved
        if ceil_mode:
            end = ctx.op("Add", [_int_vec(ctx, end), ctx.const([s - 1 for s in strides])])
        zeros = ctx.const([0, 0])
        pad_vec = ctx.op("Concat", [zeros, _int_vec(ctx, begin), zeros, _int_vec(ctx, end)], {"axis": 0})
        counted = ctx.op(
            "Conv",
            [ctx.op("Pad", [ones, pad_vec]), ones_kernel],
            {"strides": strides, "dilations": dilations},
        )
        spatial = list(range(2, k + 2))
        counted = ctx.op("Slice", [counted, ctx.const([0] * k), ctx.shape_of(y, 2), ctx.const(spatial)])
        counted = ctx.op("Max", [counted, ctx.scalar(1, like=x)])
        pool_attrs = {name: attr.value for name, attr in ctx.node.attributes.items()}
        averaged = ctx.op("AveragePool", [ones], pool_attrs)
        scale = ctx.op("Div", [averaged, counted])
        # Pool each channel separately: (N, C, O...) -> (N*C, 1, O...), one ones kernel for all.
        per_channel = ctx.op("Concat", [ctx.const([-1, 1]), ctx.shape_of(y, 2)], {"axis": 0})
        g = ctx.op("Mul", [ctx.op("Reshape", [ctx.dy, per_channel]), scale])
        dx = _transpose_window(ctx, g, ones_kernel, x, _spatial(y), kernel, strides, dilations, resolved, 1)
        return ctx.op("Reshape", [dx, ctx.shape_of(x)], like=x)

    return ctx.wanted_grads(grad)


@register("GlobalAveragePool", inputs=(0,))
def _global_average_pool(ctx: RuleContext) -> list[ir.Value | None]:
    x, y = ctx.inputs[0], ctx.output

    def grad() -> ir.Value:
        spatial = _spatial(x)
        if spatial is not None:
            count = ctx.scalar(float(np.prod(spatial)), like=y)
        else:
            ratio = ctx.op("Div", [ctx.op("Size", [x]), ctx.op("Size", [y])])
            count = ctx.op("Cast", [ratio], {"to": ctx.dtype(y)})
        return ctx.op("Expand", [ctx.op("Div", [ctx.dy, count]), ctx.shape_of(x)], like=x)

    return ctx.wanted_grads(grad)
