"""Which initializers are trained (transpiler/trainable.py), on small hand-built graphs: each rule,
the --train/--freeze overrides and their one-line errors, the summary line, the merged-parameter
and folded-BatchNorm warnings, what plan.json records and what inspect shows (older plans too).

Real exports from torch (GPT-2 and Llama style, dynamo's default export) are in
tests/test_trainable_exports.py.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from transpiler import Options, TranspileError, build, transpile


def _model(nodes, inits, path, *, value_info=(), opset=18, metadata=None):
    """x [batch, 4] float -> ... -> loss (a scalar float output)."""
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()], value_info=list(value_info))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    for node_name, props in (metadata or {}).items():
        node = next(n for n in model.graph.node if n.name == node_name)
        for k, v in props.items():
            node.metadata_props.add(key=k, value=v)
    onnx.save(model, path)
    return path


def _rng(seed=0):
    return np.random.default_rng(seed)


def _status(job):
    return dict(job.problem.selection.status)


def scalar_and_exponent_model(path):
    """loss = mean((x * w + b) ** p * scale + m) with w [4], b [4], p 0-d, scale 0-d, m [1] (trained:
    a [1] operand is a parameter, like linear regression's slope), e [1] as a second Pow exponent."""
    r = _rng()
    inits = {"w": r.normal(size=4).astype(np.float32), "b": r.normal(size=4).astype(np.float32),
             "p": np.array(2.0, np.float32), "scale": np.array(0.5, np.float32),
             "m": np.array([0.3], np.float32), "e": np.array([1.0], np.float32)}
    nodes = [helper.make_node("Mul", ["x", "w"], ["h0"]), helper.make_node("Add", ["h0", "b"], ["h1"]),
             helper.make_node("Pow", ["h1", "p"], ["h2"]), helper.make_node("Mul", ["h2", "scale"], ["h3"]),
             helper.make_node("Add", ["h3", "m"], ["h4"]), helper.make_node("Pow", ["h4", "e"], ["h5"]),
             helper.make_node("ReduceMean", ["h5"], ["loss"], keepdims=0)]
    return _model(nodes, inits, path)


def test_scalars_and_exponents_are_constants(tmp_path):
    job = build(scalar_and_exponent_model(tmp_path / "m.onnx"), Options())
    status = _status(job)
    assert sorted(job.problem.params) == ["b", "m", "w"]
    assert status["p"] == ("frozen", "exponent")
    assert status["e"] == ("frozen", "exponent")  # shape [1], frozen by its role
    assert status["scale"] == ("frozen", "scalar")
    assert status["m"] == ("trained", None)  # shape [1] in a Mul/Add: a parameter
    assert job.problem.selection.summary() == "trainable: 3 tensor(s) trained, 3 frozen (2 Pow exponent, 1 0-d constant)"


def test_train_overrides_a_rule_and_freeze_still_works(tmp_path):
    path = scalar_and_exponent_model(tmp_path / "m.onnx")
    job = build(path, Options(), train="^scale$")
    assert sorted(job.problem.params) == ["b", "m", "scale", "w"]
    assert _status(job)["scale"] == ("trained", "train")
    assert "(1 by --train)" in job.problem.selection.summary()
    job = build(path, Options(), freeze="^w$")
    assert sorted(job.problem.params) == ["b", "m"] and _status(job)["w"] == ("frozen", "freeze")


@pytest.mark.parametrize("kwargs, words", [
    ({"train": "nomatch"}, ["--train 'nomatch' matches no initializer", "w, b"]),
    ({"train": "u"}, ["--train 'u' matches nothing that can be trained", "unused (the loss does not depend on it)"]),
    ({"train": "^w$", "freeze": "w"}, ["--freeze 'w' and --train '^w$' both match w"]),
    ({"train": "("}, ["--train '(' is not a valid regular expression"]),
])
def test_train_errors_are_one_line(tmp_path, kwargs, words):
    r = _rng()
    inits = {"w": r.normal(size=4).astype(np.float32), "b": r.normal(size=4).astype(np.float32),
             "unused": np.ones(3, np.float32)}
    nodes = [helper.make_node("Mul", ["x", "w"], ["h0"]), helper.make_node("Add", ["h0", "b"], ["h1"]),
             helper.make_node("ReduceMean", ["h1"], ["loss"], keepdims=0)]
    path = _model(nodes, inits, tmp_path / "m.onnx")
    with pytest.raises(TranspileError) as err:
        build(path, Options(), **kwargs)
    message = str(err.value)
    assert "\n" not in message
    for w in words:
        assert w in message, message


def test_cli_train_option_and_summary_line(tmp_path, capsys):
    from commands.main import main

    path = scalar_and_exponent_model(tmp_path / "m.onnx")
    assert main([str(path), "-o", str(tmp_path / "out"), "--train", "scale"]) == 0
    out = capsys.readouterr().out
    assert "trainable: 4 tensor(s) trained (1 by --train), 2 frozen (2 Pow exponent)" in out
    assert main([str(path), "-o", str(tmp_path / "out2"), "--train", "zzz"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("transpile: error: ") and "--train 'zzz' matches no initializer" in err
    assert err.count("\n") == 1


def test_name_rules(tmp_path):
    """Buffers by name: inv_freq, cos/sin tables, position_ids, masked_bias, a 0/1 attn.bias; and a
    non-finite fill value. A real attention bias (values not 0/1) stays trained."""
    r = _rng()
    tril = np.tril(np.ones((4, 4), np.float32))
    inits = {"rotary.inv_freq": np.array([1.0, 0.1, 0.01, 0.001], np.float32),
             "cos_cached": r.normal(size=4).astype(np.float32), "pos.position_ids": r.normal(size=4).astype(np.float32),
             "h.0.attn.bias": tril, "h.0.attn.masked_bias": np.array([-1e4, -1e4, -1e4, -1e4], np.float32),
             "h.1.attn.bias": r.normal(size=(4, 4)).astype(np.float32),
             "fill": np.array([-np.inf, 0, 0, 0], np.float32), "w": r.normal(size=4).astype(np.float32)}
    names = list(inits)
    nodes, prev = [], "x"
    for i, name in enumerate(names):
        op = "MatMul" if inits[name].ndim == 2 else "Add"
        nodes.append(helper.make_node(op, [prev, name], [f"h{i}"]))
        prev = f"h{i}"
    nodes.append(helper.make_node("ReduceMean", [prev], ["loss"], keepdims=0))
    job = build(_model(nodes, inits, tmp_path / "m.onnx"), Options())
    status = _status(job)
    assert status["rotary.inv_freq"] == ("frozen", "rotary")
    assert status["cos_cached"] == ("frozen", "rotary")
    assert status["pos.position_ids"] == ("frozen", "position-ids")
    assert status["h.0.attn.bias"] == ("frozen", "mask")
    assert status["h.0.attn.masked_bias"] == ("frozen", "mask")
    assert status["fill"] == ("frozen", "non-finite")
    assert status["h.1.attn.bias"] == ("trained", None)
    assert sorted(job.problem.params) == ["h.1.attn.bias", "w"]
    # and each one only on request
    job = build(_model(nodes, inits, tmp_path / "m.onnx"), Options(), train="inv_freq|position_ids")
    assert sorted(job.problem.params) == ["h.1.attn.bias", "pos.position_ids", "rotary.inv_freq", "w"]


def _layernorm_model(path, weight, bias, *, shared=True, metadata=None, n=3):
    """n LayerNormalization nodes in a row; with ``shared`` all take the initializers ``ln.weight``/
    ``ln.bias`` (what a deduplicating exporter writes), else each its own."""
    inits, nodes, prev = {}, [], "x"
    for i in range(n):
        w, b = ("ln.weight", "ln.bias") if shared else (f"ln{i}.weight", f"ln{i}.bias")
        inits[w], inits[b] = weight(i), bias(i)
        nodes.append(helper.make_node("LayerNormalization", [prev, w, b], [f"h{i}"], name=f"ln{i}"))
        prev = f"h{i}"
    nodes.append(helper.make_node("ReduceMean", [prev], ["loss"], keepdims=0))
    return _model(nodes, inits, path, metadata=metadata)


def test_merged_parameters_warned(tmp_path):
    path = _layernorm_model(tmp_path / "m.onnx", lambda i: np.ones(4, np.float32), lambda i: np.zeros(4, np.float32))
    warnings = build(path, Options()).problem.warnings
    assert len(warnings) == 2, warnings
    assert "'ln.weight' (all 1) feeds 3 LayerNormalization nodes (ln0, ln1, ln2)" in warnings[0]
    assert "'ln.bias' (all 0)" in warnings[1]
    assert "optimize=False" in warnings[0] and "do_constant_folding=False" in warnings[0]


def test_no_merge_warning_for_distinct_random_or_same_module(tmp_path):
    r = _rng()
    # each layer its own tensor, all equal: nothing shared
    path = _layernorm_model(tmp_path / "a.onnx", lambda i: np.ones(4, np.float32), lambda i: np.zeros(4, np.float32),
                            shared=False)
    assert build(path, Options()).problem.warnings == []
    # one random tensor used by several layers: a real tie, not an exporter merge
    w, b = r.normal(size=4).astype(np.float32), r.normal(size=4).astype(np.float32)
    path = _layernorm_model(tmp_path / "b.onnx", lambda i: w, lambda i: b)
    assert build(path, Options()).problem.warnings == []
    # one module called three times (its nodes carry the same scope): shared on purpose
    scope = {"pkg.torch.onnx.name_scopes": "['', 'ln', 'layer_norm']"}
    path = _layernorm_model(tmp_path / "c.onnx", lambda i: np.ones(4, np.float32), lambda i: np.zeros(4, np.float32),
                            metadata={f"ln{i}": scope for i in range(3)})
    assert build(path, Options()).problem.warnings == []
    # different scopes: merged
    path = _layernorm_model(tmp_path / "d.onnx", lambda i: np.ones(4, np.float32), lambda i: np.zeros(4, np.float32),
                            metadata={f"ln{i}": {"pkg.torch.onnx.name_scopes": f"['', 'blocks.{i}.ln', 'layer_norm']"}
                                      for i in range(3)})
    warnings = build(path, Options()).problem.warnings
    assert len(warnings) == 2 and "(blocks.0.ln, blocks.1.ln, blocks.2.ln)" in warnings[0]


def test_tied_embedding_is_not_a_merge(tmp_path):
    """GPT-2's wte: one table for the token lookup (Gather) and the LM head (MatMul), even all-equal."""
    graph = helper.make_graph(
        [helper.make_node("Gather", ["wte", "tokens"], ["e"]),
         helper.make_node("Transpose", ["wte"], ["wt"], perm=[1, 0]),
         helper.make_node("MatMul", ["e", "wt"], ["logits"]),
         helper.make_node("ReduceMean", ["logits"], ["loss"], keepdims=0)],
        "g", [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.full((5, 4), 0.1, np.float32), "wte")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "m.onnx")
    job = build(tmp_path / "m.onnx", Options())
    assert job.problem.params == ["wte"] and job.problem.warnings == []


def test_plan_records_reasons_and_inspect_lists_them(tmp_path):
    from inspection.render import plain, sections_of
    from inspection.report import build_report

    path = scalar_and_exponent_model(tmp_path / "m.onnx")
    plan = transpile(path, tmp_path / "out", Options(world_size=2))
    section = plan["trainable"]
    entries = {e["name"]: e for e in section["initializers"]}
    assert entries["p"] == {"name": "p", "shape": [], "status": "frozen", "reason": "exponent", "why": "Pow exponent"}
    assert entries["w"]["status"] == "trained" and entries["w"]["reason"] is None
    assert plan["frozen"] == ["p", "scale", "e"]  # the older field, unchanged in meaning
    report = build_report(tmp_path / "out", segments=False)
    assert report["trainable"]["recorded"] is True
    text = plain(sections_of(report))
    assert "initializers: trained or frozen, and why" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("scale "))
    assert "frozen" in line and "0-d constant" in line

    # A plan written before the section existed: the runtime and inspect still read it.
    raw = json.loads((tmp_path / "out" / "plan.json").read_text())
    del raw["trainable"]
    (tmp_path / "out" / "plan.json").write_text(json.dumps(raw))
    from contract.plan import load_plan

    load_plan(tmp_path / "out", report_fields=True)
    report = build_report(tmp_path / "out", segments=False)
    assert report["trainable"]["recorded"] is False
    rows = {e["name"]: e for e in report["trainable"]["initializers"]}
    assert rows["w"]["status"] == "trained" and rows["p"]["status"] == "frozen"
    assert "older plan" in plain(sections_of(report))


def test_plan_with_a_bad_trainable_section_is_refused(tmp_path):
    from contract.plan import PlanError, load_plan

    transpile(scalar_and_exponent_model(tmp_path / "m.onnx"), tmp_path / "out", Options())
    raw = json.loads((tmp_path / "out" / "plan.json").read_text())
    raw["trainable"]["initializers"][0]["status"] = "maybe"
    (tmp_path / "out" / "plan.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError, match=r"trainable.initializers\[0\].status"):
        load_plan(tmp_path / "out", report_fields=True)


def test_folded_batchnorm_warned_from_dynamo_metadata(tmp_path):
    r = _rng()
    inits = {"c.weight": r.normal(size=(2, 1, 1, 1)).astype(np.float32), "c.bias": r.normal(size=2).astype(np.float32),
             "shape": np.array([-1, 1, 2, 2], np.int64)}
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["img"]),
             helper.make_node("Conv", ["img", "c.weight", "c.bias"], ["h"], name="node_Conv_3"),
             helper.make_node("ReduceMean", ["h"], ["loss"], keepdims=0)]
    hierarchy = {"pkg.torch.onnx.class_hierarchy":
                 "['M', 'torch.nn.modules.batchnorm.BatchNorm2d', 'aten._native_batch_norm_legit_functional.default']"}
    job = build(_model(nodes, inits, tmp_path / "m.onnx", metadata={"node_Conv_3": hierarchy}), Options())
    assert len(job.problem.warnings) == 1
    assert "BatchNormalization was folded into 1 convolution(s)" in job.problem.warnings[0]
    assert "node_Conv_3 (weight 'c.weight')" in job.problem.warnings[0]
    job = build(_model(nodes, inits, tmp_path / "n.onnx"), Options())
    assert job.problem.warnings == []


def test_epsilon_of_shape_one_before_sqrt_is_a_constant(tmp_path):
    """sqrt(mean(x^2) + eps) with eps stored as [1]: frozen; a [1] tensor added elsewhere is trained."""
    inits = {"eps": np.array([1e-6], np.float32), "two": np.array(2.0, np.float32),
             "g": np.full(4, 1.1, np.float32), "shift": np.array([1e-6], np.float32)}
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rms"]),
             helper.make_node("Div", ["x", "rms"], ["n"]), helper.make_node("Mul", ["n", "g"], ["y"]),
             helper.make_node("Add", ["y", "shift"], ["z"]),
             helper.make_node("ReduceMean", ["z"], ["loss"], keepdims=0)]
    job = build(_model(nodes, inits, tmp_path / "m.onnx"), Options())
    status = _status(job)
    assert status["eps"] == ("frozen", "epsilon")
    assert status["shift"] == ("trained", None)
    assert sorted(job.problem.params) == ["g", "shift"]


