"""``transpile run --ep-option KEY=VALUE``: onnxruntime CUDA execution provider options passed
through to the nccl backend's sessions, checked (runtime.config.parse_ep_options) without a GPU,
and carried to the ranks in their RunConfig."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
from test_runtime_outdir import make_data, write_out

from runtime.cli import add_run_arguments, main, resolve
from runtime.config import RESERVED_EP_OPTIONS, RunConfig, parse_ep_options
from runtime.errors import RunError
from runtime.launcher import LAUNCHERS


def test_options_are_key_value_pairs_with_spaces_trimmed():
    assert parse_ep_options([" prefer_nhwc=1", "cudnn_conv_algo_search = HEURISTIC "]) == {
        "prefer_nhwc": "1", "cudnn_conv_algo_search": "HEURISTIC"}
    assert parse_ep_options([]) == {} and parse_ep_options(None) == {}
    assert parse_ep_options(["a=1", "a=2"]) == {"a": "2"}  # the last one wins, as on a command line
    assert parse_ep_options(["gpu_mem_limit=", "x=a=b"]) == {"gpu_mem_limit": "", "x": "a=b"}


@pytest.mark.parametrize("entry", ["prefer_nhwc", "=1", " =1", ""])
def test_a_malformed_entry_is_a_one_line_error_naming_it(entry):
    with pytest.raises(RunError, match=rf"^--ep-option {entry!r} is not KEY=VALUE \(.*\)$"):
        parse_ep_options(["prefer_nhwc=0", entry])


@pytest.mark.parametrize("key", ["device_id", "user_compute_stream", "has_user_compute_stream", "enable_cuda_graph"])
def test_options_the_runtime_owns_are_refused(key):
    assert key in RESERVED_EP_OPTIONS
    with pytest.raises(RunError, match=rf"^--ep-option '{key}=1': {key} is set by the runtime and cannot be changed "
                                       r"\(reserved: device_id, user_compute_stream, has_user_compute_stream, "
                                       r"enable_cuda_graph\)$"):
        parse_ep_options(["prefer_nhwc=0", f"{key}=1"])


@pytest.fixture
def run_args(tmp_path, monkeypatch):
    """``transpile run`` arguments of a 2-rank OUT, in a process that is no launcher's rank."""
    for launcher in LAUNCHERS:
        monkeypatch.delenv(launcher.rank, raising=False)
    out = write_out(tmp_path / "out", 2, "allreduce")
    np.savez(tmp_path / "d.npz", **make_data())
    return ["run", str(out), "--data", str(tmp_path / "d.npz"), "--batch", "4", "--steps", "1"]


@pytest.mark.parametrize("options, message", [
    (["--ep-option", "prefer_nhwc"], "--ep-option 'prefer_nhwc' is not KEY=VALUE"),
    (["--ep-option", "prefer_nhwc=1", "--ep-option", "device_id=1"],
     "--ep-option 'device_id=1': device_id is set by the runtime and cannot be changed"),
])
def test_ep_option_errors_are_one_line_with_status_2(run_args, capsys, options, message):
    assert main([*run_args, *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"transpile: error: {message}") and err.count("\n") == 1, err


def test_the_options_reach_the_ranks_in_their_run_configuration(run_args, tmp_path):
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args([*run_args[1:], "--ep-option", "prefer_nhwc=1", "--ep-option",
                              "cudnn_conv_algo_search=EXHAUSTIVE"])
    *_, config = resolve(args)
    assert config.ep_options == {"prefer_nhwc": "1", "cudnn_conv_algo_search": "EXHAUSTIVE"}
    config.save(tmp_path / "config.json")
    assert RunConfig.load(tmp_path / "config.json") == config
    assert resolve(parser.parse_args(run_args[1:]))[2].ep_options == {}


def test_the_launch_fields_round_trip_and_default_to_an_outside_launcher(tmp_path):
    config = RunConfig(batch=4, steps=1, lr=0.1, spawned=True, parent="123:456", run_dir=tmp_path)
    assert RunConfig.from_json(config.to_json()) == config
    assert isinstance(RunConfig.from_json(config.to_json()).run_dir, Path)
    plain = RunConfig.from_json({"batch": 4, "steps": 1, "lr": 0.1})  # an older file, or an outside launcher's rank
    assert (plain.spawned, plain.parent, plain.run_dir, plain.ep_options, plain.timeout) == (False, None, None, {}, 300.0)
