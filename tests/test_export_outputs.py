"""``--outputs NAMES`` of ``transpile export`` and ``transpile run --export`` (runtime/inference.py):
the forward up to the named values with the trained values, no loss, no labels; onnxruntime on it
gives the training graph's own values."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import load_data
from onnx import helper, numpy_helper

from commands.main import main
from graph_transpiler import train, transpile


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})


def _with_output(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """``model`` with the value ``name`` added as a graph output (its own intermediate value)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return model


def _logits(model: onnx.ModelProto) -> str:
    return next(n.input[0] for n in model.graph.node if n.op_type == "SoftmaxCrossEntropyLoss")


@pytest.fixture(scope="module")
def trained_gpt(tmp_path_factory, model_dir):
    """The built-in GPT on 2 in-process ranks (AdamW, 4 steps): OUT, its checkpoint store and
    the full --export."""
    tmp = tmp_path_factory.mktemp("gpt_outputs")
    out = transpile(model_dir("gpt") / "model.onnx", tmp / "out", gpus=2, optimizer="adamw", lr=1e-2, verbose=False)
    train(out, model_dir("gpt") / "data.npz", batch=8, steps=4, verbose=False, checkpoint=tmp / "ck",
          export=tmp / "full.onnx")
    return out, tmp


def test_export_outputs_gives_the_training_graphs_logits(trained_gpt, model_dir, capsys):
    out, tmp = trained_gpt
    full = onnx.load(str(tmp / "full.onnx"))
    logits = _logits(full)
    assert main(["export", str(out), "--checkpoint", str(tmp / "ck"), "-o", str(tmp / "cut.onnx"),
                 "--outputs", logits]) == 0
    assert f"the forward up to {logits}" in capsys.readouterr().out
    cut = onnx.load(str(tmp / "cut.onnx"))
    onnx.checker.check_model(cut)
    assert [i.name for i in cut.graph.input] == ["tokens"]  # no targets: the loss is gone
    assert [o.name for o in cut.graph.output] == [logits]
    assert "SoftmaxCrossEntropyLoss" not in {n.op_type for n in cut.graph.node}
    trained = {t.name: numpy_helper.to_array(t) for t in full.graph.initializer}
    initial = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out / "model.onnx")).graph.initializer}
    changed = 0
    for t in cut.graph.initializer:  # the trained values, not the initial ones
        np.testing.assert_array_equal(numpy_helper.to_array(t), trained[t.name], err_msg=t.name)
        changed += not np.array_equal(trained[t.name], initial[t.name])
    assert changed > 10
    data = load_data(model_dir("gpt") / "data.npz")
    feeds = {k: v[:8] for k, v in data.items()}
    expected = _run(_with_output(full, logits), feeds)[-1]  # the training graph's own value, trained parameters
    (got,) = _run(cut, feeds)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_run_export_outputs_writes_the_same_graph(trained_gpt, model_dir):
    out, tmp = trained_gpt
    logits = _logits(onnx.load(str(tmp / "full.onnx")))
    train(out, model_dir("gpt") / "data.npz", batch=8, steps=4, verbose=False, export=tmp / "run-cut.onnx",
          outputs=logits)
    assert (tmp / "run-cut.onnx").read_bytes() == (tmp / "cut.onnx").read_bytes() or (
        onnx.load(str(tmp / "run-cut.onnx")).graph == onnx.load(str(tmp / "cut.onnx")).graph)


def test_batchnorm_is_exported_in_inference_mode(tmp_path, model_dir, capsys):
    """The cnn (BatchNormalization): the cut graph equals OUT/eval.onnx (the transpiler's eval-mode
    forward, an independent rewrite) fed the same trained parameters and running statistics."""
    out = transpile(model_dir("cnn") / "model.onnx", tmp_path / "out", gpus=2, optimizer="momentum", momentum=0.9,
                    lr=0.05, verbose=False)
    full = tmp_path / "full.onnx"
    train(out, model_dir("cnn") / "data.npz", batch=8, steps=2, verbose=False, export=full, checkpoint=tmp_path / "ck")
    logits = _logits(onnx.load(str(full)))
    assert main(["export", str(out), "--checkpoint", str(tmp_path / "ck"), "-o", str(tmp_path / "cut.onnx"),
                 "--outputs", logits]) == 0
    cut = onnx.load(str(tmp_path / "cut.onnx"))
    assert [i.name for i in cut.graph.input] == ["images"]
    norms = [n for n in cut.graph.node if n.op_type == "BatchNormalization"]
    assert norms and all(len(n.output) == 1 for n in norms)
    assert all(a.i == 0 for n in norms for a in n.attribute if a.name == "training_mode")
    data = {k: v[:5] for k, v in load_data(model_dir("cnn") / "data.npz").items()}
    state = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(full)).graph.initializer}
    expected = _run(_with_output(onnx.load(str(out / "eval.onnx")), logits), {**data, **state})[-1]
    np.testing.assert_allclose(_run(cut, data)[0], expected, rtol=1e-5, atol=1e-6)


def test_outputs_errors_are_one_line(trained_gpt, model_dir, capsys):
    out, tmp = trained_gpt
    data = str(model_dir("gpt") / "data.npz")
    run = ["run", str(out), "--data", data, "--batch", "8", "--steps", "1"]
    for argv, message in (
        (run + ["--outputs", "x"], "--outputs needs --export FILE (the model it cuts)"),
        (run + ["--export", str(tmp / "e.onnx"), "--outputs", "logitz"],
         f"--outputs logitz: not a value of {out}/model.onnx (its outputs: loss)"),
        (run + ["--export", str(tmp / "e.onnx"), "--outputs", "a,,b"], "--outputs 'a,,b': expected value names"),
        (["export", str(out), "--checkpoint", str(tmp / "ck"), "-o", str(tmp / "e.onnx"), "--outputs", "targets2"],
         f"--outputs targets2: not a value of {out}/model.onnx (did you mean 'targets'?)"),
        (["export", str(out), "--checkpoint", str(tmp / "ck"), "-o", str(tmp / "e.onnx"), "--outputs",
          next(t.name for t in onnx.load(str(out / "model.onnx")).graph.initializer)], "is an initializer"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (argv, err)
    assert not (tmp / "e.onnx").exists()
