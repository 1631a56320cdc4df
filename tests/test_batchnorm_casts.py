"""BatchNorm reading and writing bfloat16 (runtime/gpu/batchnorm_casts.py), on CPU: the rewrite
folds the casts around each training BatchNorm node and the fused nodes' functions compute what the
casts and the node computed, bit for bit (plain onnxruntime runs both); a node whose output is read
by anything but one Cast to bfloat16 is left alone; on the bf16 ResNet's step graph every BatchNorm
and its gradient is fused, no float32 copy of an activation is left, and every fused node's inputs
and outputs have static float32 or bfloat16 types (what in_session.py needs to take it). The
kernels themselves: tests/test_gpu_batchnorm.py."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from conftest import cpu_and_gpu_losses, with_a_body_reading
from onnx import TensorProto, helper

from commands.main import main
from contract.ops import BATCHNORM_DOMAIN, BATCHNORM_TRAINING, BATCHNORM_TRAINING_GRAD
from runtime.gpu import cuda_available, gpu_count
from runtime.gpu.batchnorm_casts import DOMAIN, fold_batchnorm_casts
from runtime.low_precision import lower
from runtime.specialize import specialize, static_values
from transpiler.native_ops import add_op_functions

SHAPE, CHANNELS = (4, 3, 6, 5), (3,)


def _model(y_reader: str = "Cast") -> onnx.ModelProto:
    """x and dy fed as float32 (onnxruntime's Python API takes no bfloat16), rounded to bf16 first,
    then the graph the precision pass writes around a BatchNorm and its gradient."""
    low = lambda a, b: helper.make_node("Cast", [a], [b], to=TensorProto.BFLOAT16)  # noqa: E731
    wide = lambda a, b: helper.make_node("Cast", [a], [b], to=TensorProto.FLOAT)  # noqa: E731
    nodes = [low("x", "xb"), wide("xb", "x32"), low("dy", "dyb"), wide("dyb", "dy32"),
             helper.make_node(BATCHNORM_TRAINING, ["x32", "scale", "bias", "rm", "rv"],
                              ["y32", "rm_next", "rv_next", "mean", "inv"], name="bn", domain=BATCHNORM_DOMAIN,
                              epsilon=1e-5, momentum=0.9),
             *{"Cast": [low("y32", "yb")], "Relu": [helper.make_node("Relu", ["y32"], ["yb"])],
               "CastRelu": [low("y32", "yr"), helper.make_node("Relu", ["yr"], ["yb"])]}[y_reader],
             helper.make_node(BATCHNORM_TRAINING_GRAD, ["dy32", "x32", "scale", "mean", "inv"], ["dx32", "dscale", "dbias"],
                              name="bn_grad", domain=BATCHNORM_DOMAIN, epsilon=1e-5),
             low("dx32", "dxb"), wide("yb", "y"), wide("dxb", "dx")]
    tensor = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    inputs = [tensor("x", SHAPE), tensor("dy", SHAPE)] + [tensor(n, CHANNELS) for n in ("scale", "bias", "rm", "rv")]
    outputs = [tensor("y", SHAPE), tensor("dx", SHAPE)] + [tensor(n, CHANNELS) for n in ("rm_next", "rv_next", "dscale", "dbias")]
    model = ir.serde.deserialize_model(helper.make_model(helper.make_graph(nodes, "g", inputs, outputs), ir_version=10,
                                                         opset_imports=[helper.make_opsetid("", 18)]))
    add_op_functions(model)
    return ir.serde.serialize_model(model)


def _run(model: onnx.ModelProto) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=SHAPE) * 2 + 1, "dy": rng.normal(size=SHAPE), "scale": rng.normal(size=CHANNELS),
             "bias": rng.normal(size=CHANNELS), "rm": rng.normal(size=CHANNELS), "rv": rng.uniform(0.5, 2, CHANNELS)}
    # lower: the CPU backend's float32 form of bfloat16 ops onnxruntime's CPU EP lacks (a Relu)
    session = ort.InferenceSession(lower(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {k: v.astype(np.float32) for k, v in feeds.items()})


def test_the_fused_nodes_compute_what_the_casts_and_the_nodes_computed():
    expected = _run(_model())
    fused = fold_batchnorm_casts(_model())
    onnx.checker.check_model(fused)
    ops = [(n.domain, n.op_type) for n in fused.graph.node]
    assert (DOMAIN, f"{BATCHNORM_TRAINING}_0") in ops and (DOMAIN, f"{BATCHNORM_TRAINING_GRAD}_1") in ops
    by_type = {n.op_type: n for n in fused.graph.node}
    assert by_type[f"{BATCHNORM_TRAINING}_0"].input[0] == "xb" and by_type[f"{BATCHNORM_TRAINING}_0"].output[0] == "yb"
    assert list(by_type[f"{BATCHNORM_TRAINING_GRAD}_1"].input[:2]) == ["dyb", "xb"]
    assert by_type[f"{BATCHNORM_TRAINING_GRAD}_1"].output[0] == "dxb"
    assert not {"x32", "dy32", "y32", "dx32"} & {name for n in fused.graph.node for name in [*n.input, *n.output]}
    for got, want in zip(_run(fused), expected):
        np.testing.assert_array_equal(got, want)


def test_a_relu_reading_the_bf16_output_is_taken_in():
    """Cast(bf16) then Relu: the fused forward node writes the Relu's value (attribute relu), its
    function computes it bit for bit, and the Cast and the Relu are gone."""
    expected = _run(_model("CastRelu"))
    fused = fold_batchnorm_casts(_model("CastRelu"))
    onnx.checker.check_model(fused)
    forward = next(n for n in fused.graph.node if n.op_type == f"{BATCHNORM_TRAINING}_0")
    assert forward.output[0] == "yb" and any(a.name == "relu" and a.i == 1 for a in forward.attribute)
    assert not any(n.op_type == "Relu" for n in fused.graph.node) and "yr" not in {o for n in fused.graph.node for o in n.output}
    for got, want in zip(_run(fused), expected):
        np.testing.assert_array_equal(got, want)
    plain = next(n for n in fold_batchnorm_casts(_model()).graph.node if n.op_type == f"{BATCHNORM_TRAINING}_0")
    assert not any(a.name == "relu" for a in plain.attribute)


def test_a_float32_output_read_by_a_relu_takes_the_relu_in_and_keeps_its_float32_input():
    """Y read in float32 by a Relu: the forward takes the Relu (no Cast to fold, X still read as
    float32, its Cast kept); the gradient is fused as before; the results bit for bit."""
    model = _model(y_reader="Relu")
    fused = fold_batchnorm_casts(_model(y_reader="Relu"))
    onnx.checker.check_model(fused)
    kinds = [(n.domain, n.op_type) for n in fused.graph.node]
    assert not any(domain == BATCHNORM_DOMAIN for domain, _ in kinds) and ("", "Relu") not in kinds
    forward = next(n for n in fused.graph.node if n.op_type.startswith(BATCHNORM_TRAINING) and "Grad" not in n.op_type)
    assert forward.input[0] == "x32" and forward.output[0] == "yb"
    assert any(a.name == "relu" and a.i == 1 for a in forward.attribute)
    assert (DOMAIN, f"{BATCHNORM_TRAINING_GRAD}_1") in kinds  # the gradient is still fused
    for got, want in zip(_run(fused), _run(model)):
        np.testing.assert_array_equal(got, want)


def test_a_batchnorm_whose_output_is_read_otherwise_is_left_alone():
    """Y read by a Relu and a graph output: nothing to fold into the forward."""
    model = _model(y_reader="Relu")
    model.graph.output.append(helper.make_tensor_value_info("y32", TensorProto.FLOAT, SHAPE))
    fused = fold_batchnorm_casts(model)
    kinds = [(n.domain, n.op_type) for n in fused.graph.node]
    assert (BATCHNORM_DOMAIN, BATCHNORM_TRAINING) in kinds and ("", "Relu") in kinds


def test_a_widening_cast_a_subgraph_reads_stays():
    """The fold drops the Casts to float32 it took in only where nothing reads them any more: a
    body's outer-scope read counts (rewrite_nodes.readers_of)."""
    folded = fold_batchnorm_casts(with_a_body_reading(_model(), "x32"))
    producers = [k for k, n in enumerate(folded.graph.node) if "x32" in n.output]
    body = next(k for k, n in enumerate(folded.graph.node) if n.op_type == "If")
    assert producers and producers[0] < body  # still computed, before the If reads it
    assert any(n.domain == DOMAIN for n in folded.graph.node)  # the BatchNorm is still folded


def test_the_bf16_resnet_step_reads_and_writes_its_batchnorms_in_bf16(model_dir, tmp_path):
    out = tmp_path / "cnn"
    assert main(["compile", str(model_dir("cnn_small") / "model.onnx"), "--gpus", "1", "--precision", "bf16",
                 "-o", str(out)]) == 0
    step = onnx.load(str(out / "rank0.onnx"))
    batchnorms = sum(n.domain == BATCHNORM_DOMAIN for n in step.graph.node)
    casts = sum(n.op_type == "Cast" for n in step.graph.node)
    relus = sum(n.op_type == "Relu" for n in step.graph.node)
    shapes = {"images": (8, 3, 16, 16), "labels": (8,)}
    step = fold_batchnorm_casts(specialize(step, shapes))
    fused = [n for n in step.graph.node if n.domain == DOMAIN]
    assert batchnorms > 0 and len(fused) == batchnorms
    taken = sum(any(a.name == "relu" and a.i for a in n.attribute) for n in fused)
    assert taken > 0 and relus - sum(n.op_type == "Relu" for n in step.graph.node) == taken  # conv, BN, ReLU
    assert not any(n.domain == BATCHNORM_DOMAIN for n in step.graph.node)
    assert casts - sum(n.op_type == "Cast" for n in step.graph.node) == 2 * batchnorms  # X/Y, dY/dX: 4 a pair
    known = static_values(step.graph)
    for node in fused:
        kinds = [known[name][1] for name in [*node.input, *node.output]]
        assert set(kinds) <= {TensorProto.FLOAT, TensorProto.BFLOAT16}, node.op_type
        assert kinds[0] == TensorProto.BFLOAT16 and kinds[len(node.input)] == TensorProto.BFLOAT16, node.op_type


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1 or not cuda_available(), reason="needs a CUDA GPU, CuPy and onnxruntime-gpu")
def test_the_bf16_cnn_trains_on_the_gpu_as_on_the_cpu_backend(model_dir, tmp_path):
    from graph_transpiler import transpile

    out = transpile(model_dir("cnn_small") / "model.onnx", tmp_path / "out", gpus=1, lr=0.01, precision="bf16",
                    verbose=False)
    losses = cpu_and_gpu_losses(out, model_dir("cnn_small") / "data.npz", batch=32, steps=6)
    # The GPU's BatchNorms read and write bf16 (the fused nodes), the CPU backend's cast around the
    # functions: the same roundings, summation order apart.
    assert np.max(np.abs(losses["nccl"] - losses["cpu"])) <= 2e-3 * float(losses["cpu"][0]), losses
