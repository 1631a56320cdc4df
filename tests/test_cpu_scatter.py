"""The CPU backend's ScatterND(reduction="add") (runtime/cpu_scatter.py): onnxruntime's own kernel
loses updates where indices repeat and it runs on more than one thread; the rewrite sums every
update, exactly, on any number of threads, for index depths 1 and 2, negative indices and a
symbolic batch; a node whose depth is not known keeps the session on one thread."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from runtime.cpu_scatter import race_free_scatters

ROWS, WIDTH = 300, 16


def _model(data_shape: list, index_shape: list, update_shape: list) -> onnx.ModelProto:
    node = helper.make_node("ScatterND", ["data", "idx", "upd"], ["out"], reduction="add")
    graph = helper.make_graph(
        [node], "scatter",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, data_shape),
         helper.make_tensor_value_info("idx", TensorProto.INT64, index_shape),
         helper.make_tensor_value_info("upd", TensorProto.FLOAT, update_shape)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, data_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model: onnx.ModelProto, feeds: dict, threads: int) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _expected(data: np.ndarray, idx: np.ndarray, upd: np.ndarray) -> np.ndarray:
    out = data.astype(np.float64)
    k = idx.shape[-1]
    np.add.at(out, tuple(np.moveaxis(idx.reshape(-1, k), -1, 0)), upd.reshape(-1, *data.shape[k:]))
    return out.astype(np.float32)


def test_the_rewrite_sums_every_repeated_update_on_several_threads():
    """The token embedding's case: many tokens, few rows, updates that sum exactly in float32."""
    rng = np.random.default_rng(0)
    tokens = 8192
    idx = rng.integers(-ROWS, ROWS, (4, tokens // 4, 1)).astype(np.int64)  # a batch axis; negatives too
    upd = rng.integers(-4, 5, (4, tokens // 4, WIDTH)).astype(np.float32)  # exact sums in any order
    data = rng.integers(-4, 5, (ROWS, WIDTH)).astype(np.float32)
    model = _model([ROWS, WIDTH], ["batch", "tokens", 1], ["batch", "tokens", WIDTH])
    rewritten, racy = race_free_scatters(model)
    assert not racy and "ScatterND" not in {n.op_type for n in rewritten.graph.node}
    want = _expected(data, idx, upd)
    feeds = {"data": data, "idx": idx, "upd": upd}
    assert all(np.array_equal(_run(rewritten, feeds, 4), want) for _ in range(20))


def test_index_tuples_of_two_components():
    """GatherND's gradient: tuples into data's two leading axes, a trailing axis kept whole."""
    rng = np.random.default_rng(1)
    data = rng.integers(-4, 5, (6, 7, 3)).astype(np.float32)
    idx = np.stack([rng.integers(-6, 6, 500), rng.integers(-7, 7, 500)], axis=-1).astype(np.int64)
    upd = rng.integers(-4, 5, (500, 3)).astype(np.float32)
    rewritten, racy = race_free_scatters(_model([6, 7, 3], [500, 2], [500, 3]))
    assert not racy
    np.testing.assert_array_equal(_run(rewritten, {"data": data, "idx": idx, "upd": upd}, 3), _expected(data, idx, upd))


def test_onnxruntimes_own_kernel_is_what_the_rewrite_replaces():
    """Why the rewrite exists, checked against the installed onnxruntime: its ScatterND(add) on 2
    threads loses updates (skipped where a later onnxruntime no longer does in 40 tries)."""
    rng = np.random.default_rng(2)
    idx = rng.integers(0, ROWS, (32768, 1)).astype(np.int64)
    feeds = {"data": np.zeros((ROWS, WIDTH), np.float32), "idx": idx, "upd": np.ones((32768, WIDTH), np.float32)}
    model = _model([ROWS, WIDTH], [32768, 1], [32768, WIDTH])
    want = _expected(feeds["data"], idx, feeds["upd"])
    lost = sum(not np.array_equal(_run(model, feeds, 2), want) for _ in range(40))
    if lost == 0:
        pytest.skip(f"onnxruntime {ort.__version__}'s ScatterND(add) lost no update in 40 runs on 2 threads")
    rewritten, _ = race_free_scatters(model)
    assert all(np.array_equal(_run(rewritten, feeds, 2), want) for _ in range(40))


def test_a_scatter_of_unknown_depth_stays_and_is_reported():
    model = _model([ROWS, WIDTH], ["n", "depth"], ["n", WIDTH])
    rewritten, racy = race_free_scatters(model)
    assert racy and [n.op_type for n in rewritten.graph.node] == ["ScatterND"]


def test_a_graph_without_one_is_left_alone():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph)
    assert race_free_scatters(model) == (model, False)


def test_a_scatter_of_single_elements():
    """Index tuples as long as data's rank: each update is one element (the trailing shape empty)."""
    rng = np.random.default_rng(3)
    data = rng.integers(-4, 5, (10,)).astype(np.float32)
    idx = rng.integers(-10, 10, (50, 1)).astype(np.int64)
    upd = rng.integers(-4, 5, (50,)).astype(np.float32)
    rewritten, racy = race_free_scatters(_model([10], [50, 1], [50]))
    assert not racy
    np.testing.assert_array_equal(_run(rewritten, {"data": data, "idx": idx, "upd": upd}, 2), _expected(data, idx, upd))
