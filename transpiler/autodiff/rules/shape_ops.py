"""Ops that move elements without changing them (Reshape, Transpose, Expand, Concat, Resize,
DepthToSpace, SpaceToDepth): their gradients move the gradient back."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from transpiler.autodiff._context import RuleContext, annotate, unbroadcast
from transpiler.autodiff._registry import linear, register


@linear("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _restore_shape(ctx: RuleContext, dy: ir.Value) -> ir.Value:
    x = ctx.inputs[0]
    # allowzero=1: the target is a literal shape, so a 0 dim (empty tensor) must stay 0 rather than
    # mean "copy the input dim".
    return ctx.op("Reshape", [dy, ctx.shape_of(x)], {"allowzero": 1}, like=x)


@linear("Transpose")
def _transpose(ctx: RuleContext, dy: ir.Value) -> ir.Value:
    x = ctx.inputs[0]
    perm = ctx.node.attributes.get_ints("perm")
    if perm is not None and list(perm) == sorted(perm):
        # The identity (dynamo writes Transpose(perm=[0, 1]) after CLIP's pooling gather).
        return ctx.op("Identity", [dy], like=x)
    gemm = ctx.backward_producer(dy)
    if gemm is not None and gemm.op_type == "Gemm" and len(gemm.inputs) == 2 and ctx.rank(x) == 2:
        # Only for a swap of the two axes: the identity returned above.
        # (op(A) op(B))^T = op(B)^T op(A)^T: the weight gradient of `x @ Transpose(W)` comes out as
        # dW directly, with no transpose kernel (the trans flags are free in cuBLAS).
        attributes = gemm.attributes
        a, b = gemm.inputs
        flags = {
            "alpha": attributes.get_float("alpha", 1.0),
            "transA": 1 - attributes.get_int("transB", 0),
            "transB": 1 - attributes.get_int("transA", 0),
        }
        return ctx.op("Gemm", [b, a], flags, like=x)
    if perm is None:
        # The default perm reverses the axes, and reversing is its own inverse.
        return ctx.op("Transpose", [dy], like=x)
    inverse = np.argsort(perm).tolist()
    return ctx.op("Transpose", [dy], {"perm": inverse}, like=x)


@linear("Expand")
def _expand(ctx: RuleContext, dy: ir.Value) -> ir.Value:
    # Expand broadcasts x against the shape input, so its transpose is summing back to x's shape.
    return unbroadcast(ctx, dy, ctx.inputs[0])


@register("Concat")
def _concat(ctx: RuleContext) -> list[ir.Value | None]:
    # Split dy along the axis into pieces as long as each input is along it.
    inputs = ctx.inputs
    axis = ctx.node.attributes.get_int("axis")
    if axis is None:
        raise ctx.error("Concat has no 'axis' attribute")
    axis %= ctx.rank(inputs[0])
    lengths = [None if x.shape is None else x.shape[axis] for x in inputs]
    if all(isinstance(n, int) for n in lengths):
        split = ctx.const(lengths)
    else:
        split = ctx.op("Concat", [ctx.shape_of(x, axis, axis + 1) for x in inputs], {"axis": 0})
    pieces = ctx.op_multi("Split", [ctx.dy, split], {"axis": axis}, num_outputs=len(inputs))
    for piece, x in zip(pieces, inputs):
        annotate(piece, x)
    return ctx.wanted_grads(*(lambda piece=piece: piece for piece in pieces))


# Nearest-neighbour Resize by integer factors copies each input element into an s0 x s1 x ... block
# for these coordinate modes: asymmetric with floor (torch's F.interpolate(mode="nearest")), and the
# half-pixel modes with either rounding (x_in = (i + 1/2)/s - 1/2 never lands on a .5 tie).
_BLOCK_NEAREST = {
    ("asymmetric", "floor"),
    ("half_pixel", "round_prefer_floor"),
    ("half_pixel", "round_prefer_ceil"),
    ("pytorch_half_pixel", "round_prefer_floor"),
    ("pytorch_half_pixel", "round_prefer_ceil"),
}


@register("Resize", inputs=(0,))
def _resize(ctx: RuleContext) -> list[ir.Value | None]:
    # dx sums each block of dy: dy viewed as (d0, s0, d1, s1, ...) and summed over the s axes. The
    # factors s = output dims / input dims come from the shapes (exporters write scales or sizes,
    # as constants or not), at run time where a dim is symbolic; nearest mode, whole factors.
    x, y = ctx.inputs[0], ctx.output
    attributes = ctx.node.attributes
    mode = attributes.get_string("mode", "nearest")
    coordinates = attributes.get_string("coordinate_transformation_mode", "half_pixel")
    rounding = attributes.get_string("nearest_mode", "round_prefer_floor")
    if mode != "nearest" or (coordinates, rounding) not in _BLOCK_NEAREST:
        raise ctx.error(f"only nearest upsampling by whole factors is supported (mode={mode}, "
                        f"coordinate_transformation_mode={coordinates}, nearest_mode={rounding})")
    rank = ctx.rank(x)
    dims_in = list(x.shape)
    dims_out = list(y.shape) if y.shape is not None else [None] * rank
    static = all(isinstance(d, int) for d in dims_in + dims_out)
    for d_in, d_out in zip(dims_in, dims_out):
        if isinstance(d_in, int) and isinstance(d_out, int) and (d_in == 0 or d_out % d_in):
            raise ctx.error(f"only upsampling by whole factors is supported ({dims_in} -> {dims_out})")

    def grad() -> ir.Value:
        odd = ctx.const(list(range(1, 2 * rank, 2)))
        if static:
            target = ctx.const([d for d_in, d_out in zip(dims_in, dims_out) for d in (d_in, d_out // d_in)])
        else:
            shape_in, shape_out = ctx.shape_of(x), ctx.op("Shape", [y])
            factors = ctx.op("Div", [shape_out, shape_in])
            last = ctx.const([1])
            pairs = ctx.op("Concat", [ctx.op("Unsqueeze", [shape_in, last]), ctx.op("Unsqueeze", [factors, last])],
                           {"axis": 1})
            target = ctx.op("Reshape", [pairs, ctx.const([-1])])
        blocks = ctx.op("Reshape", [ctx.dy, target])
        return ctx.op("ReduceSum", [blocks, odd], {"keepdims": 0}, like=x)

    return ctx.wanted_grads(grad)


@linear("DepthToSpace")
def _depth_to_space(ctx: RuleContext, dy: ir.Value) -> ir.Value:
    # A permutation of the elements, so the gradient is the inverse permutation. DCR mode:
    # y[n, c, h*b + i, w*b + j] = x[n, (i*b + j)*C' + c, h, w], undone by SpaceToDepth. CRD mode
    # (torch's PixelShuffle): x[n, c*b*b + i*b + j, h, w]; dy viewed as (N, C', H, b, W, b), the two
    # block axes moved next to the channel, viewed as x.
    x = ctx.inputs[0]
    block = ctx.node.attributes.get_int("blocksize")
    if block is None:
        raise ctx.error("DepthToSpace has no 'blocksize' attribute")
    if ctx.node.attributes.get_string("mode", "DCR") == "DCR":
        return ctx.op("SpaceToDepth", [dy], {"blocksize": block}, like=x)
    b = ctx.const([block])
    view = ctx.op("Concat", [ctx.shape_of(x, 0, 1), ctx.const([-1]), ctx.shape_of(x, 2, 3), b, ctx.shape_of(x, 3, 4), b],
                  {"axis": 0})
    blocks = ctx.op("Transpose", [ctx.op("Reshape", [dy, view])], {"perm": [0, 1, 3, 5, 2, 4]})
    return ctx.op("Reshape", [blocks, ctx.shape_of(x)], like=x)


@linear("SpaceToDepth")
def _space_to_depth(ctx: RuleContext, dy: ir.Value) -> ir.Value:
    # The inverse of DepthToSpace in DCR mode (see above).
    block = ctx.node.attributes.get_int("blocksize")
    if block is None:
        raise ctx.error("SpaceToDepth has no 'blocksize' attribute")
    return ctx.op("DepthToSpace", [dy], {"blocksize": block, "mode": "DCR"}, like=ctx.inputs[0])
