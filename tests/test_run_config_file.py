"""``transpile run --config FILE.json`` (runtime/options_file.py): every run option from a file, the
command line over it, one-line errors naming the file and the key."""

from __future__ import annotations

import json
import re

import pytest

from commands.main import main, parse
from runtime import options_file
from runtime.errors import RunError
from runtime.schedule import Schedule


def _args(tmp_path, values, *flags):
    path = tmp_path / "run.json"
    path.write_text(values if isinstance(values, str) else json.dumps(values))
    args = parse(["run", str(tmp_path / "out"), "--config", str(path), *flags])
    return options_file.complete(args), path


def test_every_run_option_can_come_from_the_file(tmp_path):
    values = {"data": "d.npz", "batch": 64, "steps": 100, "lr": 0.5, "lr-schedule": "step", "lr_step_size": 10,
              "shuffle": True, "seed": 3, "keep-last": 4, "ep_option": ["prefer_nhwc=1"], "timeout": 5,
              "log_every": None}
    args, _ = _args(tmp_path, values)
    assert (args.data, args.batch, args.steps, args.epochs, args.lr) == ("d.npz", 64, 100, None, 0.5)
    assert (args.lr_schedule, args.lr_step_size, args.shuffle, args.seed) == ("step", 10, True, 3)
    assert (args.keep_checkpoints, args.ep_option, args.timeout, args.log_every) == (4, ["prefer_nhwc=1"], 5.0, 10)
    assert args.export is None and args.progress == "auto" and args.no_tf32 is False  # defaults


def test_the_command_line_overrides_the_file(tmp_path):
    values = {"data": "d.npz", "batch": 64, "steps": 100, "seed": 3, "ep-option": ["a=1"]}
    args, _ = _args(tmp_path, values, "--batch", "8", "--seed", "0", "--ep-option", "b=2")
    assert (args.batch, args.seed, args.steps, args.ep_option) == (8, 0, 100, ["b=2"])
    args, _ = _args(tmp_path, values, "--epochs", "2")  # drops the file's steps: they exclude each other
    assert (args.steps, args.epochs) == (None, 2.0)


def test_without_a_file_the_defaults_and_required_options_are_the_same(tmp_path):
    args = options_file.complete(parse(["run", "out", "--data", "d.npz", "--batch", "4", "--steps", "2"]))
    assert (args.seed, args.log_every, args.lr_schedule, args.keep_checkpoints, args.shuffle) == (0, 10, "constant", 2, False)
    with pytest.raises(RunError, match=r"^--batch is required \(on the command line, or as \"batch\" in --config FILE\)$"):
        options_file.complete(parse(["run", "out", "--data", "d.npz", "--steps", "2"]))


@pytest.mark.parametrize("values, message", [
    ({"dta": "d.npz"}, r"unknown key 'dta': not an option of transpile run \(did you mean 'data'\?\)"),
    ({"out": "x"}, r"unknown key 'out': not an option of transpile run \(OUT is given on the command line\)"),
    ({"batch": "64"}, r"key 'batch' must be an integer, got \"64\" \(a string\)"),
    ({"batch": 6.5}, r"key 'batch' must be an integer, got 6.5 \(a number\)"),
    ({"lr": True}, r"key 'lr' must be a number, got true \(a boolean\)"),
    ({"shuffle": "yes"}, r"key 'shuffle' must be true or false"),
    ({"progress": "fancy"}, r"key 'progress' must be one of 'auto', 'bar', 'lines'"),
    ({"ep-option": [1]}, r"key 'ep-option' must be a string or a list of strings"),
    ({"keep-last": 1, "keep_checkpoints": 2}, r"keys 'keep-last' and 'keep_checkpoints' name the same option"),
    ({"data": "d", "batch": 4, "steps": 1, "epochs": 1}, r"'steps' and 'epochs' exclude each other"),
    ({"data": "d", "batch": 4}, r"--steps or --epochs is required \(on the command line, or in --config .*run.json\)"),
    ("[1, 2]", r"expected a JSON object of run options"),
    ("{\"batch\": 4,}", r"not valid JSON: .* \(line 1, column \d+\)"),
])
def test_errors_name_the_file_and_the_key(tmp_path, values, message):
    with pytest.raises(RunError) as caught:
        _args(tmp_path, values)
    text = str(caught.value)
    assert "\n" not in text and re.search(message, text), text
    if "required" not in message:
        assert text.startswith(f"--config {tmp_path / 'run.json'}: ")


def test_transpile_run_reads_the_file(tmp_path, model_dir, capsys):
    """One rank runs in this process: the file's options train, the flag overrides its steps."""
    model = model_dir("perceptron")
    assert main([str(model / "model.onnx"), "-o", str(tmp_path / "out")]) == 0
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"data": str(model / "data.npz"), "batch": 16, "steps": 50, "log-every": 1,
                                  "lr_schedule": "cosine", "metrics": str(tmp_path / "m.jsonl")}))
    assert main(["run", str(tmp_path / "out"), "--config", str(config), "--steps", "3", "--progress", "lines"]) == 0
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert [json.loads(line).get("step") for line in lines[:-1]] == [1, 2, 3]
    capsys.readouterr()
    config.write_text(json.dumps({"data": str(model / "data.npz"), "batch": 16, "steps": 3, "lr_step_size": 2}))
    assert main(["run", str(tmp_path / "out"), "--config", str(config)]) == 2
    assert capsys.readouterr().err.strip() == ("transpile: error: --lr-step-size is not used by --lr-schedule constant "
                                               "(only by step); remove it or choose that schedule")
    assert Schedule().kind == "constant"
