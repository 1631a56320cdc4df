"""The CPU backend on bfloat16/float16 graphs (runtime/low_precision.py): onnxruntime's CPU provider
has no bf16 compute kernel, so low-precision nodes run as float32 compute rounded as a GPU rounds
(once per output), and the values between nodes, segments and ranks are float32 holding
low-precision numbers."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from runtime.executor import CpuBackend, OrtCpuSegment
from runtime.low_precision import has_low_precision, lower
from runtime.segments import cut_graph

BF16, FP16, FLOAT = TensorProto.BFLOAT16, TensorProto.FLOAT16, TensorProto.FLOAT
NUMPY = {BF16: ml_dtypes.bfloat16, FP16: np.float16}


def _model(nodes, inputs, outputs, inits=(), opset=22):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _session(model):
    options = ort.SessionOptions()
    options.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _kernel_exists(op: str, n_inputs: int, shape, attrs=None, extra=()) -> bool:
    """Whether onnxruntime's CPU provider runs ``op`` on bf16 tensors (cast in and out inside the
    graph: its Python API takes no bf16 array at all)."""
    nodes = [helper.make_node("Cast", [f"x{i}"], [f"c{i}"], to=BF16) for i in range(n_inputs)]
    nodes.append(helper.make_node(op, [f"c{i}" for i in range(n_inputs)] + [n for n, _ in extra], ["y"], **(attrs or {})))
    nodes.append(helper.make_node("Cast", ["y"], ["z"], to=FLOAT))
    model = _model(nodes, [helper.make_tensor_value_info(f"x{i}", FLOAT, list(shape)) for i in range(n_inputs)],
                   [helper.make_tensor_value_info("z", FLOAT, None)], [numpy_helper.from_array(a, n) for n, a in extra])
    try:
        _session(model).run(None, {f"x{i}": np.ones(shape, np.float32) for i in range(n_inputs)})
        return True
    except Exception:
        return False


def test_onnxruntime_cpu_runs_no_bf16_compute():
    """What the lowering is for (onnxruntime 1.32): bf16 data movement exists on the CPU
    provider, bf16 arithmetic does not; and its Python API refuses bf16 arrays."""
    axes = [("axes", np.array([1], np.int64))]
    missing = {op: not _kernel_exists(op, n, shape, extra=extra) for op, n, shape, extra in [
        ("MatMul", 2, (3, 3), ()), ("Gemm", 2, (3, 3), ()), ("Conv", 2, (1, 1, 3, 3), ()), ("Add", 2, (2, 3), ()),
        ("Mul", 2, (2, 3), ()), ("Softmax", 1, (2, 3), ()), ("ReduceSum", 1, (2, 3), axes), ("Relu", 1, (2, 3), ()),
        ("Erf", 1, (2, 3), ()), ("LayerNormalization", 1, (2, 3), ())]}
    present = {op: _kernel_exists(op, 1, (2, 3), attrs) for op, attrs in [("Transpose", {"perm": [1, 0]}), ("Identity", {})]}
    print(f"\nonnxruntime {ort.__version__} CPU: no bf16 kernel for {sorted(op for op, m in missing.items() if m)}; "
          f"bf16 kernels for {sorted(op for op, p in present.items() if p)}")
    assert missing["MatMul"] and missing["Add"], "onnxruntime gained bf16 CPU kernels: the lowering is still right, only slower"
    model = _model([helper.make_node("Identity", ["x"], ["y"])], [helper.make_tensor_value_info("x", BF16, [2])],
                   [helper.make_tensor_value_info("y", BF16, [2])])
    with pytest.raises(Exception, match="MLDataType|bfloat16|type"):
        _session(model).run(None, {"x": np.ones(2, ml_dtypes.bfloat16)})


def _low_graph(op: str, dtype: int, n_inputs: int, shapes, attrs=None):
    """Float32 inputs cast to ``dtype``, ``op``, its low-precision output as the graph output."""
    nodes = [helper.make_node("Cast", [f"x{i}"], [f"c{i}"], to=dtype) for i in range(n_inputs)]
    nodes.append(helper.make_node(op, [f"c{i}" for i in range(n_inputs)], ["y"], **(attrs or {})))
    return _model(nodes, [helper.make_tensor_value_info(f"x{i}", FLOAT, list(s)) for i, s in enumerate(shapes)],
                  [helper.make_tensor_value_info("y", dtype, None)])


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_matmul_accumulates_in_float32_and_rounds_once(dtype):
    """A low-precision MatMul computes what a GPU's GEMM computes: products of the rounded
    inputs (exact in float32), a float32 sum, the output rounded once. Against the exact sum
    (float64) rounded once: equal but where float32 summation crossed a rounding boundary."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 256), np.float32), rng.standard_normal((256, 48), np.float32)
    lowered = lower(_low_graph("MatMul", dtype, 2, [a.shape, b.shape]))
    assert lowered.graph.output[0].type.tensor_type.elem_type == FLOAT  # the host sees float32
    (y,) = _session(lowered).run(None, {"x0": a, "x1": b})
    low = NUMPY[dtype]
    exact = a.astype(low).astype(np.float64) @ b.astype(low).astype(np.float64)
    expected = exact.astype(np.float32).astype(low).astype(np.float32)
    assert np.array_equal(y, y.astype(low).astype(np.float32)), "outputs must be low-precision numbers"
    differ = y != expected
    assert differ.mean() < 0.01
    ulp = np.abs(expected.astype(low).view(np.uint16).astype(np.int32) - y.astype(low).view(np.uint16).astype(np.int32))
    assert ulp.max() <= 1


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_elementwise_ops_compute_in_float32_and_round_once(op, dtype):
    rng = np.random.default_rng(1)
    x0 = rng.standard_normal((512,), np.float32) * 8
    x1 = rng.standard_normal((512,), np.float32) + 3
    (y,) = _session(lower(_low_graph(op, dtype, 2, [x0.shape, x1.shape]))).run(None, {"x0": x0, "x1": x1})
    low = NUMPY[dtype]
    a, b = x0.astype(low).astype(np.float32), x1.astype(low).astype(np.float32)
    f = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}[op]
    np.testing.assert_array_equal(y, f(a, b).astype(low).astype(np.float32))


