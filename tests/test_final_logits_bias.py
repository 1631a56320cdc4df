"""BART's wrong numbers (issue 28): transformers' BART family (BART, mBART, Pegasus, Marian,
Blenderbot, PLBart) registers ``final_logits_bias`` with ``register_buffer``: zeros added to the
logits, never trained by PyTorch. Both exporters write it as a plain initializer feeding an Add, so
nothing in the graph tells it from a parameter's bias, and the transpiler trained it: from step 2
on every logit carried a learned bias PyTorch's did not (3 steps: 3.4e-3 relative error on the
cross-attention biases of the zoo's tiny BART, parity at 6e-7 once it is frozen). A ``NAME_RULES``
entry in transpiler/trainable.py now freezes it by name; ``--train final_logits_bias`` trains it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from transpiler import Options, build


def _bart_head(path):
    """x [batch, 4] -> x @ lm_head + final_logits_bias -> mean: the shape of BART's output layer."""
    rng = np.random.default_rng(0)
    inits = {"lm_head.weight": rng.normal(size=(4, 6)).astype(np.float32),
             "model.final_logits_bias": np.zeros((1, 6), np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "lm_head.weight"], ["logits0"]),
             helper.make_node("Add", ["logits0", "model.final_logits_bias"], ["logits"]),
             helper.make_node("ReduceMean", ["logits"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_freeze_keeps_final_logits_bias_untrained(tmp_path):
    job = build(_bart_head(tmp_path / "m.onnx"), Options(), freeze="final_logits_bias")
    status = dict(job.problem.selection.status)
    assert status["model.final_logits_bias"][0] == "frozen"
    assert status["lm_head.weight"][0] == "trained"


def test_final_logits_bias_is_frozen_by_default(tmp_path):
    job = build(_bart_head(tmp_path / "m.onnx"), Options())
    status = dict(job.problem.selection.status)
    assert status["model.final_logits_bias"] == ("frozen", "logits-bias-buffer")
    assert status["lm_head.weight"][0] == "trained"
    assert "logits bias buffer" in job.problem.selection.summary()


def test_train_overrides_the_name_rule(tmp_path):
    job = build(_bart_head(tmp_path / "m.onnx"), Options(), train="final_logits_bias")
    assert dict(job.problem.selection.status)["model.final_logits_bias"][0] == "trained"
