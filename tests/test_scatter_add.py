"""The row scatter-add on the GPU (runtime/gpu/scatter_add.py).

CPU: the rewrite takes the ScatterND(reduction="add") of the built-in GPT's embedding gradient and
nothing else; a rewritten graph computes what the original did, bit for bit (plain onnxruntime runs
the fused node's function); a ScatterND without the add or over indices not made by an
Unsqueeze(-1) is left alone.
GPU (marked ``gpu``): the kernel equals NumPy's ``np.add.at`` bit for bit (the adds of a row in
index order) for repeated, negative and out-of-range indices, on the first call and on bound calls,
with the output in data's buffer or its own, and on a table the size of GPT-2-small's.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from commands.main import main
from runtime.gpu import cuda_available, gpu_count
from runtime.gpu.scatter_add import DOMAIN, ScatterAddRunner, fuse_scatter_add
from runtime.segments import NativeGroup

ROWS, WIDTH = 11, 6


def _model(reduction: str = "add", axes: int = -1) -> onnx.ModelProto:
    """out = ScatterND(zeros(ROWS, WIDTH), Unsqueeze(ids, [axes]), updates), as the autodiff writes
    an embedding's gradient."""
    nodes = [helper.make_node("Constant", [], ["shape"], value=helper.make_tensor("s", TensorProto.INT64, [2], [ROWS, WIDTH])),
             helper.make_node("ConstantOfShape", ["shape"], ["zeros"],
                              value=helper.make_tensor("z", TensorProto.FLOAT, [1], [0.0])),
             helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("a", TensorProto.INT64, [1], [axes])),
             helper.make_node("Unsqueeze", ["ids", "axes"], ["ids1"]),
             helper.make_node("ScatterND", ["zeros", "ids1", "updates"], ["out"], name="wte/grad", reduction=reduction)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5]),
                                           helper.make_tensor_value_info("updates", TensorProto.FLOAT, [2, 5, WIDTH])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [ROWS, WIDTH])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def test_the_rewrite_computes_what_the_scatter_computed():
    rng = np.random.default_rng(0)
    feeds = {"ids": rng.integers(-ROWS, ROWS, (2, 5)).astype(np.int64),  # repeats and negatives
             "updates": rng.standard_normal((2, 5, WIDTH)).astype(np.float32)}
    feeds["ids"][0, :3] = 4  # one row added three times
    original = _model()
    expected = _run(original, feeds)
    fused = fuse_scatter_add(_model())
    (node,) = [n for n in fused.graph.node if n.name == "wte/grad"]
    assert node.domain == DOMAIN and [(a.name, a.i) for a in node.attribute] == [("zeros", 1)]
    onnx.checker.check_model(fused)
    np.testing.assert_array_equal(_run(fused, feeds), expected)


@pytest.mark.parametrize("reduction, axes", [("none", -1), ("mul", -1), ("add", 0)])
def test_other_scatters_are_left_alone(reduction, axes):
    model = _model(reduction, axes)
    before = [(n.domain, n.op_type) for n in model.graph.node]
    assert [(n.domain, n.op_type) for n in fuse_scatter_add(model).graph.node] == before


def test_the_gpt_step_has_its_embedding_gradient_rewritten(model_dir, tmp_path):
    out = tmp_path / "gpt"
    assert main(["compile", str(model_dir("gpt") / "model.onnx"), "--gpus", "1", "-o", str(out)]) == 0
    step = fuse_scatter_add(onnx.load(str(out / "rank0.onnx")))
    assert [n.op_type for n in step.graph.node if n.op_type == "ScatterND"] == []
    assert len([n for n in step.graph.node if n.domain == DOMAIN]) == 1
    assert len([f for f in step.functions if f.domain == DOMAIN]) == 1


