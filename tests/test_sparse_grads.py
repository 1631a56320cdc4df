"""--sparse-grads (transpiler/sparse_grads.py): a token table's gradient goes as the batch's rows
through one AllConcat; N ranks still equal one device and each other, bit for bit (`allreduce`:
every rank scatter-adds every rank's rows, in index order; `sharded`: the table's root), and every
rank's sessions keep the AllConcat where the GPU backend cuts them."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from runtime import simulate
from transpiler import transpile
from transpiler.errors import TranspileError
from transpiler.passes import Options

STEPS = 4
BATCH = 8


def _max_rel(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k] - v))) / (float(np.max(np.abs(v))) or 1.0) for k, v in b.items())


@pytest.mark.parametrize("strategy, world", [("sharded", 2), ("sharded", 4), ("allreduce", 2), ("allreduce", 4)])
def test_n_ranks_sending_rows_equal_one_device(model_dir, tmp_path, strategy, world):
    directory = model_dir("gpt")
    out = tmp_path / f"{strategy}-{world}"
    transpile(directory / "model.onnx", out, Options(world_size=world, strategy=strategy, sparse_grads=True))
    plan = json.loads((out / "plan.json").read_text())
    assert plan["sparse_gradients"] == ["wte.weight"]
    step = onnx.load(out / plan["graphs"]["ranks"][0]["step"], load_external_data=False)
    ops = [n.op_type for n in step.graph.node if n.domain == "graph_transpiler"]
    assert ops.count("AllConcat") == 1
    # The token table's rows are not also reduced dense: no collective moves its [vocab, width] gradient.
    moved = {i for n in step.graph.node if n.domain == "graph_transpiler" and n.op_type != "AllConcat" for i in n.input}
    assert not any(name.startswith("grad.wte.weight") for name in moved)
    data = dict(np.load(directory / "data.npz"))
    ranks = simulate(out, data, batch=BATCH, steps=STEPS)
    one = simulate(out, data, batch=BATCH, steps=STEPS, single_device=True)
    assert _max_rel(ranks.parameters[0], one.parameters[0]) < 1e-5
    for params in ranks.parameters[1:]:
        for name, value in params.items():
            np.testing.assert_array_equal(value, ranks.parameters[0][name])
    np.testing.assert_allclose(ranks.losses, one.losses, rtol=1e-5)


def test_a_model_without_a_table_sends_nothing_as_rows(model_dir, tmp_path):
    transpile(model_dir("perceptron") / "model.onnx", tmp_path / "p",
              Options(world_size=2, strategy="sharded", sparse_grads=True))
    assert "sparse_gradients" not in json.loads((tmp_path / "p" / "plan.json").read_text())


@pytest.mark.parametrize("options, fragment", [
    (dict(strategy="zero"), "--sparse-grads: not with --strategy zero"),
    (dict(strategy="sharded", grad_accumulation=2), "--sparse-grads: not with --grad-accumulation"),
])
def test_what_rows_cannot_serve_is_a_one_line_error(model_dir, tmp_path, options, fragment):
    with pytest.raises(TranspileError, match=fragment):
        transpile(model_dir("gpt") / "model.onnx", tmp_path / "bad", Options(world_size=2, sparse_grads=True, **options))


def test_run_time_accumulation_refuses_a_plan_that_sends_rows(model_dir, tmp_path):
    from runtime.errors import RunError

    out = tmp_path / "rows"
    transpile(model_dir("gpt") / "model.onnx", out, Options(world_size=2, strategy="sharded", sparse_grads=True))
    with pytest.raises(RunError, match=r"--grad-accumulation 2: .* as rows \(--sparse-grads\)"):
        simulate(out, dict(np.load(model_dir("gpt") / "data.npz")), batch=BATCH, steps=1, grad_accumulation=2)


def test_every_rank_keeps_the_allconcat_in_its_sessions(model_dir, tmp_path):
    """The GPU backend's cut (collectives inside the sessions, native stages between them): the
    ranks that do not update the table read nothing of the AllConcat, and it must still run there,
    in the same session as on its root, or NCCL waits for it forever."""
    import onnxruntime

    from contract.collectives import DOMAIN
    from runtime.gpu import native
    from runtime.segments import cut_graph

    out = tmp_path / "sharded-4"
    transpile(model_dir("gpt") / "model.onnx", out, Options(world_size=4, strategy="sharded", sparse_grads=True))
    plan = json.loads((out / "plan.json").read_text())
    decided = native.decide(onnxruntime)
    per_rank = []
    for rank, entry in enumerate(plan["graphs"]["ranks"]):
        entry = plan["graphs"]["ranks"][entry["same_as"]] if "same_as" in entry else entry
        model = onnx.load(out / entry["step"])
        for rewrite in decided.rewrites:
            model = rewrite(model)
        cut = cut_graph(model, rank, "step", split_tail=True, native_domains=decided.between,
                        late_domains=decided.between & {"graph_transpiler.optimizer"}, collectives_inside=True)
        per_rank.append([[n.op_type for n in segment.model.graph.node if n.domain == DOMAIN] for segment in cut.segments])
    for sessions in per_rank:
        assert sum(ops.count("AllConcat") for ops in sessions) == 1
        assert [ops for ops in sessions if ops] == [ops for ops in per_rank[0] if ops]


def test_inspect_shows_the_rows_as_sized_by_the_batch(model_dir, tmp_path):
    """`transpile inspect`: the AllConcat is listed, its bytes 'by batch' (the rows' count is the
    run's), not a 0 that would read as nothing moved."""
    from inspection.render import plain, sections_of
    from inspection.report import build_report

    out = tmp_path / "sharded-2"
    transpile(model_dir("gpt") / "model.onnx", out, Options(world_size=2, strategy="sharded", sparse_grads=True))
    text = plain(sections_of(build_report(out, [0], segments=False)))
    (line,) = [row for row in text.splitlines() if "AllConcat" in row and "all_rows" in row]
    assert line.count("by batch") == 3


def test_a_gpu_without_the_ordered_row_sums_refuses_allreduce_rows(model_dir, tmp_path):
    """Where the GPU's row scatter-add kernel is off (no custom ops), onnxruntime's atomic ScatterND
    would sum a repeated row in another order on each rank: a step in which every rank sums the
    gathered rows (allreduce) is refused in one line; sharded's, where the root sums and Broadcasts,
    is not."""
    from runtime.errors import RunError
    from runtime.gpu.scatter_add import refuse_unordered_row_sums

    for strategy in ("allreduce", "sharded"):
        out = tmp_path / strategy
        transpile(model_dir("gpt") / "model.onnx", out, Options(world_size=2, strategy=strategy, sparse_grads=True))
        plan = json.loads((out / "plan.json").read_text())
        entry = plan["graphs"]["ranks"][0]
        step = onnx.load(out / entry["step"])
        if strategy == "sharded":
            refuse_unordered_row_sums(step)
            continue
        with pytest.raises(RunError, match=r"every rank sums the gathered rows of 'grad\.wte\.weight\.all_rows'.*"
                                           r"--strategy sharded") as error:
            refuse_unordered_row_sums(step)
        assert "\n" not in str(error.value)
