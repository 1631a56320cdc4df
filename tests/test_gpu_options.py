"""GRAPH_TRANSPILER_CUDA_EP_OPTIONS: onnxruntime CUDA EP options passed through to the sessions,
parsed without a GPU."""

from __future__ import annotations

import pytest

from runtime.errors import RunError
from runtime.gpu.backend import parse_provider_options


def test_options_are_key_value_pairs_with_spaces_and_empty_entries_ignored():
    assert parse_provider_options(" prefer_nhwc=1, cudnn_conv_algo_search=HEURISTIC,,") == {
        "prefer_nhwc": "1", "cudnn_conv_algo_search": "HEURISTIC"}
    assert parse_provider_options("") == {}
    assert parse_provider_options("a=1,a=2") == {"a": "2"}  # the last one wins, as on a command line


@pytest.mark.parametrize("text", ["prefer_nhwc", "=1", "a=1,b"])
def test_a_malformed_entry_is_a_one_line_error_naming_it(text):
    with pytest.raises(RunError, match=r"GRAPH_TRANSPILER_CUDA_EP_OPTIONS: '.*' is not key=value"):
        parse_provider_options(text)


@pytest.mark.parametrize("key", ["device_id", "user_compute_stream", "has_user_compute_stream", "enable_cuda_graph"])
def test_options_the_runtime_owns_are_refused(key):
    with pytest.raises(RunError, match=f"'{key}' is set by the runtime and cannot be changed"):
        parse_provider_options(f"prefer_nhwc=0,{key}=1")
