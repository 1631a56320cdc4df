"""LSTM and GRU: gradients for X, W, R, B and the initial states (rules/recurrent.py explains the
Scan over time and what is computed outside it).

Covered: every direction (forward, reverse, bidirectional), ``layout`` 0 and 1, ``sequence_lens``,
initial states given or not, GRU's ``linear_before_reset`` 0 and 1, and any subset of the outputs
read (dynamo reads Y only of an LSTM, Y_h only of a GRU). Stacked layers are one node each, as both
exporters write them. Not covered (a clear error): LSTM's peepholes ``P`` and ``input_forget``,
``clip``, and activations other than the defaults, which PyTorch never exports.

LSTM (ONNX gate order i, o, f, c; ``g`` is the cell candidate):
    c_t = f c_{t-1} + i g,  h_t = o tanh(c_t)
    backward step:  dh = dh_carry + dY_t,  dc = dc_carry + dh * o (1 - tanh(c_t)^2)
                    d(i, o, f, g pre-activations) = (dc, dh, dc, dc) * K_t
                    dh_carry' = d(gates) @ R,  dc_carry' = dc * f
    with K_t = (g i(1-i), tanh(c_t) o(1-o), c_{t-1} f(1-f), i (1-g^2)) computed for all t at once.
    The cell states c_t are not a forward output: a forward Scan of ``c = f c + i g`` (two
    elementwise ops a step) recomputes them from the recomputed gates.
GRU (gate order z, r, h; ``n`` the candidate, q = h_{t-1} Rn^T + Rbn):
    h_t = (1 - z) n + z h_{t-1}
    linear_before_reset=1 (PyTorch): n = tanh(x Wn^T + Wbn + r q)
        d(z, r, q) = dh * (Cz, Cn q r(1-r), Cn r),  dh_carry' = d(z, r, q) @ R + dh z
    linear_before_reset=0: n = tanh(x Wn^T + Wbn + (r h_{t-1}) Rn^T + Rbn)
        d(rh) = dh Cn @ Rn,  dr = d(rh) h_{t-1} r(1-r),  dh_carry' = d(z, r) @ R_zr + d(rh) r + dh z
    with Cz = (h_{t-1} - n) z(1-z), Cn = (1 - z)(1 - n^2).
"""

from __future__ import annotations

import onnx_ir as ir

from transpiler.autodiff._context import RuleContext
from transpiler.autodiff._registry import register
from transpiler.autodiff.rules.recurrent import Recurrence, ScanBody, run_scan


def _grads(ctx: RuleContext, rnn: Recurrence, per: dict[str, list[ir.Value]], states: int) -> list[ir.Value | None]:
    """The node's input gradients from the per-direction pieces (X, W, R, B, -, initial states)."""
    grads: list[ir.Value | None] = [None] * len(ctx.node.inputs)
    grads[0] = rnn.input_grad(per["x"])
    grads[1], grads[2] = rnn.stack(per["w"]), rnn.stack(per["r"])
    if ctx.has_input(3):
        grads[3] = rnn.stack(per["b"])
    for k in range(states):
        if ctx.has_input(5 + k):
            grads[5 + k] = rnn.state_grad(per[f"s{k}"])
    # Only the wanted ones (the rest is dropped with the nodes nothing reads).
    return [g if ctx.wants(i) else None for i, g in enumerate(grads)]


def _step_inputs(rnn: Recurrence, body: ScanBody, dy: ir.Value | None, scanned: list[ir.Value]):
    """Register the optional per-step inputs (dY_t, keep_t, hold_t) of a backward body."""
    dy_t = keep_t = hold_t = None
    if dy is not None:
        scanned.append(dy)
        dy_t = body.input("dy")
    if rnn.keep is not None:
        scanned += [rnn.keep, rnn.hold]
        keep_t, hold_t = body.input("keep"), body.input("hold")
    return dy_t, keep_t, hold_t


def _carried(rnn: Recurrence, body: ScanBody, dh: ir.Value, dy_t, keep_t) -> ir.Value:
    """The step's hidden-state gradient: the carry (masked past the row's length) plus dY_t."""
    dh_new = rnn.masked_carry(body, dh, keep_t)
    return dh_new if dy_t is None else body.op("Add", [dh_new, dy_t])


