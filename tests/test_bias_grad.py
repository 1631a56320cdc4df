"""A bias gradient summed in one launch on the GPU (runtime/gpu/bias_grad.py).

CPU: the rewrite takes ReduceSum over leading axes of a Cast to float32 that only it reads, or of
a float32 value whose rows are at least 32 wide, and the fused node's function computes what the
nodes computed, bit for bit (plain onnxruntime runs both); a sum over other axes, or a Cast read
elsewhere, is left alone; on the GPT's step graphs it takes every bias gradient (bf16: each
attention's query, key and value from bf16).
GPU (marked ``gpu``): the kernels equal a float64 sum of the (widened) values within float32
rounding, the same bits on every call, keepdims or not.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from commands.main import main
from runtime.gpu import cuda_available, gpu_count
from runtime.gpu.bias_grad import DOMAIN, BiasGradRunner, fuse_bias_grads
from runtime.gpu.elementwise_steps import round_bf16_numpy, widen_bf16_numpy
from runtime.segments import NativeGroup


def _model(axes=(0, 1), second_reader: bool = False) -> onnx.ModelProto:
    """sum = ReduceSum(Cast(Cast(x, bf16), float32), axes): x fed as float32 (onnxruntime's Python
    API takes no bfloat16) and rounded to bf16 first."""
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
             helper.make_node("Cast", ["xb"], ["wide"], to=TensorProto.FLOAT, name="dq/up"),
             helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("a", TensorProto.INT64, [len(axes)], axes)),
             helper.make_node("ReduceSum", ["wide", "axes"], ["sum"], keepdims=0, name="bias/grad")]
    outputs = [helper.make_tensor_value_info("sum", TensorProto.FLOAT, [d for i, d in enumerate((3, 5, 7)) if i not in axes])]
    if second_reader:
        nodes.append(helper.make_node("Relu", ["wide"], ["other"]))
        outputs.append(helper.make_tensor_value_info("other", TensorProto.FLOAT, [3, 5, 7]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, 7])], outputs)
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                                               ir_version=10))


def test_the_rewrite_computes_what_the_pair_computed():
    x = np.random.default_rng(0).standard_normal((3, 5, 7)).astype(np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})  # noqa: E731
    expected = run(_model())
    fused = fuse_bias_grads(_model())
    onnx.checker.check_model(fused)
    assert [n.op_type for n in fused.graph.node] == ["Cast", "Constant", "BiasGrad_0"]
    assert [n.input[0] for n in fused.graph.node if n.domain == DOMAIN] == ["xb"]
    np.testing.assert_array_equal(run(fused)[0], expected[0])


def test_a_cast_from_int64_stays_and_the_sum_reads_its_float32_value():
    """The kernels read bfloat16 or float32: an int64 value's Cast is not folded in (the node would
    be taken into the session, then refused by the runner); its float32 result is summed."""
    nodes = [helper.make_node("Cast", ["ids"], ["wide"], to=TensorProto.FLOAT),
             helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("a", TensorProto.INT64, [1], [0])),
             helper.make_node("ReduceSum", ["wide", "axes"], ["sum"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [64, 40])],
                              [helper.make_tensor_value_info("sum", TensorProto.FLOAT, [40])])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                                                ir_version=10))
    fused = fuse_bias_grads(model)
    assert [(n.op_type, n.input[0]) for n in fused.graph.node if n.op_type != "Constant"] == [("Cast", "ids"),
                                                                                               ("BiasGrad_0", "wide")]


@pytest.mark.parametrize("axes, second_reader", [((1,), False), ((0, 2), False), ((0, 1), True)])
def test_other_sums_are_left_alone(axes, second_reader):
    model = _model(axes, second_reader)
    before = [n.op_type for n in model.graph.node]
    assert [n.op_type for n in fuse_bias_grads(model).graph.node] == before


def test_a_float32_sum_over_wide_rows_is_taken_and_computes_what_it_computed():
    """ReduceSum over leading axes of a float32 value whose rows are at least 32 wide (its type
    known): one node reading it, its function the same sum bit for bit; rows of 7 are left alone."""
    def model(width: int) -> onnx.ModelProto:
        nodes = [helper.make_node("Relu", ["x"], ["r"]),
                 helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("a", TensorProto.INT64, [2], (0, 1))),
                 helper.make_node("ReduceSum", ["r", "axes"], ["sum"], keepdims=0)]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5, width])],
                                  [helper.make_tensor_value_info("sum", TensorProto.FLOAT, [width])])
        return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                                                                   ir_version=10))

    x = np.random.default_rng(1).standard_normal((3, 5, 40)).astype(np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})  # noqa: E731
    fused = fuse_bias_grads(model(40))
    onnx.checker.check_model(fused)
    assert [(n.op_type, list(n.input)) for n in fused.graph.node if n.domain == DOMAIN] == [("BiasGrad_0", ["r", "axes"])]
    np.testing.assert_array_equal(run(fused)[0], run(model(40))[0])
    assert not any(n.domain == DOMAIN for n in fuse_bias_grads(model(7)).graph.node)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_gpt_step_sums_every_bias_gradient_in_one_launch(model_dir, tmp_path, precision):
    """bf16: the attention's query, key and value biases from bf16 (4 blocks), the others from
    float32; fp32: every one from float32. No ReduceSum over leading axes is left to onnxruntime (the
softmax's and the broadcast MatMuls' sums over other axes stay)."""
    out = tmp_path / "gpt"
    assert main(["compile", str(model_dir("gpt") / "model.onnx"), "--gpus", "1", "--precision", precision,
                 "-o", str(out)]) == 0
    step = fuse_bias_grads(onnx.load(str(out / "rank0.onnx")))
    types = {v.name: v.type.tensor_type.elem_type for v in [*step.graph.input, *step.graph.value_info]}
    inputs = [types.get(n.input[0]) for n in step.graph.node if n.domain == DOMAIN]
    assert inputs.count(TensorProto.BFLOAT16) == (12 if precision == "bf16" else 0)
    assert inputs.count(TensorProto.FLOAT) >= 12  # each block's three other biases
    axes = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t).reshape(-1).tolist()
            for n in step.graph.node if n.op_type == "Constant" and n.attribute[0].name == "value"}
    leading = [n.name for n in step.graph.node if n.op_type == "ReduceSum" and axes.get(n.input[1], [-1])[0] == 0]
    assert not leading, leading


needs_gpu = pytest.mark.skipif(gpu_count() < 1 or not cuda_available(), reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
# GPT-2-small's rows (4 columns a thread, whole strips of 128), odd widths (a column a thread), and
# a width of 200 (4 columns a thread, the last strip partly filled).
@pytest.mark.parametrize("shape, lead", [((2, 2048, 768), 2), ((1000, 37), 1), ((5, 3), 1), ((300, 200), 1)])
def test_the_kernels_equal_a_float64_sum(shape, lead, dtype):
    import cupy as cp

    from runtime.gpu.device import GpuDevice

    values = np.random.default_rng(1).standard_normal(shape).astype(np.float32) * 3
    bits = round_bf16_numpy(values) if dtype == "bfloat16" else values
    wide = widen_bf16_numpy(bits) if dtype == "bfloat16" else values
    expected = wide.astype(np.float64).reshape(int(np.prod(shape[:lead])), -1).sum(axis=0)
    node = helper.make_node("BiasGrad_0", ["x", "axes"], ["sum"], domain=DOMAIN, keepdims=0)
    device = GpuDevice(0, tf32=False)
    runner = BiasGradRunner(NativeGroup(0, 0, 1, (node,), ("x", "axes"), ("sum",)), "test", device)
    env = {"x": cp.asarray(bits), "axes": cp.arange(lead, dtype=cp.int64)}
    results = []
    for call in range(2):
        env["sum"] = cp.full(shape[lead:], np.nan, np.float32)
        runner.launch(env, allocate=call == 0)
        device.compute.synchronize()
        results.append(cp.asnumpy(env["sum"]))
    np.testing.assert_allclose(results[0].reshape(-1), expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(results[0], results[1])
