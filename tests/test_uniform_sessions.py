"""With the collectives inside the sessions (the nccl backend), every rank's sessions hold the same
collectives in the same sessions, whatever state the rank holds (runtime/segments.py
``_collectives_apart``): NCCL asks every rank to capture the same calls in a CUDA graph. Under
`sharded` a rank that is the root of no parameter has no update between its reductions and its
publications; without the rule its one session held both (the perceptron on 4 ranks), and with
--precision fp16 its overflow AllReduce joined its Reduces' session."""

from __future__ import annotations

import onnx
import pytest

from commands.main import main
from contract.ops import FUSED_UPDATE_DOMAIN
from runtime.collectives import COLLECTIVE_DOMAIN
from runtime.plan import load_plan
from runtime.segments import Segment, cut_graph


def _collectives_by_session(out, rank: int) -> list[list[tuple[str, int]]]:
    """Rank ``rank``'s step cut as the nccl backend cuts it: per session, its collectives as
    (op type, order)."""
    plan = load_plan(out)
    model = onnx.load(str(out / plan.graphs(rank).step.name))
    orders = {n.name: (n.op_type, next(a.i for a in n.attribute if a.name == "order"))
              for n in model.graph.node if n.domain == COLLECTIVE_DOMAIN}
    cut = cut_graph(model, rank, "step", split_tail=True, native_domains={FUSED_UPDATE_DOMAIN},
                    late_domains={FUSED_UPDATE_DOMAIN}, collectives_inside=True)
    sessions = [sorted(orders[n] for n in item.node_names if n in orders) for item in cut.items if isinstance(item, Segment)]
    return [s for s in sessions if s]


@pytest.mark.parametrize("flags", [[], ["--precision", "fp16"], ["--clip-grad-norm", "1.0"]], ids=["fp32", "fp16", "clip"])
@pytest.mark.parametrize("model, world", [("perceptron", 4), ("gpt", 3)])
@pytest.mark.parametrize("strategy", ["sharded", "zero", "allreduce"])
def test_every_rank_holds_the_same_collectives_in_the_same_sessions(model, world, strategy, flags, model_dir, tmp_path):
    out = tmp_path / "out"
    # --placement hash: the perceptron's four parameters then leave a rank of four the root of none
    # (balanced, the default, gives each rank one)
    assert main(["compile", str(model_dir(model) / "model.onnx"), "--gpus", str(world), "--strategy", strategy,
                 "--optimizer", "momentum", "--bucket-mb", "2", "--placement", "hash", *flags, "-o", str(out)]) == 0
    plan = load_plan(out)
    if model == "perceptron" and strategy == "sharded":  # the case the rule is for: a rank roots no parameter
        assert any(not any(s.kind == "optimizer" for s in plan.graphs(r).state) for r in range(world))
    every = [_collectives_by_session(out, r) for r in range(world)]
    assert all(sessions == every[0] for sessions in every), every
    for sessions in every[0]:  # one op type a session: reductions and publications never share one
        assert len({op for op, _ in sessions}) == 1, sessions
