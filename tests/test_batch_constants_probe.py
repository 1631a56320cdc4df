"""A baked batch size behind a Reshape (transpiler/batch_constants.py, load._shapes_at).

The loader's symbolic batch axis is lost at the first ``Reshape(x, [-1, n])``: onnx's shape inference
names the -1 dim anew. transformers' CLIP does that at once (its text tower views input_ids as
``(-1, seq)``), so the one-line error for CLIP's own loss (``arange(len(logits))`` baked as
``[0, 1, 2, 3]``) never came: TorchScript's export transpiled and would have failed in onnxruntime on
each rank's share, dynamo's static export (it specializes the batch for ``len()``) too. The dims
that follow the batch are now also told by inferring shapes at two batch sizes, and a Reshape that
gives a tensor of the batch axis a shape fixed whole is reported (dynamo's static CLIP: the patch
embedding's ``view`` to ``[4, 32, 16]``).

tests/test_zoo.py checks the real CLIP's exports end to end (``test_clip_own_loss_is_refused``).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from transpiler.errors import TranspileError
from transpiler.load import load_problem

INT64 = TensorProto.INT64


def _const(name: str, values) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=f"/{name}",
                            value=numpy_helper.from_array(np.array(values, np.int64), name))


def _model(path, nodes, x_shape=("batch", 8)):
    """x [B, 8] -> ... -> 'rows' [?, 4] -> logits = rows @ w [?, 3] -> SoftmaxCrossEntropyLoss(logits, labels)."""
    nodes = [*nodes,
             helper.make_node("MatMul", ["rows", "w"], ["logits"], name="/fc/MatMul"),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], name="/loss")]
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32), "w")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def _labels_from_rows() -> list[onnx.NodeProto]:
    # labels = arange(rows.shape[0]) % 3: follows the batch (x.shape[0] in torch)
    return [helper.make_node("Shape", ["rows"], ["n"], start=0, end=1),
            helper.make_node("Squeeze", ["n"], ["n0"]),
            _const("zero", 0), _const("one", 1), _const("three", 3),
            helper.make_node("Range", ["zero", "n0", "one"], ["r"]),
            helper.make_node("Mod", ["r", "three"], ["labels"])]


def test_a_constant_that_meets_the_batch_behind_reshape_minus_one_is_caught(tmp_path):
    # rows = x.view(-1, 4): [2B, 4]; the labels a constant of 8 = 2 x the example batch of 4.
    nodes = [_const("view", [-1, 4]), helper.make_node("Reshape", ["x", "view"], ["rows"], name="/view"),
             _const("labels", [0, 1, 2, 0, 1, 2, 0, 1])]
    with pytest.raises(TranspileError) as caught:
        load_problem(_model(tmp_path / "m.onnx", nodes))
    message = str(caught.value)
    assert "Constant node '/labels' (value 'labels', shape [8])" in message
    assert "meets the batch axis in SoftmaxCrossEntropyLoss node '/loss'" in message
    assert "example batch size (4)" in message and "\n" not in message


def test_a_reshape_to_a_shape_fixed_whole_is_caught(tmp_path):
    # dynamo's static export of a len()-specialized model: x.view(8, 4) for an example batch of 4.
    nodes = [_const("view", [8, 4]), helper.make_node("Reshape", ["x", "view"], ["rows"], name="/view"),
             *_labels_from_rows()]
    with pytest.raises(TranspileError) as caught:
        load_problem(_model(tmp_path / "m.onnx", nodes))
    message = str(caught.value)
    assert "Constant node '/view' (value 'view', the shape [8, 4]) meets the batch axis in Reshape node '/view'" in message
    assert "example batch size (4)" in message and "\n" not in message


@pytest.mark.parametrize("view", [[-1, 4], [0, 2, 4]], ids=["minus-one", "zero-copies-the-batch"])
def test_reshapes_that_follow_the_batch_load(tmp_path, view):
    nodes = [_const("view", view), helper.make_node("Reshape", ["x", "view"], ["r3"], name="/view"),
             _const("flat", [-1, 4]), helper.make_node("Reshape", ["r3", "flat"], ["rows"], name="/flat"),
             *_labels_from_rows()]
    assert load_problem(_model(tmp_path / "m.onnx", nodes)).params == ["w"]


def test_a_size_of_one_that_broadcasts_is_not_blamed(tmp_path):
    # Sizes of 1 broadcast: a [1, 4] constant added to rows of the batch is no baked size.
    nodes = [_const("view", [-1, 4]), helper.make_node("Reshape", ["x", "view"], ["v"], name="/view"),
             helper.make_node("Add", ["v", "bias"], ["rows"]), *_labels_from_rows()]
    path = _model(tmp_path / "m.onnx", nodes)
    model = onnx.load(str(path))
    model.graph.initializer.append(numpy_helper.from_array(np.ones((1, 4), np.float32), "bias"))
    onnx.save(model, path)
    assert set(load_problem(path).params) == {"w", "bias"}
