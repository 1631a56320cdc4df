"""plan.json validation: one line naming the file and the field."""

from __future__ import annotations

import json

import pytest
from test_runtime_outdir import write_out

from runtime import RunError, load_plan


def _edit(out, change):
    plan = json.loads((out / "plan.json").read_text())
    change(plan)
    (out / "plan.json").write_text(json.dumps(plan))


def test_valid_plan_loads(tmp_path):
    plan = load_plan(write_out(tmp_path, 2, "sharded"))
    assert plan.world_size == 2 and plan.strategy == "sharded" and plan.lr == 0.05
    assert [p.root for p in plan.parameters] == [0, 1]
    assert plan.graphs(1).step.name == "rank1.onnx" and plan.graphs(None).init.name == "train_init.onnx"
    assert [s.kind for s in plan.graphs(0).state] == ["param", "param", "optimizer", "step"]


@pytest.mark.parametrize("change, message", [
    (lambda p: p.update(format="other"), r"field 'format' is 'other', expected 'graph-transpiler/plan'"),
    (lambda p: p.update(format_version=3), r"field 'format_version' is 3, this runtime reads 1 and 2 \(written by a newer"),
    (lambda p: (p.update(format_version=2), p["graphs"]["ranks"][1].update(same_as=1)), r"field 'graphs.ranks\[1\].same_as' is 1, expected an earlier rank"),
    (lambda p: p.pop("loss"), r"field 'loss' is missing"),
    (lambda p: p.update(world_size="2"), r"field 'world_size' must be an integer, got str"),
    (lambda p: p["graphs"]["ranks"].pop(), r"field 'graphs.ranks' has 1 entries, world_size is 2"),
    (lambda p: p["graphs"]["ranks"][1].update(step="nope.onnx"), r"field 'graphs.ranks\[1\].step' names nope.onnx"),
    (lambda p: p["data_inputs"][0].update(batch_axis=5), r"field 'data_inputs\[0\].batch_axis' is 5"),
    (lambda p: p["parameters"][1].update(root=9), r"field 'parameters\[1\].root' is 9, outside world_size 2"),
    (lambda p: p["graphs"]["single"]["state"][0].pop("output"), r"field 'graphs.single.state\[0\].output' is missing"),
])
def test_errors_name_file_and_field(tmp_path, change, message):
    out = write_out(tmp_path, 2, "allreduce")
    _edit(out, change)
    with pytest.raises(RunError, match=message) as info:
        load_plan(out)
    assert str(info.value).startswith(str(out / "plan.json")) and "\n" not in str(info.value)


def test_missing_and_broken_plans(tmp_path):
    with pytest.raises(RunError, match="no plan.json here"):
        load_plan(tmp_path)
    (tmp_path / "plan.json").write_text("{")
    with pytest.raises(RunError, match="not readable as JSON"):
        load_plan(tmp_path)
