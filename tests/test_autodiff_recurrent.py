"""LSTM and GRU gradients (transpiler/autodiff/rules/lstm_gru.py) beyond the spec table.

onnxruntime refuses batch-major (``layout=1``) LSTM/GRU nodes and runs them in float32 only, so
these cases run on onnx's reference evaluator, in float64, with the spec table's check (a random
cotangent and direction, central differences). The reference ignores ``sequence_lens``: those
cases are in the table (tests/test_autodiff_rules.py), on onnxruntime. The reference's Scan runs
forward only: the Scan below adds ``scan_input_directions``/``scan_output_directions``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx.reference import ReferenceEvaluator
from onnx.reference.ops.op_scan import Scan as _ReferenceScan
from test_autodiff_rules import RNN_RANGES, Spec, _forward_model, _input_name

from transpiler.autodiff import GradientError, build_gradients
from transpiler.autodiff._context import subgraphs_of


class Scan(_ReferenceScan):
    """onnx's reference Scan, with reversed scan inputs and outputs (the backward's direction)."""

    op_domain = ""

    def __init__(self, onnx_node, run_params):
        node = onnx.NodeProto()
        node.CopyFrom(onnx_node)
        directions = {a.name: list(a.ints) for a in node.attribute if a.name.endswith("_directions")}
        kept = [a for a in node.attribute if not a.name.endswith("_directions")]
        del node.attribute[:]
        node.attribute.extend(kept)
        super().__init__(node, run_params)
        self.reversed_in = directions.get("scan_input_directions", [])
        self.reversed_out = directions.get("scan_output_directions", [])

    def _run(self, *args, **kwargs):
        states = len(args) - self.num_scan_inputs
        args = [np.flip(a, 0) if i >= states and self.reversed_in[i - states:i - states + 1] == [1] else a
                for i, a in enumerate(args)]
        outputs = super()._run(*args, **kwargs)
        return tuple(np.flip(o, 0) if i >= states and self.reversed_out[i - states:i - states + 1] == [1] else o
                     for i, o in enumerate(outputs))


def _reference(model: onnx.ModelProto) -> ReferenceEvaluator:
    return ReferenceEvaluator(model, new_ops=[Scan])


LAYOUT1 = [
    Spec("LSTM", [(2, 3, 3), (2, 8, 3), (2, 8, 2), (2, 16), None, (2, 2, 2), (2, 2, 2)],
         {"hidden_size": 2, "direction": "bidirectional", "layout": 1}, outputs=3, name="-bidirectional"),
    Spec("LSTM", [(2, 3, 3), (1, 8, 3), (1, 8, 2), (1, 16), None, (2, 1, 2)],
         {"hidden_size": 2, "direction": "reverse", "layout": 1}, outputs=3, loss_outputs=(0, 2), name="-reverse"),
    Spec("GRU", [(2, 3, 3), (2, 6, 3), (2, 6, 2), (2, 12), None, (2, 2, 2)],
         {"hidden_size": 2, "direction": "bidirectional", "layout": 1, "linear_before_reset": 1}, outputs=2,
         name="-bidirectional-torch"),
    Spec("GRU", [(2, 3, 3), (1, 6, 3), (1, 6, 2), (1, 12), None, (2, 1, 2)],
         {"hidden_size": 2, "layout": 1}, outputs=2, name="-forward"),
]


def _gradient_model(spec: Spec, feeds, cotangents, wrt_names):
    model = onnx.shape_inference.infer_shapes(_forward_model(spec, feeds, cotangents, False), strict_mode=True)
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    values = {v.name: v for v in graph.inputs}
    result = build_gradients(graph, graph.outputs[0], [values[n] for n in wrt_names])
    graph.outputs.extend(result.grads[values[n]] for n in wrt_names)
    return ir_model


@pytest.mark.parametrize("spec", LAYOUT1, ids=[s.id for s in LAYOUT1])
def test_batch_major_layout_matches_finite_differences(spec: Spec):
    rng = np.random.default_rng(0)
    feeds = {_input_name(i): rng.uniform(*RNN_RANGES[i], size=shape) for i, shape in enumerate(spec.inputs)
             if isinstance(shape, tuple)}
    wrt_names = list(feeds)
    ys = _reference(_forward_model(spec, feeds, None, False)).run(None, feeds)
    loss_outputs = spec.loss_outputs or tuple(range(len(ys)))
    cotangents = {j: rng.standard_normal(ys[j].shape) for j in loss_outputs}
    ir_model = _gradient_model(spec, feeds, cotangents, wrt_names)
    evaluator = _reference(ir.serde.serialize_model(ir_model))
    loss, *grads = evaluator.run(None, feeds)
    direction = {n: rng.standard_normal(v.shape) for n, v in feeds.items()}
    vjp = sum(float(np.sum(direction[n] * g)) for n, g in zip(wrt_names, grads))
    eps = 1e-6

    def loss_at(step: float) -> float:
        return float(evaluator.run(["loss"], {n: v + step * direction[n] for n, v in feeds.items()})[0])

    np.testing.assert_allclose(vjp, (loss_at(eps) - loss_at(-eps)) / (2 * eps), rtol=1e-6)


def test_scan_bodies_read_nothing_from_the_outer_graph():
    """Passes see only the main graph: a Scan body must not capture outer values (a rename or a
    move of one would break the body silently)."""
    spec = Spec("LSTM", [(3, 2, 3), (2, 8, 3), (2, 8, 2), (2, 16), np.array([3, 1], np.int32), (2, 2, 2), (2, 2, 2)],
                {"hidden_size": 2, "direction": "bidirectional"}, outputs=3)
    rng = np.random.default_rng(0)
    feeds = {_input_name(i): rng.uniform(-1, 1, size=s).astype(np.float32) for i, s in enumerate(spec.inputs)
             if isinstance(s, tuple)}
    cotangents = {0: np.ones((3, 2, 2, 2), np.float32)}
    ir_model = _gradient_model(spec, feeds, cotangents, list(feeds))
    scans = [node for node in ir_model.graph if node.op_type == "Scan"]
    assert len(scans) == 4  # per direction: the cell states forward, the gradient backward
    for node in scans:
        for body in (g for attr in node.attributes.values() for g in subgraphs_of(attr)):
            own = set(body.inputs) | {out for inner in body for out in inner.outputs}
            for inner in body:
                assert all(v is None or v in own for v in inner.inputs), f"{node.name} reads an outer value"


@pytest.mark.parametrize("attrs,extra,message", [
    ({"clip": 3.0}, [], "clip"),
    ({"activations": ["Relu", "Tanh", "Tanh"]}, [], "activations"),
    ({"input_forget": 1}, [], "input_forget"),
    ({}, [(1, 6)], "peephole"),
])
def test_lstm_attributes_pytorch_never_writes_are_refused(attrs, extra, message):
    inputs = [(3, 2, 3), (1, 8, 3), (1, 8, 2), None, None, None, None, *extra]
    spec = Spec("LSTM", inputs if extra else inputs[:3], {"hidden_size": 2, **attrs})
    rng = np.random.default_rng(0)
    feeds = {_input_name(i): rng.uniform(-1, 1, size=s).astype(np.float32) for i, s in enumerate(spec.inputs)
             if isinstance(s, tuple)}
    cotangents = {0: np.ones((3, 1, 2, 2), np.float32)}
    with pytest.raises(GradientError, match=message):
        _gradient_model(spec, feeds, cotangents, ["in1"])
