"""runtime/ort_custom_ops.py: Python kernels run inside onnxruntime sessions as custom ops (checked
on the CPU execution provider, through the same C API table and structs the CUDA EP uses)."""

from __future__ import annotations

import shutil

import numpy as np
import onnxruntime as ort
import pytest
from conftest import one_graph_model
from onnx import TensorProto, helper

from runtime import ort_custom_ops

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the custom-op library")


def _array(ptr: int, shape, dtype) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    ctype = np.ctypeslib.as_ctypes_type(np.dtype(dtype))
    return np.ctypeslib.as_array((ctype * count).from_address(ptr)).reshape(shape)


def _model(nodes, inputs, outputs, domain="test.python"):
    model = one_graph_model(nodes, inputs, outputs)
    model.opset_import.append(helper.make_opsetid(domain, 1))
    return model


def _session(model, ops, domain="test.python"):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    ort_custom_ops.register(options, domain, ops)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_python_ops_compute_inside_the_session_between_standard_ops():
    calls = []

    def scale_rows(ctx):  # y = x * w[row], w gathered by an int64 index per row
        (shape, elem), (index_shape, index_elem) = ctx.input_shape(0), ctx.input_shape(1)
        calls.append((shape, elem, index_shape, index_elem, ctx.gpu_stream()))
        x = _array(ctx.input_ptr(0), shape, np.float32)
        index = _array(ctx.input_ptr(1), index_shape, np.int64)
        _array(ctx.output_ptr(0, shape), shape, np.float32)[...] = x * (index[:, None] + 1)

    def twice(ctx):
        shape, _ = ctx.input_shape(0)
        _array(ctx.output_ptr(0, shape), shape, np.float32)[...] = 2 * _array(ctx.input_ptr(0), shape, np.float32)

    f = TensorProto.FLOAT
    nodes = [helper.make_node("Neg", ["x"], ["n"]),
             helper.make_node("ScaleRows", ["n", "index"], ["s"], domain="test.python"),
             helper.make_node("Twice", ["s"], ["t"], domain="test.python"),
             helper.make_node("Relu", ["t"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", f, [3, 4]),
                           helper.make_tensor_value_info("index", TensorProto.INT64, [3])],
                   [helper.make_tensor_value_info("y", f, [3, 4])])
    ops = [ort_custom_ops.PythonOp("ScaleRows", [TensorProto.FLOAT, TensorProto.INT64], [TensorProto.FLOAT], scale_rows),
           ort_custom_ops.PythonOp("Twice", [TensorProto.FLOAT], [TensorProto.FLOAT], twice)]
    session = _session(model, ops)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.normal(size=(3, 4)).astype(np.float32)
        index = np.array([0, 2, 1], np.int64)
        (y,) = session.run(None, {"x": x, "index": index})
        np.testing.assert_allclose(y, np.maximum(2 * (-x * (index[:, None] + 1)), 0), rtol=1e-6)
    assert calls == [((3, 4), TensorProto.FLOAT, (3,), TensorProto.INT64, 0)] * 3  # the CPU EP has no stream


def test_an_exception_in_a_python_op_fails_the_run_with_its_message():
    def broken(ctx):
        raise ValueError("the kernel's own complaint")

    f = TensorProto.FLOAT
    model = _model([helper.make_node("Broken", ["x"], ["y"], domain="test.python")],
                   [helper.make_tensor_value_info("x", f, [2])], [helper.make_tensor_value_info("y", f, [2])])
    session = _session(model, [ort_custom_ops.PythonOp("Broken", [f], [f], broken, label="rank0.onnx: segment 2: 'n7'")])
    with pytest.raises(Exception, match="rank0.onnx: segment 2: 'n7': ValueError: the kernel's own complaint"):
        session.run(None, {"x": np.zeros(2, np.float32)})


def test_an_exception_in_a_getter_is_reported_and_onnxruntime_gets_a_defined_value(capfd):
    """An op whose input-type getter raises: the guarded callback prints the traceback and returns
    its default (0: any type), and the session still runs the op."""
    f = TensorProto.FLOAT

    def copy(ctx):
        _array(ctx.output_ptr(0, (2,)), (2,), np.float32)[...] = _array(ctx.input_ptr(0), (2,), np.float32)

    model = _model([helper.make_node("Copy", ["x"], ["y"], domain="test.python")],
                   [helper.make_tensor_value_info("x", f, [2])], [helper.make_tensor_value_info("y", f, [2])])
    op = ort_custom_ops.PythonOp("Copy", _RaisingList([f]), [f], copy)
    x = np.array([1.5, -2.0], np.float32)
    np.testing.assert_array_equal(_session(model, [op]).run(None, {"x": x})[0], x)
    assert "IndexError: the getter's own failure" in capfd.readouterr().err


class _RaisingList(list):
    """A list whose items cannot be read (its length can)."""

    def __getitem__(self, index):
        raise IndexError("the getter's own failure")


def test_sessions_each_get_their_own_ops():
    f = TensorProto.FLOAT
    model = _model([helper.make_node("Fill", ["x"], ["y"], domain="test.python")],
                   [helper.make_tensor_value_info("x", f, [2])], [helper.make_tensor_value_info("y", f, [2])])

    def fill(value):
        def compute(ctx):
            _array(ctx.output_ptr(0, (2,)), (2,), np.float32)[...] = value
        return compute

    first = _session(model, [ort_custom_ops.PythonOp("Fill", [f], [f], fill(1.0))])
    second = _session(model, [ort_custom_ops.PythonOp("Fill", [f], [f], fill(7.0))])
    x = np.zeros(2, np.float32)
    assert first.run(None, {"x": x})[0].tolist() == [1.0, 1.0]
    assert second.run(None, {"x": x})[0].tolist() == [7.0, 7.0]


def test_an_in_place_hint_lets_the_output_share_its_dead_input_buffer():
    """``may_inplace``: onnxruntime gives the output the buffer of an input no later node reads, and
    a buffer of its own where a later node still reads the input; the op computes right either way."""
    seen = []

    def add_one(ctx):
        shape, _ = ctx.input_shape(1)
        x, y = ctx.input_ptr(1), ctx.output_ptr(0, shape)
        seen.append(x == y)
        _array(y, shape, np.float32)[...] = _array(x, shape, np.float32) + 1

    f = TensorProto.FLOAT
    vi = [helper.make_tensor_value_info(n, f, [4, 8]) for n in ("x", "y", "z")]
    for later_reader, shared in ((False, True), (True, False)):
        seen.clear()
        nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Abs", ["x"], ["m"]),  # not one value (CSE)
                 helper.make_node("AddOne", ["m", "n"], ["a"], domain="test.python"),
                 helper.make_node("Add", ["a", "n" if later_reader else "a"], ["y"]), helper.make_node("Neg", ["m"], ["z"])]
        model = _model(nodes, vi[:1], vi[1:])
        # Shapes known where the session plans its buffers: it shares only buffers of one size.
        model.graph.value_info.extend(helper.make_tensor_value_info(n, f, [4, 8]) for n in ("n", "m", "a"))
        op = ort_custom_ops.PythonOp("AddOne", [f, f], [f], add_one, may_inplace=((1, 0),))
        x = np.arange(-16, 16, dtype=np.float32).reshape(4, 8)
        y, z = _session(model, [op]).run(None, {"x": x})
        np.testing.assert_array_equal(y, (1 - x) + (-x if later_reader else 1 - x))
        np.testing.assert_array_equal(z, -np.abs(x))
        assert seen == [shared], (later_reader, seen)
