"""Rules for the collectives that can sit inside the forward (``--sync-bn``'s statistics).

Convention of every rank's backward: it is seeded with d(loss_r)/d(loss_r) = 1, i.e. it computes N
times its share of the gradient of the global loss (the mean of the ranks' losses); the gradient
collectives' mean then gives the global gradient. Under that convention the transpose of
``y = AllReduce_op(x)`` (the same y on every rank) is ``dx = AllReduce_op(dy)``: for "mean",
N * dG/dx_r = N * sum_s (1/N) dL_s/dy * (1/N) = mean_s(dy_s); for "sum" likewise with the sum.
"""

from __future__ import annotations

from contract.collectives import DOMAIN
from transpiler.autodiff._context import RuleContext, annotate
from transpiler.autodiff._registry import register


@register(f"{DOMAIN}::AllReduce")
def allreduce(ctx: RuleContext):
    dys = [dy if dy is not None else ctx.zeros_like(out) for dy, out in zip(ctx.dys, ctx.node.outputs)]
    attrs = {
        "reduction": ctx.node.attributes["reduction"].as_string(),
        "bucket": -1,
        "order": -1,  # numbered with the rank graph's other collectives (SplitRanksPass)
        "phase": "step",
    }
    outs = ctx.op_multi("AllReduce", dys, attrs, num_outputs=len(dys), domain=DOMAIN)
    for out, x in zip(outs, ctx.inputs):
        annotate(out, x)
    return [out if ctx.wants(i) else None for i, out in enumerate(outs)]