@register("LSTM", inputs=(0, 1, 2, 3, 5, 6))
def _lstm(ctx: RuleContext) -> list[ir.Value | None]:
    if ctx.has_input(7):
        raise ctx.error("peephole weights (input P) are not supported (PyTorch never exports them)")
    if ctx.node.attributes.get_int("input_forget", 0):
        raise ctx.error("input_forget=1 is not supported (PyTorch never exports it)")
    rnn = Recurrence(ctx, 4, ["Sigmoid", "Tanh", "Tanh"], states=2)
    per: dict[str, list[ir.Value]] = {k: [] for k in ("x", "w", "r", "b", "s0", "s1")}
    for d, reverse in enumerate(rnn.reverse):
        x = rnn.x_in_order(reverse)
        w, r = rnn.pick(ctx.inputs[1], d), rnn.pick(ctx.inputs[2], d)
        h_prev = rnn.previous(rnn.y_in_order(d), rnn.initial(5, d))
        c0 = rnn.initial(6, d)
        pre = ctx.op("Add", [rnn.matmul_t(x, w), rnn.matmul_t(h_prev, r)])
        if ctx.has_input(3):
            pre = ctx.op("Add", [pre, ctx.op("Add", list(rnn.bias_halves(rnn.pick(ctx.inputs[3], d))))])
        i_pre, o_pre, f_pre, g_pre = rnn.split(pre, 4)
        i, o, f = (ctx.op("Sigmoid", [v]) for v in (i_pre, o_pre, f_pre))
        g = ctx.op("Tanh", [g_pre])

        # The cell states, recomputed: c_t = f_t c_{t-1} + i_t g_t.
        body = ScanBody(ctx, rnn.dtype, "cells")
        c, f_t, ig_t = body.input("c"), body.input("f"), body.input("ig")
        c_next = body.op("Add", [body.op("Mul", [f_t, c]), ig_t])
        _, cells = run_scan(ctx, body, [c_next, c_next], [c0], [f, ctx.op("Mul", [i, g])], reverse=False)
        c_prev = rnn.previous(cells, c0)
        tc = ctx.op("Tanh", [cells])
        coefficients = ctx.op("Concat", [
            ctx.op("Mul", [g, rnn.sigmoid_slope(i)]),
            ctx.op("Mul", [tc, rnn.sigmoid_slope(o)]),
            ctx.op("Mul", [c_prev, rnn.sigmoid_slope(f)]),
            ctx.op("Mul", [i, rnn.tanh_slope(g)]),
        ], {"axis": -1})
        dc_from_dh = ctx.op("Mul", [o, rnn.tanh_slope(tc)])

        body = ScanBody(ctx, rnn.dtype, "lstm_backward")
        dh, dc, r_in = body.input("dh"), body.input("dc"), body.input("R")
        scanned = [dc_from_dh, coefficients, f]
        a_t, k_t, f_t = body.input("dc_from_dh"), body.input("coefficients"), body.input("f")
        dy_t, keep_t, hold_t = _step_inputs(rnn, body, rnn.dy_in_order(d), scanned)
        dh_new = _carried(rnn, body, dh, dy_t, keep_t)
        dc_new = body.op("Add", [rnn.masked_carry(body, dc, keep_t), body.op("Mul", [dh_new, a_t])])
        d_gates = body.op("Mul", [body.op("Concat", [dc_new, dh_new, dc_new, dc_new], {"axis": -1}), k_t])
        dh_prev = rnn.held(body, body.op("MatMul", [d_gates, r_in]), dh, hold_t)
        dc_prev = rnn.held(body, body.op("Mul", [dc_new, f_t]), dc, hold_t)
        dh0, dc0, _, d_gates_all = run_scan(
            ctx, body, [dh_prev, dc_prev, r_in, d_gates],
            [rnn.d_final_state(0, d), rnn.d_final_state(1, d), r], scanned, reverse=True)

        per["x"].append(ctx.op("MatMul", [d_gates_all, w]))
        per["w"].append(rnn.outer_sum(d_gates_all, x))
        per["r"].append(rnn.outer_sum(d_gates_all, h_prev))
        bias = rnn.row_sum(d_gates_all)
        per["b"].append(ctx.op("Concat", [bias, bias], {"axis": 0}))
        per["s0"].append(dh0)
        per["s1"].append(dc0)
    return _grads(ctx, rnn, per, states=2)


