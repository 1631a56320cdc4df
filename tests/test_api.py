"""The Python API (graph_transpiler/, docs/api.md): the documented example runs as written; train
equals the in-process simulator step for step; callbacks, errors and the process path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import load_data

from graph_transpiler import export, train, transpile
from runtime import simulate
from runtime.errors import RunError

REPO = Path(__file__).resolve().parents[1]


def test_docs_api_example_runs_as_written(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "api.md").read_text(), re.S)
    assert len(blocks) == 1, "docs/api.md should hold one runnable example"
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "docs/api.md", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out
    assert "final loss" in printed and (tmp_path / "example" / "served.onnx").is_file()


@pytest.fixture(scope="module")
def perceptron_out(tmp_path_factory, model_dir):
    out = tmp_path_factory.mktemp("api") / "out"
    return transpile(model_dir("perceptron") / "model.onnx", out, gpus=2, optimizer="momentum", momentum=0.9,
                     lr=0.01, verbose=False)


def test_train_equals_the_simulator_and_calls_back_per_logged_step(perceptron_out, model_dir):
    data = load_data(model_dir("perceptron") / "data.npz")
    expected = simulate(perceptron_out, data, batch=32, steps=12).losses
    seen = []
    result = train(perceptron_out, data, batch=32, steps=12, log_every=4, callback=seen.append, verbose=False)
    assert [r["step"] for r in seen] == [1, 4, 8, 12] and result.records == seen
    assert [r["loss"] for r in seen] == [expected[s - 1] for s in (1, 4, 8, 12)]
    assert result.final_loss == expected[-1] and result.summary["steps_run"] == 12


def test_train_options_are_checked_like_the_command_line(perceptron_out, model_dir):
    data = model_dir("perceptron") / "data.npz"
    with pytest.raises(RunError, match=r"train\(\): unknown argument 'stpes'.*did you mean 'steps'"):
        train(perceptron_out, data, batch=32, stpes=3)
    with pytest.raises(RunError, match=r"train\(\): argument 'batch' must be an integer, got \"32\""):
        train(perceptron_out, data, batch="32", steps=3)
    with pytest.raises(RunError, match=r"--steps or --epochs is required"):
        train(perceptron_out, data, batch=32)
    with pytest.raises(RunError, match=r"transpile\(\): unknown argument 'optimiser'"):
        transpile(model_dir("perceptron") / "model.onnx", perceptron_out.parent / "x", optimiser="adam")


def test_a_raising_callback_stops_the_run(perceptron_out, model_dir):
    def stop(record):
        if record["step"] >= 2:
            raise KeyboardInterrupt("enough")

    with pytest.raises(KeyboardInterrupt, match="enough"):
        train(perceptron_out, model_dir("perceptron") / "data.npz", batch=32, steps=50, log_every=1, callback=stop,
              verbose=False)


@pytest.mark.slow
def test_train_in_processes_gives_the_same_records(perceptron_out, model_dir, tmp_path):
    data = model_dir("perceptron") / "data.npz"
    here = train(perceptron_out, data, batch=32, steps=6, log_every=3, verbose=False,
                 checkpoint=tmp_path / "a", export=tmp_path / "a.onnx", outputs="prediction")
    seen = []
    there = train(perceptron_out, data, batch=32, steps=6, log_every=3, verbose=False, processes=True,
                  callback=seen.append, checkpoint=tmp_path / "b")
    assert [r["loss"] for r in there.records] == [r["loss"] for r in here.records] and seen == there.records
    assert there.final_loss == here.final_loss
    served = export(perceptron_out, tmp_path / "b", tmp_path / "b.onnx", outputs=["prediction"])
    assert served.read_bytes() == (tmp_path / "a.onnx").read_bytes()
    with pytest.raises(RunError, match="global batch 7 does not split into 2"):
        train(perceptron_out, data, batch=7, steps=1, verbose=False, processes=True)


def test_export_names_a_value_that_is_not_there(perceptron_out, model_dir, tmp_path):
    train(perceptron_out, model_dir("perceptron") / "data.npz", batch=32, steps=2, verbose=False,
          checkpoint=tmp_path / "ck")
    with pytest.raises(RunError, match=r"--outputs predictoin: not a value of .*model.onnx \(did you mean 'prediction'\?\)"):
        export(perceptron_out, tmp_path / "ck", tmp_path / "x.onnx", outputs="predictoin")
    assert not (tmp_path / "x.onnx").exists()
    path = export(perceptron_out, tmp_path / "ck", tmp_path / "y.onnx", outputs="prediction")
    assert path == tmp_path / "y.onnx" and path.stat().st_size > 0
