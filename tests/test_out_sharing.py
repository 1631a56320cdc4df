"""OUT at scale: weights read lazily and stored once, ranks with identical graphs share one file
(docs/scale.md), and transpile's per-stage progress lines."""

from __future__ import annotations

import io
import shutil

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import assert_replicas_identical, max_rel_error, one_graph_model
from onnx import TensorProto, helper, numpy_helper

from contract.plan import load_plan
from runtime import simulate
from transpiler import Options, build, transpile
from transpiler.optimizer import OptimizerConfig
from transpiler.progress import Progress
from transpiler.rank_graphs import build_rank
from transpiler.strategies import STRATEGIES

ROWS, FEATURES, HIDDEN = 16, 32, 64


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """x [batch, 32] -> MatMul w1 [32, 64] (2,048 floats: read lazily) -> Relu -> MatMul w2 [64, 1]
    (64 floats: read in) -> MSE against y. Returns the model path and its data."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("MatMul", ["a", "w2"], ["pred"]), helper.make_node("Sub", ["pred", "y"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(rng.normal(0, 0.2, (FEATURES, HIDDEN)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(0, 0.2, (HIDDEN, 1)).astype(np.float32), "w2")]
    model = one_graph_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", FEATURES]),
                                    helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])],
                            [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    onnx.save(model, path)
    data = {"x": rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
            "y": rng.normal(size=(ROWS, 1)).astype(np.float32)}
    return path, data


def _sizes(out):
    return {p.name: p.stat().st_size for p in out.iterdir()}


def test_allreduce_out_grows_only_by_the_plan(mlp, tmp_path):
    sizes = {}
    for world in (2, 8):
        transpile(mlp[0], tmp_path / f"n{world}", Options(world_size=world, strategy="allreduce",
                                                          optimizer=OptimizerConfig("adam")))
        sizes[world] = _sizes(tmp_path / f"n{world}")
    # One step graph for every rank, rank 0's init graph (it Broadcasts the initial values), one
    # init graph for all the others and the evaluation graph; the same files, byte for byte the
    # same size, at 2 and 8 ranks.
    assert sorted(sizes[8]) == sorted(sizes[2]) == sorted(
        ["model.onnx", "plan.json", "train.onnx", "train_init.onnx", "rank0.onnx", "rank0_init.onnx", "rank1_init.onnx",
         "eval.onnx"])
    assert {k: v for k, v in sizes[8].items() if k != "plan.json"} == {k: v for k, v in sizes[2].items() if k != "plan.json"}
    # plan.json names each rank's files; ranks 2..7 are written {"rank": r, "same_as": 1}.
    assert sizes[8]["plan.json"] - sizes[2]["plan.json"] < 6 * 128  # and the placement's per-rank byte counts
    ranks = load_plan(tmp_path / "n8").raw["graphs"]["ranks"]
    assert {r["step"] for r in ranks} == {"rank0.onnx"}
    assert [r["init"] for r in ranks] == ["rank0_init.onnx"] + ["rank1_init.onnx"] * 7
    assert all(r["state"] == ranks[1]["state"] and r["rank"] == i for i, r in enumerate(ranks))


def test_shared_files_train_like_one_device_without_the_source_model(mlp, tmp_path):
    """OUT references the weights inside its own copy of the model: moved, with the user's model
    gone, it still trains, and 4 ranks sharing files equal one device."""
    source = tmp_path / "src" / "mlp.onnx"
    source.parent.mkdir()
    shutil.copyfile(mlp[0], source)
    transpile(source, tmp_path / "out", Options(world_size=4, strategy="allreduce"))
    source.unlink()
    out = tmp_path / "moved"
    shutil.move(tmp_path / "out", out)
    init = onnx.load(out / "rank0_init.onnx", load_external_data=False)
    external = [t for t in init.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert [t.name for t in external] == ["w1.init"]  # the large weight, by reference only
    assert {e.key: e.value for e in external[0].external_data}["location"] == "model.onnx"
    result = simulate(out, mlp[1], batch=8, steps=3)
    reference = simulate(out, mlp[1], batch=8, steps=3, single_device=True)
    assert_replicas_identical(result.parameters)
    assert max_rel_error(result.parameters[0], reference.parameters[0]) <= 1e-6


@pytest.mark.parametrize("name", ["allreduce", "sharded", "zero"])
def test_ranks_built_alone_equal_the_shared_graphs(mlp, name):
    """``Strategy.rank_key`` may only merge ranks whose graphs are really the same: every rank
    built on its own serializes to the bytes of the graph it was given."""
    job = build(mlp[0], Options(world_size=5, strategy=name, bucket_mb=0.004, optimizer=OptimizerConfig("adam")))
    protos = {key: ir.serde.serialize_model(model) for key, (model, _) in job.variants.items()}

    def data(model):
        return ir.serde.serialize_model(model).SerializeToString(deterministic=True)

    for rank in job.ranks:
        alone = build_rank(job, rank.rank, protos)
        assert data(alone.step) == data(rank.step), rank.rank
        assert data(alone.init) == data(rank.init), rank.rank
        assert alone.updates == rank.updates and [s.input for s in alone.state] == [s.input for s in rank.state]
    steps = {data(r.step) for r in job.ranks}
    assert len(steps) == {"allreduce": 1, "zero": 5}.get(name, len(steps))  # zero: each rank its slices
    assert len({id(r.init) for r in job.ranks}) == len({STRATEGIES[name].rank_key(job, r) for r in range(5)})


def test_large_weights_stay_on_disk(mlp):
    job = build(mlp[0], Options())
    weights = job.problem.model.graph.initializers
    assert isinstance(weights["w1"].const_value, ir.ExternalTensor)
    assert not isinstance(weights["w2"].const_value, ir.ExternalTensor)
    np.testing.assert_array_equal(weights["w1"].const_value.numpy(),
                                  numpy_helper.to_array(onnx.load(mlp[0]).graph.initializer[0]))


def test_progress_prints_slow_stages_only():
    stream = io.StringIO()
    progress = Progress(stream)  # not a terminal: plain lines
    with progress.stage("autodiff"):
        pass
    assert stream.getvalue() == ""  # a fast stage (a tiny model) prints nothing
    progress.min_seconds = 0.0
    with progress.stage("split ranks") as note:
        note("rank 1/2")  # the spinner's detail: never a line of its own
        note("rank 2/2")
    line = stream.getvalue()
    assert line.startswith("transpile: split ranks ") and line.endswith(" s\n") and line.count("\n") == 1