needs_gpu = pytest.mark.skipif(gpu_count() < 1 or not cuda_available(), reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("in_place, zeros", [(False, False), (True, False), (False, True)])
def test_the_kernel_equals_numpy_add_at(in_place, zeros):
    import cupy as cp

    from runtime.gpu.device import GpuDevice

    rows, width = 300, 770  # a width no multiple of the block's threads
    rng = np.random.default_rng(3)
    data = np.zeros((rows, width), np.float32) if zeros else rng.standard_normal((rows, width)).astype(np.float32)
    ids = rng.integers(-rows, rows, (4, 64)).astype(np.int64)
    ids[0, :10] = 7  # one row added ten times
    ids[1, 0], ids[1, 1] = rows, -rows - 1  # outside: nothing added
    updates = rng.standard_normal((4, 64, width)).astype(np.float32)
    inside = (ids >= -rows) & (ids < rows)
    expected = data.copy()
    np.add.at(expected, ids[inside] % rows, updates[inside])
    node = helper.make_node("ScatterAddRows_0", ["data", "ids", "updates"], ["out"], domain=DOMAIN, name="wte/grad",
                            **({"zeros": 1} if zeros else {}))
    device = GpuDevice(0, tf32=False)
    runner = ScatterAddRunner(NativeGroup(0, 0, 3, (node,), ("data", "ids", "updates"), ("out",)), "test", device)
    for call in range(3):  # the first call (allocate), then bound calls into the same buffers
        env = {"data": cp.asarray(data), "ids": cp.asarray(ids[..., None]), "updates": cp.asarray(updates)}
        env["out"] = env["data"] if in_place else cp.full((rows, width), np.nan, np.float32)
        runner.launch(env, allocate=call == 0)
        device.compute.synchronize()
        # bit for bit: each row adds its updates in index order, as np.add.at does
        np.testing.assert_array_equal(cp.asnumpy(env["out"]), expected)


@pytest.mark.gpu
@needs_gpu
def test_a_table_the_size_of_gpt2_with_zipfian_tokens():
    """GPT-2-small's token table and 4 ranks' gathered tokens (--sparse-grads under allreduce), a
    few tokens repeated hundreds of times: equal to np.add.at bit for bit, launch after launch."""
    import cupy as cp

    from runtime.gpu.device import GpuDevice

    rows, width, n = 50304, 768, 4 * 4096
    rng = np.random.default_rng(5)
    ids = np.minimum(rng.zipf(1.3, n) - 1, rows - 1).astype(np.int64)
    assert np.bincount(ids).max() > 500  # the serial case: one row summed from many
    updates = rng.standard_normal((n, width)).astype(np.float32)
    expected = np.zeros((rows, width), np.float32)
    np.add.at(expected, ids, updates)
    node = helper.make_node("ScatterAddRows_0", ["data", "ids", "updates"], ["out"], domain=DOMAIN, name="wte/grad", zeros=1)
    device = GpuDevice(0, tf32=False)
    runner = ScatterAddRunner(NativeGroup(0, 0, 3, (node,), ("data", "ids", "updates"), ("out",)), "test", device)
    env = {"data": cp.zeros((rows, width), np.float32), "ids": cp.asarray(ids[:, None]), "updates": cp.asarray(updates)}
    env["out"] = cp.full((rows, width), np.nan, np.float32)
    for call in range(2):
        runner.launch(env, allocate=call == 0)
        device.compute.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(env["out"]), expected)
    # fewer indices on the same runner (another batch): the scratch follows the sizes
    half = n // 2
    expected = np.zeros((rows, width), np.float32)
    np.add.at(expected, ids[:half], updates[:half])
    env = {"data": cp.zeros((rows, width), np.float32), "ids": cp.asarray(ids[:half, None]),
           "updates": cp.asarray(updates[:half]), "out": cp.full((rows, width), np.nan, np.float32)}
    runner.launch(env, allocate=True)
    device.compute.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(env["out"]), expected)


@pytest.mark.gpu
@needs_gpu
def test_indices_that_are_not_rows_are_refused_naming_the_node():
    import cupy as cp

    from runtime.errors import RunError
    from runtime.gpu.device import GpuDevice

    node = helper.make_node("ScatterAddRows_0", ["data", "ids", "updates"], ["out"], domain=DOMAIN, name="wte/grad")
    runner = ScatterAddRunner(NativeGroup(2, 0, 1, (node,), ("data", "ids", "updates"), ("out",)), "rank0.onnx",
                              GpuDevice(0, tf32=False))
    env = {"data": cp.zeros((4, 3), np.float32), "ids": cp.zeros((2, 2), np.int64), "updates": cp.zeros((2,), np.float32)}
    with pytest.raises(RunError, match=r"rank0.onnx: row scatter-add in segment 2 stage 1: .*'wte/grad': indices must be int64 \(\.\.\., 1\)"):
        runner.launch(env, allocate=True)