@register("GRU", inputs=(0, 1, 2, 3, 5))
def _gru(ctx: RuleContext) -> list[ir.Value | None]:
    rnn = Recurrence(ctx, 3, ["Sigmoid", "Tanh"], states=1)
    before_reset = ctx.node.attributes.get_int("linear_before_reset", 0)
    hidden = rnn.hidden
    per: dict[str, list[ir.Value]] = {k: [] for k in ("x", "w", "r", "b", "s0")}
    for d, reverse in enumerate(rnn.reverse):
        x = rnn.x_in_order(reverse)
        w, r = rnn.pick(ctx.inputs[1], d), rnn.pick(ctx.inputs[2], d)
        h_prev = rnn.previous(rnn.y_in_order(d), rnn.initial(5, d))
        from_x = rnn.matmul_t(x, w)
        rb = None
        if ctx.has_input(3):
            wb, rb = rnn.bias_halves(rnn.pick(ctx.inputs[3], d))
            from_x = ctx.op("Add", [from_x, wb])
        xz, xr, xn = rnn.split(from_x, 3)
        c = ctx.const
        if before_reset:
            from_h = rnn.matmul_t(h_prev, r)
            if rb is not None:
                from_h = ctx.op("Add", [from_h, rb])
            hz, hr, q = rnn.split(from_h, 3)
        else:
            r_zr = ctx.op("Slice", [r, c([0]), c([2 * hidden]), c([0])])
            r_n = ctx.op("Slice", [r, c([2 * hidden]), c([3 * hidden]), c([0])])
            from_h = rnn.matmul_t(h_prev, r_zr)
            if rb is not None:
                rb_z, rb_r, rb_n = rnn.split(rb, 3)
                from_h = ctx.op("Add", [from_h, ctx.op("Concat", [rb_z, rb_r], {"axis": 0})])
            hz, hr = ctx.op_multi("Split", [from_h, c([hidden, hidden])], {"axis": -1}, num_outputs=2)
        z = ctx.op("Sigmoid", [ctx.op("Add", [xz, hz])])
        reset = ctx.op("Sigmoid", [ctx.op("Add", [xr, hr])])
        if before_reset:
            n = ctx.op("Tanh", [ctx.op("Add", [xn, ctx.op("Mul", [reset, q])])])
        else:
            rh = ctx.op("Mul", [reset, h_prev])
            n_pre = ctx.op("Add", [xn, rnn.matmul_t(rh, r_n)])
            n = ctx.op("Tanh", [n_pre if rb is None else ctx.op("Add", [n_pre, rb_n])])
        c_n = ctx.op("Mul", [rnn.one_minus(z), rnn.tanh_slope(n)])
        c_z = ctx.op("Mul", [ctx.op("Sub", [h_prev, n]), rnn.sigmoid_slope(z)])

        body = ScanBody(ctx, rnn.dtype, "gru_backward")
        dh = body.input("dh")
        if before_reset:
            c_r = ctx.op("Mul", [ctx.op("Mul", [c_n, q]), rnn.sigmoid_slope(reset)])
            k_h = ctx.op("Concat", [c_z, c_r, ctx.op("Mul", [c_n, reset])], {"axis": -1})
            r_in = body.input("R")
            scanned = [z, k_h]
            z_t, k_t = body.input("z"), body.input("coefficients")
            dy_t, keep_t, hold_t = _step_inputs(rnn, body, rnn.dy_in_order(d), scanned)
            dh_new = _carried(rnn, body, dh, dy_t, keep_t)
            d_zrq = body.op("Mul", [body.op("Concat", [dh_new] * 3, {"axis": -1}), k_t])
            dh_prev = body.op("Add", [body.op("MatMul", [d_zrq, r_in]), body.op("Mul", [dh_new, z_t])])
            dh_prev = rnn.held(body, dh_prev, dh, hold_t)
            dh0, _, dh_all = run_scan(ctx, body, [dh_prev, r_in, dh_new], [rnn.d_final_state(0, d), r], scanned,
                                      reverse=True)
            dh3 = ctx.op("Concat", [dh_all] * 3, {"axis": -1})
            d_x = ctx.op("Mul", [dh3, ctx.op("Concat", [c_z, c_r, c_n], {"axis": -1})])
            d_h = ctx.op("Mul", [dh3, k_h])
            per["r"].append(rnn.outer_sum(d_h, h_prev))
            d_rb = rnn.row_sum(d_h)
        else:
            c_r = ctx.op("Mul", [h_prev, rnn.sigmoid_slope(reset)])
            r_zr_in, r_n_in = body.input("R_zr"), body.input("R_n")
            scanned = [z, reset, c_z, c_n, c_r]
            z_t, reset_t, cz_t, cn_t, cr_t = (body.input(k) for k in ("z", "r", "c_z", "c_n", "c_r"))
            dy_t, keep_t, hold_t = _step_inputs(rnn, body, rnn.dy_in_order(d), scanned)
            dh_new = _carried(rnn, body, dh, dy_t, keep_t)
            dn = body.op("Mul", [dh_new, cn_t])
            dz = body.op("Mul", [dh_new, cz_t])
            d_rh = body.op("MatMul", [dn, r_n_in])
            d_r = body.op("Mul", [d_rh, cr_t])
            dh_prev = body.op("Add", [body.op("MatMul", [body.op("Concat", [dz, d_r], {"axis": -1}), r_zr_in]),
                                      body.op("Add", [body.op("Mul", [d_rh, reset_t]), body.op("Mul", [dh_new, z_t])])])
            dh_prev = rnn.held(body, dh_prev, dh, hold_t)
            d_x_t = body.op("Concat", [dz, d_r, dn], {"axis": -1})
            dh0, _, _, d_x = run_scan(ctx, body, [dh_prev, r_zr_in, r_n_in, d_x_t],
                                      [rnn.d_final_state(0, d), r_zr, r_n], scanned, reverse=True)
            d_zr, d_n = ctx.op_multi("Split", [d_x, c([2 * hidden, hidden])], {"axis": -1}, num_outputs=2)
            per["r"].append(ctx.op("Concat", [rnn.outer_sum(d_zr, h_prev), rnn.outer_sum(d_n, rh)], {"axis": 0}))
            d_rb = rnn.row_sum(d_x)
        per["x"].append(ctx.op("MatMul", [d_x, w]))
        per["w"].append(rnn.outer_sum(d_x, x))
        per["b"].append(ctx.op("Concat", [rnn.row_sum(d_x), d_rb], {"axis": 0}))
        per["s0"].append(dh0)
    return _grads(ctx, rnn, per, states=1)