def test_casts_round_to_nearest_even_with_overflow_and_specials():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 3.0e38, -3.4e38, 65504, 65519.9, 65520, 1e-8, np.inf, -np.inf, np.nan],
                 np.float32)
    x = np.concatenate([x, np.random.default_rng(2).standard_normal(4096).astype(np.float32) * 100])
    for dtype, low in NUMPY.items():
        model = _model([helper.make_node("Cast", ["x"], ["y"], to=dtype), helper.make_node("Cast", ["y"], ["z"], to=FLOAT)],
                       [helper.make_tensor_value_info("x", FLOAT, [len(x)])],
                       [helper.make_tensor_value_info("y", dtype, None), helper.make_tensor_value_info("z", FLOAT, None)])
        y, z = _session(lower(model)).run(None, {"x": x})
        with np.errstate(over="ignore"):
            expected = x.astype(low).astype(np.float32)
        np.testing.assert_array_equal(y, expected)  # NaN == NaN for assert_array_equal
        np.testing.assert_array_equal(z, expected)


def test_constants_initializers_and_low_inputs_are_widened_exactly():
    third = np.array([1 / 3, -2.5, 1e-3], np.float32).astype(ml_dtypes.bfloat16)
    init = numpy_helper.from_array(third, "w")
    nodes = [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array(0.1, ml_dtypes.bfloat16))),
             helper.make_node("Mul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "k"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", BF16, [3])], [helper.make_tensor_value_info("y", BF16, [3])],
                   [init])
    lowered = lower(model)
    assert not has_low_precision(lowered) and has_low_precision(model)
    assert lower(lowered) is lowered  # lowering is done once
    x = np.array([3.0, 0.5, 1000.0], np.float32)  # bf16 numbers, fed as float32
    (y,) = _session(lowered).run(None, {"x": x})
    w = third.astype(np.float32)
    product = (x * w).astype(ml_dtypes.bfloat16).astype(np.float32)
    k = np.float32(np.array(0.1, ml_dtypes.bfloat16))
    np.testing.assert_array_equal(y, (product + k).astype(ml_dtypes.bfloat16).astype(np.float32))


def test_float32_graphs_are_not_touched():
    model = _model([helper.make_node("MatMul", ["a", "b"], ["y"])],
                   [helper.make_tensor_value_info("a", FLOAT, [2, 2]), helper.make_tensor_value_info("b", FLOAT, [2, 2])],
                   [helper.make_tensor_value_info("y", FLOAT, None)])
    assert lower(model) is model
    assert CpuBackend().prepare_step_graph(model) is model


def test_the_cpu_backend_runs_a_cut_low_precision_graph():
    """A segment whose inputs and outputs are bf16 (a value crossing a cut) runs on the CPU backend
    as float32 arrays holding bf16 numbers."""
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=BF16), helper.make_node("Mul", ["xb", "xb"], ["y"]),
             helper.make_node("Cast", ["y"], ["z"], to=FLOAT)]
    model = _model(nodes, [helper.make_tensor_value_info("x", FLOAT, [4])], [helper.make_tensor_value_info("z", FLOAT, [4])])
    cut = cut_graph(model, 0, "test")
    (segment,) = cut.segments
    x = np.array([1.1, 2.2, -3.3, 300.7], np.float32)
    (z,) = OrtCpuSegment(segment, "test", threads=1).run({"x": x})
    xb = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(z, (xb * xb).astype(ml_dtypes.bfloat16).astype(np.float32))
