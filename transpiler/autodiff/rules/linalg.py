"""Matrix products."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from transpiler.autodiff._context import RuleContext, unbroadcast
from transpiler.autodiff._registry import register


def _dims(value: ir.Value) -> list[Any] | None:
    return None if value.shape is None else list(value.shape)


def _swap_last_two(ctx: RuleContext, value: ir.Value, rank: int) -> ir.Value:
    perm = [*range(rank - 2), rank - 1, rank - 2]
    return ctx.op("Transpose", [value], {"perm": perm})


def _transposed_2d(ctx: RuleContext, value: ir.Value) -> ir.Value | None:
    """``W`` when the 2-D ``value`` is the forward's ``Transpose(W)`` (how exporters write
    ``x @ W.T``): its transpose then costs no kernel. None otherwise."""
    producer = value.producer()
    if producer is not None and producer.op_type == "Transpose" and producer.domain in ("", "ai.onnx"):
        perm = producer.attributes.get_ints("perm", None)
        source = producer.inputs[0]
        if (perm is None or list(perm) == [1, 0]) and source is not None and source.shape is not None \
                and source.shape.rank() == 2:
            return source
    return None


def _rows(ctx: RuleContext, value: ir.Value, width: Any) -> ir.Value:
    """``value`` (..., width) viewed as a (rows, width) matrix: a Reshape, which copies nothing."""
    if isinstance(width, int):
        shape = ctx.const([-1, width])
    else:
        shape = ctx.op("Concat", [ctx.const([-1]), ctx.shape_of(value, -1)], {"axis": 0})
    return ctx.op("Reshape", [value, shape])


def _target_shape(ctx: RuleContext, value: ir.Value) -> ir.Value:
    """``value``'s shape as a Reshape target: a constant when at most one dim is unknown (-1 stands
    for it, e.g. a symbolic batch), else computed by Shape."""
    dims = list(value.shape)
    unknown = [i for i, d in enumerate(dims) if not isinstance(d, int)]
    if len(unknown) <= 1 and 0 not in dims:
        return ctx.const([-1 if i in unknown else d for i, d in enumerate(dims)])
    return ctx.shape_of(value)


@register("MatMul")
def _matmul(ctx: RuleContext) -> list[ir.Value | None]:
    # numpy matmul semantics: a 1-D operand is promoted to a matrix (a row for the left, a column
    # for the right) and the inserted axis is removed from the result; batch dims broadcast.
    # Differentiate the promoted product, then unbroadcast and drop the promoted axes again.
    a, b = ctx.inputs
    rank_a, rank_b = ctx.rank(a), ctx.rank(b)
    if rank_b == 2 and rank_a >= 2:
        return _matmul_by_matrix(ctx, a, b)
    a2 = a if rank_a >= 2 else ctx.op("Unsqueeze", [a, ctx.const([0])], shape=[1, *a.shape])
    b2 = b if rank_b >= 2 else ctx.op("Unsqueeze", [b, ctx.const([-1])], shape=[*b.shape, 1])

    dy_dims = _dims(ctx.output)
    restore = []
    if rank_a == 1:
        restore.append(-2)
        if dy_dims is not None:
            dy_dims.insert(len(dy_dims) - 1, 1)
    if rank_b == 1:
        restore.append(-1)
        if dy_dims is not None:
            dy_dims.append(1)
    dy = ctx.op("Unsqueeze", [ctx.dy, ctx.const(restore)], shape=dy_dims) if restore else ctx.dy
    a2_dims, b2_dims = _dims(a2), _dims(b2)

    def grad_a() -> ir.Value:
        shape = None if dy_dims is None or b2_dims is None else [*dy_dims[:-1], b2_dims[-2]]
        da = ctx.op("MatMul", [dy, _swap_last_two(ctx, b2, max(rank_b, 2))], shape=shape)
        da = unbroadcast(ctx, da, a2)
        return da if rank_a >= 2 else ctx.op("Squeeze", [da, ctx.const([0])], like=a)

    def grad_b() -> ir.Value:
        shape = None if dy_dims is None or a2_dims is None else [*dy_dims[:-2], a2_dims[-1], dy_dims[-1]]
        db = ctx.op("MatMul", [_swap_last_two(ctx, a2, max(rank_a, 2)), dy], shape=shape)
        db = unbroadcast(ctx, db, b2)
        return db if rank_b >= 2 else ctx.op("Squeeze", [db, ctx.const([-1])], like=b)

    return ctx.wanted_grads(grad_a, grad_b)


def _matmul_by_matrix(ctx: RuleContext, a: ir.Value, b: ir.Value) -> list[ir.Value | None]:
    """Y = A @ W with A (..., K) and a 2-D W (K, N): a Linear layer on (batch, time, features).

    dA = dY @ W^T: a MatMul with W itself when the forward's W is ``Transpose(W0)`` (exporters'
    ``x @ W0.T``), else one Gemm with transB=1 over the rows of dY; no transpose kernel either way,
    and onnxruntime runs each as one GEMM over the flattened rows. dW = A^T dY summed over every leading dim: the rows of A and dY
    flattened to (M, K) and (M, N) by free Reshapes and ONE Gemm with transA=1 (cuBLAS reads A
    transposed in place), instead of a batched product per leading index and a ReduceSum over them.
    """
    dy = ctx.dy
    k_dim, n_dim = list(b.shape)

    def grad_a() -> ir.Value:
        w = _transposed_2d(ctx, b)
        if w is not None:
            return ctx.op("MatMul", [dy, w], like=a)
        if ctx.rank(a) == 2:
            return ctx.op("Gemm", [dy, b], {"transB": 1}, like=a)
        # Rows of dY times W^T (transB: no transpose kernel), back to A's shape.
        rows = ctx.op("Gemm", [_rows(ctx, dy, n_dim), b], {"transB": 1})
        # allowzero: a literal 0 dim (empty batch) stays 0 rather than copying a dim of `rows`.
        return ctx.op("Reshape", [rows, _target_shape(ctx, a)], {"allowzero": 1}, like=a)

    def grad_b() -> ir.Value:
        if ctx.rank(a) == 2:
            return ctx.op("Gemm", [a, dy], {"transA": 1}, like=b)
        rows_a, rows_dy = _rows(ctx, a, k_dim), _rows(ctx, dy, n_dim)
        return ctx.op("Gemm", [rows_a, rows_dy], {"transA": 1}, like=b)

    return ctx.wanted_grads(grad_a, grad_b)


@register("Gemm")
def _gemm(ctx: RuleContext) -> list[ir.Value | None]:
    # Y = alpha * A' B' + beta * C, with A' = A^T if transA (B likewise). Each input gradient is one
    # Gemm whose trans flags absorb both the forward transposes and the transpose of the rule.
    a, b = ctx.inputs[0], ctx.inputs[1]
    attributes = ctx.node.attributes
    alpha = attributes.get_float("alpha", 1.0)
    beta = attributes.get_float("beta", 1.0)
    trans_a = attributes.get_int("transA", 0)
    trans_b = attributes.get_int("transB", 0)
    dy = ctx.dy

    def gemm(x: ir.Value, y: ir.Value, t_x: int, t_y: int, like: ir.Value) -> ir.Value:
        return ctx.op("Gemm", [x, y], {"alpha": alpha, "transA": t_x, "transB": t_y}, like=like)

    def grad_a() -> ir.Value:
        # dA' = alpha dY B'^T; with transA, dA = dA'^T = alpha B' dY^T.
        return gemm(b, dy, trans_b, 1, a) if trans_a else gemm(dy, b, 0, 1 - trans_b, a)

    def grad_b() -> ir.Value:
        # dB' = alpha A'^T dY; with transB, dB = dB'^T = alpha dY^T A'.
        return gemm(dy, a, 1, trans_a, b) if trans_b else gemm(a, dy, 1 - trans_a, 0, b)

    def grad_c() -> ir.Value:
        scaled = (
            dy if beta == 1.0 else ctx.op("Mul", [dy, ctx.scalar(beta, like=ctx.output)], like=ctx.output)
        )
        return unbroadcast(ctx, scaled, ctx.inputs[2])

    return ctx.wanted_grads(grad_a, grad_b, grad_c)


def _einsum_terms(ctx: RuleContext, equation: str, count: int) -> tuple[list[list[str]], list[str]]:
    """Subscripts of each operand and of the output, as token lists ("..." is one token)."""

    def tokens(term: str) -> list[str]:
        term = term.strip()
        out, i = [], 0
        while i < len(term):
            if term.startswith("...", i):
                out.append("...")
                i += 3
            elif term[i].isalpha():
                out.append(term[i])
                i += 1
            elif term[i].isspace():
                i += 1
            else:
                raise ctx.error(f"cannot parse equation {equation!r}")
        return out

    lhs, arrow, rhs = equation.partition("->")
    operands = [tokens(t) for t in lhs.split(",")]
    if len(operands) != count:
        raise ctx.error(f"equation {equation!r} names {len(operands)} operands, the node has {count}")
    if arrow:
        output = tokens(rhs)
    else:  # implicit output: letters used once, sorted, after the ellipsis
        letters = [t for term in operands for t in term if t != "..."]
        output = (["..."] if any("..." in t for t in operands) else []) + sorted(
            t for t in set(letters) if letters.count(t) == 1
        )
    for term in [*operands, output]:
        if len(set(term)) != len(term):
            raise ctx.error(
                f"equation {equation!r} repeats an index within one term (a trace or diagonal); "
                "only equations whose transpose is another Einsum are supported"
            )
    return operands, output


@register("Einsum")
def _einsum(ctx: RuleContext) -> list[ir.Value | None]:
    # The gradient of operand i is the Einsum of dy with the other operands, producing operand i's
    # subscripts ("swap the output and the operand"). Indices only operand i has were summed away
    # in the forward: they come back by broadcasting (Unsqueeze + Expand); broadcast ellipsis dims
    # are summed back by unbroadcast.
    equation = ctx.node.attributes.get_string("equation")
    xs = list(ctx.inputs)
    operands, output = _einsum_terms(ctx, equation, len(xs))

    def grad(i: int) -> ir.Value:
        others = [t for j, term in enumerate(operands) if j != i for t in term]
        mine = operands[i]
        lonely = [t for t in mine if t not in output and t not in others]
        if "..." in lonely:
            raise ctx.error(f"equation {equation!r}: operand {i}'s ellipsis is summed away; not supported")
        target = [t for t in mine if t not in lonely]
        terms = ["".join(output)] + ["".join(term) for j, term in enumerate(operands) if j != i]
        inputs = [ctx.dy] + [x for j, x in enumerate(xs) if j != i]
        g = ctx.op("Einsum", inputs, {"equation": ",".join(terms) + "->" + "".join(target)})
        if lonely:
            cut = mine.index("...") if "..." in mine else len(mine)
            axes = [p if p < cut else p - len(mine) for p, t in enumerate(mine) if t in lonely]
            g = ctx.op("Unsqueeze", [g, ctx.const(axes)])
            g = ctx.op("Expand", [g, ctx.shape_of(xs[i])])
        if "..." in mine:
            return unbroadcast(ctx, g, xs[i])
        return ctx.op("Identity", [g], like=xs[i]) if not lonely else g

    return ctx.wanted_grads(*(lambda i=i: grad(i) for i in range(len(xs))))