def test_every_rule_is_documented():
    from pathlib import Path

    from transpiler.trainable import REASONS, RULE_REASONS

    text = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    section = text[text.index("### Frozen by default, and why"):]
    for code in RULE_REASONS:
        assert code in REASONS and f"| `{code}` |" in section, code


@pytest.mark.parametrize("copy, warned", [("transposed", True), ("independent", False), ("constant", False)])
def test_transposed_copy_of_a_trained_tensor_is_warned(tmp_path, copy, warned):
    r = _rng()
    a = r.normal(size=(4, 3)).astype(np.float32)
    b = {"transposed": a.T.copy(), "independent": r.normal(size=(3, 4)).astype(np.float32),
         "constant": np.full((3, 4), 0.5, np.float32)}[copy]
    if copy == "constant":
        a = np.full((4, 3), 0.5, np.float32)
    nodes = [helper.make_node("MatMul", ["x", "a"], ["h"]), helper.make_node("MatMul", ["h", "b"], ["y"]),
             helper.make_node("ReduceMean", ["y"], ["loss"], keepdims=0)]
    warnings = build(_model(nodes, {"a": a, "b": b}, tmp_path / "m.onnx"), Options()).problem.warnings
    assert bool(warnings) == warned, warnings
    if warned:
        assert warnings == ["'b' is 'a' transposed: the exporter folded a Transpose of a shared (tied) weight into a "
                            "copy, so the two would be trained apart; re-export with dynamo optimize=False "
                            "(TorchScript: training=TrainingMode.TRAINING, do_constant_folding=False)"]
