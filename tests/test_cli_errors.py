"""Bad input: a one-line error naming what and where, exit status 2, no traceback, nothing in OUT."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import refresh_manifest
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]


def transpile_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "transpiler.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def assert_clean_error(done: subprocess.CompletedProcess, *fragments: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("transpile: error: "), lines[0]
    assert "Traceback" not in done.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def save_model(path: Path, nodes, inputs, outputs, initializers) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def float_input(name: str, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def weight(name: str, shape) -> onnx.TensorProto:
    return numpy_helper.from_array(np.full(shape, 0.5, np.float32), name)


def mse_tail(pred: str) -> list:
    return [
        helper.make_node("Sub", [pred, "y"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
    ]


@pytest.fixture
def perceptron(model_dir) -> Path:
    return model_dir("perceptron")


def test_not_onnx(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_text("this is not a protobuf")
    done = transpile_cli(bad, "--gpus", "2", "-o", tmp_path / "out", cwd=tmp_path)
    assert_clean_error(done, str(bad), "not an ONNX model")
    assert not (tmp_path / "out").exists()


def test_missing_file(tmp_path):
    done = transpile_cli(tmp_path / "nope.onnx", "-o", tmp_path / "out", cwd=tmp_path)
    assert_clean_error(done, "nope.onnx", "no such file")


def test_no_scalar_loss(tmp_path):
    model = save_model(
        tmp_path / "m.onnx",
        [helper.make_node("MatMul", ["x", "w"], ["pred"])],
        [float_input("x", ["batch", 3])],
        [float_input("pred", ["batch", 1])],
        [weight("w", [3, 1])],
    )
    done = transpile_cli(model, "-o", tmp_path / "out", cwd=tmp_path)
    assert_clean_error(done, "m.onnx", "no scalar float output", "pred")
    assert not (tmp_path / "out").exists()


def test_wrong_loss_name(perceptron, tmp_path):
    done = transpile_cli(perceptron / "model.onnx", "--loss", "lossy", "-o", tmp_path / "out", cwd=tmp_path)
    assert_clean_error(done, "--loss 'lossy'", "outputs: loss")
    assert not (tmp_path / "out").exists()


def test_unsupported_ops_listed_all_at_once(tmp_path):
    # Two unsupported op types on three nodes; every one is named in the single line.
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Atan", ["h"], ["a1"], name="atan_1"),
        helper.make_node("Sinh", ["a1"], ["s"], name="sinh_1"),
        helper.make_node("Atan", ["s"], ["pred"], name="atan_2"),
        *mse_tail("pred"),
    ]
    model = save_model(
        tmp_path / "m.onnx", nodes, [float_input("x", ["batch", 3]), float_input("y", ["batch", 1])],
        [float_input("loss", [])], [weight("w", [3, 1])],
    )
    done = transpile_cli(model, "--gpus", "2", "-o", tmp_path / "out", cwd=tmp_path)
    line = assert_clean_error(done, "m.onnx", "'Atan'", "'atan_1'", "'atan_2'", "'Sinh'", "'sinh_1'", "docs/ops.md")
    assert "'mm'" not in line
    assert not (tmp_path / "out").exists()


def test_loss_not_reachable_from_a_parameter(tmp_path):
    # The weight only feeds Shape: no gradient can reach it.
    nodes = [
        helper.make_node("Shape", ["w"], ["ws"]),
        helper.make_node("Reshape", ["x", "ws"], ["pred"]),
        *mse_tail("pred"),
    ]
    model = save_model(
        tmp_path / "m.onnx", nodes, [float_input("x", [3, 1]), float_input("y", [3, 1])],
        [float_input("loss", [])], [weight("w", [3, 1])],
    )
    done = transpile_cli(model, "-o", tmp_path / "out", cwd=tmp_path)
    assert_clean_error(done, "m.onnx", "not reachable from any float parameter")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--gpus", "0"], ["--gpus", "[1, 4096]", "got 0"]),
        (["--strategy", "ring"], ["--strategy 'ring'"]),
        (["--placement", "random"], ["--placement 'random'"]),
        (["--optimizer", "lion"], ["lion"]),
        (["--freeze", "("], ["--freeze"]),
        (["--freeze", "nomatch"], ["--freeze 'nomatch'", "matches no initializer", "fc1.weight"]),
        (["--optimizer", "adam", "--momentum", "0.5"], ["--momentum", "'adam'"]),
        (["--eps", "1e-6"], ["--eps", "adam", "'sgd'"]),
    ],
)
def test_bad_options(perceptron, tmp_path, args, fragments):
    done = transpile_cli(perceptron / "model.onnx", *args, "-o", tmp_path / "out", cwd=tmp_path)
    assert_clean_error(done, *fragments)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("before", [False, True])
def test_the_removed_flat_update_is_a_usage_error_naming_its_replacement(perceptron, tmp_path, before):
    """--flat-update was accepted and ignored; now it is refused while the command line is parsed
    (before -o or the model are even checked), with what replaced it."""
    args = ["--flat-update", perceptron / "model.onnx", "-o", tmp_path / "out"] if before else \
        [perceptron / "model.onnx", "--gpus", "2", "--flat-update", "-o", tmp_path / "out"]
    line = assert_clean_error(transpile_cli(*args, cwd=tmp_path), "--flat-update was removed: ",
                              "one fused node per tensor", "one multi-tensor kernel", "drop the option")
    assert line.startswith("transpile: error: --flat-update")
    assert not (tmp_path / "out").exists()
    assert_clean_error(transpile_cli(perceptron / "model.onnx", "--flat-update", cwd=tmp_path), "--flat-update was removed")
    done = transpile_cli("help", "compile", cwd=tmp_path)
    assert done.returncode == 0 and "--flat-update" not in done.stdout


def test_failed_transpile_keeps_an_existing_out(perceptron, tmp_path):
    out = tmp_path / "out"
    assert transpile_cli(perceptron / "model.onnx", "--gpus", "2", "-o", out, cwd=tmp_path).returncode == 0
    before = sorted(p.name for p in out.iterdir())
    done = transpile_cli(perceptron / "model.onnx", "--gpus", "0", "-o", out, cwd=tmp_path)
    assert_clean_error(done, "--gpus")
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no temp dirs left


@pytest.fixture
def transpiled(perceptron, tmp_path) -> Path:
    out = tmp_path / "out"
    assert transpile_cli(perceptron / "model.onnx", "--gpus", "4", "-o", out, cwd=tmp_path).returncode == 0
    return out


def run_cli(out: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    return transpile_cli("run", out, "--data", data, "--steps", "1", *extra, cwd=out.parent)


def write_data(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def test_data_missing_an_input(transpiled, tmp_path):
    data = write_data(tmp_path / "d.npz", X=np.ones((8, 10), np.float32))
    assert_clean_error(run_cli(transpiled, data, "--batch", "8"), "d.npz", "'Y'")


def test_data_wrong_shape(transpiled, tmp_path):
    data = write_data(tmp_path / "d.npz", X=np.ones((8, 9), np.float32), Y=np.ones((8, 1), np.float32))
    assert_clean_error(run_cli(transpiled, data, "--batch", "8"), "d.npz", "'X'", "shape")


def test_data_wrong_dtype(transpiled, tmp_path):
    data = write_data(tmp_path / "d.npz", X=np.ones((8, 10), np.float64), Y=np.ones((8, 1), np.float32))
    assert_clean_error(run_cli(transpiled, data, "--batch", "8"), "d.npz", "'X'", "float64", "float32")


def test_batch_not_divisible_by_ranks(transpiled, tmp_path):
    data = write_data(tmp_path / "d.npz", X=np.ones((8, 10), np.float32), Y=np.ones((8, 1), np.float32))
    assert_clean_error(run_cli(transpiled, data, "--batch", "6"), "6", "4")


def test_run_without_plan(tmp_path):
    data = write_data(tmp_path / "d.npz", X=np.ones((8, 10), np.float32))
    (tmp_path / "empty").mkdir()
    assert_clean_error(run_cli(tmp_path / "empty", data, "--batch", "8"), "plan.json")


def test_inspect_without_plan(tmp_path):
    done = transpile_cli("inspect", tmp_path, cwd=tmp_path)
    assert_clean_error(done, "plan.json")


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--gpus", "100000"], ["--gpus", "4096"]),
        (["--bucket-mb", "inf"], ["--bucket-mb", "inf"]),
        (["--bucket-mb", "nan"], ["--bucket-mb", "nan"]),
        (["--clip-grad-norm", "-1"], ["--clip-grad-norm", "> 0"]),
    ],
)
def test_out_of_range_options(perceptron, tmp_path, args, fragments):
    done = transpile_cli(perceptron / "model.onnx", *args, "-o", tmp_path / "out", cwd=tmp_path)
    assert_clean_error(done, *fragments)
    assert not (tmp_path / "out").exists()


def test_an_unnamed_unsupported_node_is_named_by_position_and_output(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Atan", ["h"], ["pred"]), *mse_tail("pred")]
    model = save_model(tmp_path / "m.onnx", nodes, [float_input("x", ["batch", 3]), float_input("y", ["batch", 1])],
                       [float_input("loss", [])], [weight("w", [3, 1])])
    assert_clean_error(transpile_cli(model, "-o", tmp_path / "out", cwd=tmp_path), "'Atan'", "'#1 -> pred'")


def test_a_model_without_data_inputs(tmp_path):
    nodes = [helper.make_node("Mul", ["w", "w"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    model = save_model(tmp_path / "m.onnx", nodes, [], [float_input("loss", [])], [weight("w", [3])])
    assert_clean_error(transpile_cli(model, "-o", tmp_path / "out", cwd=tmp_path), "m.onnx", "no data inputs")
    assert not (tmp_path / "out").exists()


def test_a_value_named_like_the_learning_rate_input(tmp_path):
    nodes = [helper.make_node("MatMul", ["lr", "w"], ["pred"]), *mse_tail("pred")]
    model = save_model(tmp_path / "m.onnx", nodes, [float_input("lr", ["batch", 3]), float_input("y", ["batch", 1])],
                       [float_input("loss", [])], [weight("w", [3, 1])])
    assert_clean_error(transpile_cli(model, "-o", tmp_path / "out", cwd=tmp_path), "m.onnx", "'lr'", "rename")


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_external_data_that_cannot_be_read(perceptron, tmp_path, damage):
    model = onnx.load(perceptron / "model.onnx")
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.bin", size_threshold=0)
    data = tmp_path / "m.bin"
    if damage == "missing":
        data.unlink()
    else:
        data.write_bytes(data.read_bytes()[:100])
    assert_clean_error(transpile_cli(tmp_path / "m.onnx", "-o", tmp_path / "out", cwd=tmp_path), "m.onnx",
                       "external data")


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--lr", "nan"], ["--lr", "nan"]),
        (["--lr", "-1"], ["--lr", "-1"]),
        (["--lr", "inf"], ["--lr", "inf"]),
        (["--lr-schedule", "cosine", "--min-lr", "nan"], ["--min-lr"]),
        (["--lr-schedule", "step", "--lr-step-size", "2", "--lr-gamma", "-1"], ["--lr-gamma"]),
    ],
)
def test_bad_learning_rates_are_refused(transpiled, perceptron, extra, fragments):
    assert_clean_error(run_cli(transpiled, perceptron / "data.npz", "--batch", "8", *extra), *fragments)


@pytest.mark.parametrize("epochs", ["nan", "inf"])
def test_bad_epochs(transpiled, perceptron, epochs):
    done = transpile_cli("run", transpiled, "--data", perceptron / "data.npz", "--batch", "8", "--epochs", epochs,
                         cwd=transpiled.parent)
    assert_clean_error(done, "--epochs")


def test_data_saved_as_npy(transpiled, tmp_path):
    np.save(tmp_path / "d.npy", np.ones((8, 10), np.float32))
    assert_clean_error(run_cli(transpiled, tmp_path / "d.npy", "--batch", "8"), "d.npy", "np.savez")


def test_run_names_what_it_was_given(transpiled, perceptron, tmp_path):
    assert_clean_error(run_cli(tmp_path / "nope", perceptron / "data.npz", "--batch", "8"), "nope: no such directory")
    assert_clean_error(run_cli(perceptron / "model.onnx", perceptron / "data.npz", "--batch", "8"), "model.onnx: a file")


@pytest.mark.parametrize("meta", ["[]", "step -5", "step x"])
def test_resume_from_damaged_metadata(transpiled, perceptron, tmp_path, meta):
    import json

    data = perceptron / "data.npz"
    ck = tmp_path / "ck"
    assert run_cli(transpiled, data, "--batch", "8", "--checkpoint", ck).returncode == 0
    saved = ck / "checkpoint-1"
    if meta == "[]":
        (saved / "meta.json").write_text("[]")
    else:
        raw = json.loads((saved / "meta.json").read_text())
        raw["step"] = -5 if meta == "step -5" else "x"
        (saved / "meta.json").write_text(json.dumps(raw))
    done = transpile_cli("run", transpiled, "--data", data, "--steps", "3", "--batch", "8", "--resume", ck,
                         cwd=tmp_path)
    assert_clean_error(done, "meta.json")


def test_resume_from_a_truncated_rank_file(transpiled, perceptron, tmp_path):
    data = perceptron / "data.npz"
    ck = tmp_path / "ck"
    assert run_cli(transpiled, data, "--batch", "8", "--checkpoint", ck).returncode == 0
    rank2 = ck / "checkpoint-1" / "rank2.npz"
    rank2.write_bytes(rank2.read_bytes()[:50])
    done = transpile_cli("run", transpiled, "--data", data, "--steps", "3", "--batch", "8", "--resume", ck,
                         cwd=tmp_path)
    assert_clean_error(done, "rank2.npz does not match the manifest", "damaged")
    # With the manifest made to match, the rank reading it still refuses it with one line.
    refresh_manifest(ck / "checkpoint-1")
    done = transpile_cli("run", transpiled, "--data", data, "--steps", "3", "--batch", "8", "--resume", ck,
                         cwd=tmp_path)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "rank2.npz: unreadable" in done.stderr and "damaged" in done.stderr


@pytest.mark.parametrize("edit, fragment", [
    (lambda plan: [], "not a graph-transpiler plan"),
    (lambda plan: {k: v for k, v in plan.items() if k != "parameters"}, "'parameters' is missing"),
    (lambda plan: {**plan, "world_size": 3}, "world_size 3 but 4 rank"),
    (lambda plan: {**plan, "world_size": "two"}, "'world_size' is str"),
    (lambda plan: {**plan, "format_version": 99}, "format_version 99"),
])
def test_inspect_and_view_refuse_a_damaged_plan(transpiled, edit, fragment):
    import json

    path = transpiled / "plan.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    for command in ("inspect", "view"):
        assert_clean_error(transpile_cli(command, transpiled, cwd=transpiled.parent), "plan.json", fragment)


def test_view_port_out_of_range(transpiled):
    assert_clean_error(transpile_cli("view", transpiled, "--port", "70000", cwd=transpiled.parent), "--port")


def test_batch_larger_than_the_data(transpiled, tmp_path):
    data = write_data(tmp_path / "d.npz", X=np.ones((8, 10), np.float32), Y=np.ones((8, 1), np.float32))
    assert_clean_error(run_cli(transpiled, data, "--batch", "16"), "--batch 16", "8 rows", "d.npz")


def test_resume_with_another_data_order_says_both(transpiled, perceptron, tmp_path):
    data = perceptron / "data.npz"
    ck = tmp_path / "ck"
    assert run_cli(transpiled, data, "--batch", "8", "--checkpoint", ck).returncode == 0
    done = transpile_cli("run", transpiled, "--data", data, "--steps", "3", "--batch", "8", "--shuffle", "--resume", ck,
                         cwd=tmp_path)
    # The batch may change on resume (the data position is kept in samples); the order may not.
    assert_clean_error(done, "written with no --shuffle", "this run has --shuffle --seed 0")


def test_float16_parameters_name_the_file(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Cast", ["h"], ["pred"], to=TensorProto.FLOAT),
             *mse_tail("pred")]
    w = numpy_helper.from_array(np.full((3, 1), 0.5, np.float16), "w")
    model = save_model(tmp_path / "m.onnx", nodes,
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 3]), float_input("y", ["batch", 1])],
                       [float_input("loss", [])], [w])
    assert_clean_error(transpile_cli(model, "-o", tmp_path / "out", cwd=tmp_path), "m.onnx", "'w'", "float32")


def test_a_directory_given_as_the_model(tmp_path):
    assert_clean_error(transpile_cli(tmp_path, "-o", tmp_path / "out", cwd=tmp_path), "a directory")


def test_resume_with_state_of_the_wrong_shape(transpiled, perceptron, tmp_path):
    data = perceptron / "data.npz"
    ck = tmp_path / "ck"
    assert run_cli(transpiled, data, "--batch", "8", "--checkpoint", ck).returncode == 0
    state = dict(np.load(ck / "checkpoint-1" / "rank1.npz"))
    name = next(n for n, a in state.items() if a.ndim == 2)
    state[name] = state[name][:, :3]
    np.savez(ck / "checkpoint-1" / "rank1.npz", **state)
    refresh_manifest(ck / "checkpoint-1")
    done = transpile_cli("run", transpiled, "--data", data, "--steps", "3", "--batch", "8", "--resume", ck,
                         cwd=tmp_path)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert f"rank1.npz: '{name}' is float32 [" in done.stderr and "this rank's graph expects float32" in done.stderr


def test_version_and_help_list_the_commands(tmp_path):
    from importlib.metadata import version

    done = transpile_cli("--version", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == f"transpile (graph-transpiler) {version('graph-transpiler')}"
    done = transpile_cli("help", cwd=tmp_path)
    assert done.returncode == 0
    assert all(f"transpile {name}" in done.stdout for name in ("[compile] MODEL", "run", "export", "inspect", "view"))
    done = transpile_cli("help", "run", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("usage: transpile run")
    done = transpile_cli("help", "nope", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().startswith("transpile: error: help: no command 'nope'")
