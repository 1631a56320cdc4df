"""LayerNormalization as a native node (runtime/gpu/layernorm_casts.py), on CPU: the rewrite makes
each training LayerNorm over the last axis one node, takes a Cast to bfloat16 after it in (its Shape
readers then read the Cast's value), and the fused nodes' functions compute what the replaced nodes
computed, bit for bit (plain onnxruntime runs both); a LayerNorm over another axis, of another
dtype or without its statistics is left alone; on the built-in GPT's step graphs (bf16 and fp32)
every LayerNorm is fused and every fused node's inputs and outputs have static float32 or bfloat16
types (what in_session.py needs to take it). The kernel: tests/test_gpu_layernorm.py."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from commands.main import main
from runtime.gpu.layernorm_casts import DOMAIN, fold_layernorms
from runtime.specialize import specialize, static_values

SHAPE, WIDTH = (2, 3, 8), (8,)


def _model(y_readers: str = "Cast", axis: int = -1, dtype: int = TensorProto.FLOAT, stats: bool = True,
           bias: bool = True, cast_to: int = TensorProto.BFLOAT16, y_output: bool = False, stash_type: int = 1,
           scale_width: int | None = None) -> onnx.ModelProto:
    """x -> LayerNormalization -> y, read as ``y_readers`` says: "Cast" (a Cast to ``cast_to`` and a
    Shape), "Cast+Add" (and an Add of y), "Add" (an Add alone); y a graph output too where
    ``y_output``; every value widened to float32 at the end (onnxruntime's Python API takes no
    bfloat16)."""
    outs = ["y", "mean", "inv"] if stats else ["y"]
    nodes = [helper.make_node("LayerNormalization", ["x", "scale", "bias"] if bias else ["x", "scale"], outs,
                              name="ln", axis=axis, epsilon=1e-5, stash_type=stash_type),
             helper.make_node("Shape", ["y"], ["y_shape"])]
    results = [("y_shape", TensorProto.INT64, [3])] + ([("y", dtype, list(SHAPE))] if y_output else [])
    if "Cast" in y_readers:
        nodes += [helper.make_node("Cast", ["y"], ["yb"], to=cast_to),
                  helper.make_node("Cast", ["yb"], ["y_round"], to=TensorProto.FLOAT)]
        results.append(("y_round", TensorProto.FLOAT, list(SHAPE)))
    if "Add" in y_readers:
        nodes.append(helper.make_node("Add", ["y", "y"], ["y2"]))
        results.append(("y2", dtype, list(SHAPE)))
    if stats:
        results += [("mean", TensorProto.FLOAT, [*SHAPE[:-1], 1]), ("inv", TensorProto.FLOAT, [*SHAPE[:-1], 1])]
    width = [scale_width or SHAPE[-1]] if axis == -1 else list(SHAPE[axis:])
    inputs = [helper.make_tensor_value_info("x", dtype, SHAPE), helper.make_tensor_value_info("scale", dtype, width),
              helper.make_tensor_value_info("bias", dtype, width)][:3 if bias else 2]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(*r) for r in results])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(model)


def _run(model: onnx.ModelProto) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=SHAPE) * 3 + 1, "scale": rng.normal(size=WIDTH), "bias": rng.normal(size=WIDTH)}
    names = {i.name for i in model.graph.input}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {k: v.astype(np.float32) for k, v in feeds.items() if k in names})


@pytest.mark.parametrize("bias", [True, False])
def test_the_fused_node_takes_the_cast_in_and_computes_what_the_nodes_computed(bias):
    expected = _run(_model(bias=bias))
    fused = fold_layernorms(_model(bias=bias))
    onnx.checker.check_model(fused)
    node = next(n for n in fused.graph.node if n.domain == DOMAIN)
    assert node.op_type.startswith("LayerNormalization") and list(node.output) == ["yb", "mean", "inv"]
    assert [n.op_type for n in fused.graph.node] == [node.op_type, "Shape", "Cast"]  # the Cast to bf16 went
    assert next(n for n in fused.graph.node if n.op_type == "Shape").input[0] == "yb"
    assert not {"y"} & {name for n in fused.graph.node for name in [*n.input, *n.output]}
    for got, want in zip(_run(fused), expected):
        np.testing.assert_array_equal(got, want)


def test_a_float32_output_read_otherwise_keeps_its_cast_and_the_node_writes_float32():
    expected = _run(_model("Cast+Add"))
    fused = fold_layernorms(_model("Cast+Add"))
    node = next(n for n in fused.graph.node if n.domain == DOMAIN)
    assert list(node.output) == ["y", "mean", "inv"]
    assert sum(n.op_type == "Cast" for n in fused.graph.node) == 2
    for got, want in zip(_run(fused), expected):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("variant", [{"cast_to": TensorProto.FLOAT16}, {"y_output": True}])
def test_a_cast_not_to_bf16_or_a_y_read_as_an_output_stays_and_the_node_writes_float32(variant):
    expected = _run(_model(**variant))
    fused = fold_layernorms(_model(**variant))
    node = next(n for n in fused.graph.node if n.domain == DOMAIN)
    assert node.output[0] == "y" and sum(n.op_type == "Cast" for n in fused.graph.node) == 2
    for got, want in zip(_run(fused), expected):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("variant", [{"axis": 1}, {"dtype": TensorProto.DOUBLE, "y_readers": "Add"}, {"stats": False},
                                     {"stash_type": 0}, {"scale_width": 1}])
def test_a_layernorm_the_kernel_does_not_compute_is_left_alone(variant):
    model = _model(**variant)
    before = [(n.domain, n.op_type) for n in model.graph.node]
    assert [(n.domain, n.op_type) for n in fold_layernorms(model).graph.node] == before


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_every_layernorm_of_the_gpt_step_is_fused(model_dir, tmp_path, precision):
    out = tmp_path / precision
    assert main(["compile", str(model_dir("gpt") / "model.onnx"), "--gpus", "1", "--precision", precision,
                 "--optimizer", "adamw", "-o", str(out)]) == 0
    step = onnx.load(str(out / "rank0.onnx"))
    layernorms = sum(n.op_type == "LayerNormalization" for n in step.graph.node)
    assert layernorms > 0
    fused = fold_layernorms(step)
    nodes = [n for n in fused.graph.node if n.domain == DOMAIN]
    assert len(nodes) == layernorms and not any(n.op_type == "LayerNormalization" for n in fused.graph.node)
    plan = json.loads((out / "plan.json").read_text())
    shapes = {d["name"]: tuple(4 if isinstance(n, str) else n for n in d["shape"]) for d in plan["data_inputs"]}
    known = static_values(specialize(fused, shapes).graph)
    taken = {TensorProto.FLOAT, TensorProto.BFLOAT16}
    for node in nodes:
        assert all(known[name][1] in taken for name in [*node.input, *node.output]), node.name
        assert known[node.output[0]][1] == (TensorProto.BFLOAT16 if precision == "bf16" else TensorProto.FLOAT)
