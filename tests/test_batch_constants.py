"""A size the exporter baked from the example batch fails ``transpile`` with one line naming the node,
its shape and the fix, before anything runs (transpiler/batch_constants.py); without the check
onnxruntime failed at run time on each rank's share of the batch.

The case that showed it: a CLIP-style contrastive loss whose labels are ``torch.arange(len(logits))``.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_cli_errors import assert_clean_error, transpile_cli

from transpiler.errors import TranspileError
from transpiler.load import load_problem

BATCH = 4


def _clip_module(size: str):
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Clip(nn.Module):
        """Two towers, cosine logits scaled by a learned temperature, symmetric cross-entropy."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.image, self.text = nn.Linear(8, 16), nn.Linear(6, 16)
            self.logit_scale = nn.Parameter(torch.tensor(2.0))

        def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
            a, b = F.normalize(self.image(image), dim=-1), F.normalize(self.text(text), dim=-1)
            logits = self.logit_scale.exp() * a @ b.t()
            labels = torch.arange(len(logits) if size == "len" else logits.shape[0])
            return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2

    return Clip()


def _export(tmp_path, size: str, exporter: str):
    torch = pytest.importorskip("torch")
    from models.torch_twins import export_onnx

    path = tmp_path / "model.onnx"
    args = (torch.randn(BATCH, 8), torch.randn(BATCH, 6))
    if exporter == "torchscript-static":  # no dynamic_axes at all
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(_clip_module(size), args, str(path), dynamo=False, opset_version=17,
                              input_names=["image", "text"], output_names=["loss"],
                              training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    else:
        export_onnx(_clip_module(size), args, path, input_names=["image", "text"], output_names=["loss"],
                    dynamo=exporter == "dynamo")
    return path


@pytest.mark.slow
def test_clip_loss_with_len_fails_at_transpile_in_one_line(tmp_path):
    # TorchScript with dynamic_axes, as docs/models.md asks: len() is baked all the same.
    model = _export(tmp_path, "len", "torchscript")
    done = transpile_cli(model, "-o", tmp_path / "out", cwd=tmp_path)
    line = assert_clean_error(done, "model.onnx", "Constant node", "shape [4]", "SoftmaxCrossEntropyLoss node",
                              "batch size (4)", "dynamic_axes / dynamic_shapes", "x.shape[0], not len(x)")
    constant = next(n for n in onnx.load(str(model)).graph.node if n.op_type == "Constant"
                    and any(a.t.dims == [BATCH] and a.t.data_type == TensorProto.INT64 for a in n.attribute))
    assert f"'{constant.name}'" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript-static", "dynamo"])
def test_other_exports_of_len_are_caught(tmp_path, exporter):
    # dynamo specializes the batch for len() and torch.onnx.export then drops the dynamic axis
    # silently: F.normalize's Expand to [4, 16] is the first place it shows.
    with pytest.raises(TranspileError, match=r"meets the batch axis in .* batch size \(4\)"):
        load_problem(_export(tmp_path, "len", exporter))


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_clip_loss_with_shape_loads(tmp_path, exporter):
    # x.shape[0] is traced by both exporters: the labels follow the batch, nothing to report.
    problem = load_problem(_export(tmp_path, "shape", exporter))
    assert problem.params == ["image.weight", "image.bias", "text.weight", "text.bias"]  # (0-d logit_scale: --train)


def _range_model(path, limit: str):
    """logits = x @ w (batch x 3); labels = Range(0, limit): a constant 4, or the batch from Shape."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["logits"], name="/fc/MatMul"),
        helper.make_node("Shape", ["x"], ["shape"], start=0, end=1),
        helper.make_node("Squeeze", ["shape"], ["rows"]),
        helper.make_node("Range", ["zero", limit, "one"], ["labels"], name="/Range"),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], name="/loss"),
    ]
    inits = [numpy_helper.from_array(np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32), "w"),
             *(numpy_helper.from_array(np.array(v, np.int64), n) for n, v in [("zero", 0), ("one", 1), ("four", 4)])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_range_with_a_constant_limit_is_caught(tmp_path):
    # load.py folds the Range of constants into a Constant: the message names the Range.
    with pytest.raises(TranspileError) as caught:
        load_problem(_range_model(tmp_path / "m.onnx", "four"))
    message = str(caught.value)
    assert "node '/Range' (computed from constants only)" in message and "shape [4]" in message
    assert "SoftmaxCrossEntropyLoss node '/loss'" in message and "\n" not in message


def test_range_up_to_the_batch_loads(tmp_path):
    assert load_problem(_range_model(tmp_path / "m.onnx", "rows")).params == ["w"]
