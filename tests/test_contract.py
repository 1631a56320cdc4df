"""One contract (contract/): the writer, the runtime and inspect agree on OUT because they share it.

- the collective domain and the value names the transpiler writes are the contract's;
- every plan the transpiler writes passes the readers' reader (write_out checks it too);
- inspect's segment cut (contract.collectives.place_alap) is the runtime's cut_graph, segment by
  segment, although inspection/ does not import runtime/.
"""

from __future__ import annotations

import pytest

import contract.collectives
import contract.names
from contract.errors import UserError
from contract.plan import PlanError, load_plan


def test_one_domain_and_one_set_of_names():
    import transpiler.collectives
    import transpiler.names
    from runtime.collectives import COLLECTIVE_DOMAIN

    assert transpiler.collectives.DOMAIN == COLLECTIVE_DOMAIN == contract.collectives.DOMAIN
    assert transpiler.collectives.OPS == contract.collectives.OPS
    assert (transpiler.names.LR_INPUT, transpiler.names.NEXT, transpiler.names.ACC, transpiler.names.STEP_STATE) == (
        contract.names.LR_INPUT, contract.names.NEXT, contract.names.ACC, contract.names.STEP_STATE)


@pytest.mark.parametrize("name, world, options", [
    ("perceptron", 4, {"strategy": "sharded"}),
    ("perceptron", 3, {"strategy": "zero", "grad_accumulation": 2}),
    ("cnn", 2, {"strategy": "allreduce", "sync_bn": True}),
])
def test_inspect_cuts_every_rank_graph_like_the_runtime(model_dir, tmp_path, name, world, options):
    from inspection.costs import cut_segments
    from inspection.model import load_model
    from runtime.segments import cut_graph, load_graph
    from transpiler import Options, transpile

    out = tmp_path / "out"
    transpile(model_dir(name) / "model.onnx", out, Options(world_size=world, **options))
    plan = load_plan(out, report_fields=True)
    assert plan.raw["lr_input"] == contract.names.LR_INPUT
    for r, files in enumerate(plan.ranks):
        for path in (files.step, files.init, *([files.accum] if files.accum else [])):
            # Each side loads the file its own way: the runtime with the weights, inspect without.
            runtime = [(s.index, [n.output[0] for n in s.model.graph.node if n.output], list(s.inputs), list(s.outputs))
                       for s in cut_graph(load_graph(path), r, path.name).segments]
            inspected = [(s["index"], s["node_keys"], s["inputs"], s["outputs"])
                         for s in cut_segments(load_model(path), r, path.name, rows=8)]
            assert inspected == runtime, path.name


def test_plan_errors_are_one_line_user_errors(tmp_path):
    (tmp_path / "plan.json").write_text('{"format": "graph-transpiler/plan", "format_version": 1}')
    with pytest.raises(PlanError, match=r"plan.json: field 'world_size' is missing") as info:
        load_plan(tmp_path)
    assert isinstance(info.value, UserError) and info.value.field == "world_size"
