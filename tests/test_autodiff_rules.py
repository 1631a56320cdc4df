"""Every gradient rule against central finite differences, from one spec table.

The check is JAX's cheap VJP check: for a random cotangent c and a random direction t, the
backward's <t, J^T c> must equal the directional derivative of <f(x), c> along t, measured by central
differences in float64. Each spec runs twice: with static input shapes, and with every input dim
symbolic, which drives the rules' dynamic paths (run-time unbroadcast, Shape-based sizes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from transpiler.autodiff import build_gradients, check_supported
from transpiler.autodiff._registry import non_differentiable_ops, registered_ops
from transpiler.errors import UnsupportedOpsError

OPSET = 18

Shape = tuple[int, ...]


@dataclass
class Spec:
    op: str
    # A shape makes a random float64 graph input; an array makes a constant (shapes, axes, masks).
    inputs: list[Shape | np.ndarray]
    attrs: dict[str, Any] = field(default_factory=dict)
    # Input indices to differentiate; default: every random input.
    wrt: tuple[int, ...] | None = None
    # Sampling range per input index; default (-2, 2). Log, Sqrt and Pow's base need positives.
    ranges: dict[int, tuple[float, float]] = field(default_factory=dict)
    # Float32 outputs (Cast) need a wider step and a looser tolerance.
    eps: float = 1e-6
    rtol: float = 1e-6
    name: str = ""

    @property
    def id(self) -> str:
        shapes = ",".join(
            "x".join(map(str, s)) or "scalar" if isinstance(s, tuple) else "c" for s in self.inputs
        )
        return f"{self.op}[{shapes}]{self.name}"


POSITIVE = (0.5, 2.0)
AWAY_FROM_ZERO = (0.5, 2.0)

SPECS = [
    # Binary elementwise, with broadcast pairs and scalars.
    Spec("Add", [(3, 4), (3, 4)]),
    Spec("Add", [(3, 4), (4,)]),
    Spec("Add", [(3, 1), (1, 4)]),
    Spec("Add", [(2, 3, 4), (3, 1)]),
    Spec("Add", [(), (3, 4)]),
    Spec("Add", [(3, 4), ()]),
    Spec("Sub", [(3, 4), (4,)]),
    Spec("Sub", [(3, 1), (1, 4)]),
    Spec("Sub", [(), ()]),
    Spec("Mul", [(3, 4), (3, 4)]),
    Spec("Mul", [(2, 3, 4), (3, 1)]),
    Spec("Mul", [(), (2, 3)]),
    Spec("Mul", [(3, 4), (4,)], wrt=(1,), name="wrt-right-only"),
    Spec("Div", [(3, 4), (4,)], ranges={1: AWAY_FROM_ZERO}),
    Spec("Div", [(3, 1), (1, 4)], ranges={1: AWAY_FROM_ZERO}),
    Spec("Pow", [(3, 4), (4,)], ranges={0: POSITIVE}),
    Spec("Pow", [(3, 1), ()], ranges={0: POSITIVE}),
    Spec("Pow", [(3, 4), np.array(3, dtype=np.int64)], name="int-exponent"),
    Spec("Pow", [(3, 4), (3, 4)], wrt=(0,), name="wrt-base-only"),
    Spec("Where", [np.array([[True, False, True, False]] * 3), (3, 4), (4,)]),
    Spec("Where", [np.array([True, False, True]).reshape(3, 1), (), (1, 4)]),
    # Unary elementwise.
    Spec("Neg", [(3, 4)]),
    Spec("Identity", [(3, 4)]),
    Spec("Relu", [(3, 4)]),
    Spec("Tanh", [(3, 4)]),
    Spec("Sigmoid", [(3, 4)]),
    Spec("Exp", [(3, 4)]),
    Spec("Sqrt", [(3, 4)], ranges={0: POSITIVE}),
    Spec("Log", [(3, 4)], ranges={0: POSITIVE}),
    Spec("Log", [()], ranges={0: POSITIVE}),
    Spec("Cast", [(3, 4)], {"to": onnx.TensorProto.FLOAT}, eps=1e-2, rtol=1e-4, name="to-float32"),
    Spec("Cast", [(3, 4)], {"to": onnx.TensorProto.DOUBLE}, name="to-double"),
    # Matrix products.
    Spec("MatMul", [(3, 4), (4, 5)]),
    Spec("MatMul", [(2, 3, 4), (4, 5)]),
    Spec("MatMul", [(2, 1, 3, 4), (5, 4, 2)]),
    Spec("MatMul", [(4,), (4, 5)]),
    Spec("MatMul", [(3, 4), (4,)]),
    Spec("MatMul", [(4,), (4,)]),
    Spec("MatMul", [(4,), (2, 4, 5)]),
    Spec("Gemm", [(3, 4), (4, 5), (5,)]),
    Spec("Gemm", [(4, 3), (4, 5), (3, 1)], {"transA": 1, "alpha": 0.5, "beta": 2.0}),
    Spec("Gemm", [(3, 4), (5, 4), ()], {"transB": 1}),
    Spec("Gemm", [(4, 3), (5, 4), (3, 5)], {"transA": 1, "transB": 1, "alpha": 1.5}),
    Spec("Gemm", [(3, 4), (4, 5)], name="no-C"),
    # Reductions.
    Spec("ReduceSum", [(3, 4), np.array([1])]),
    Spec("ReduceSum", [(2, 3, 4), np.array([0, -1])], {"keepdims": 0}),
    Spec("ReduceSum", [(3, 4)], {"keepdims": 0}, name="all-axes"),
    Spec("ReduceSum", [(3, 4)], {"noop_with_empty_axes": 1}, name="noop"),
    Spec("ReduceSum", [(3, 4), np.array([], dtype=np.int64)], {"keepdims": 0}, name="empty-axes"),
    Spec("ReduceMean", [(3, 4), np.array([1])]),
    Spec("ReduceMean", [(2, 3, 4), np.array([0, 2])], {"keepdims": 0}),
    Spec("ReduceMean", [(3, 4)], {"keepdims": 0}, name="all-axes"),
    Spec("ReduceMean", [(3, 4)], name="all-axes-keepdims"),
    Spec("ReduceMean", [(3, 4)], {"noop_with_empty_axes": 1}, name="noop"),
    # Shape ops.
    Spec("Reshape", [(2, 6), np.array([3, 4])]),
    Spec("Reshape", [(2, 3, 4), np.array([0, -1])]),
    Spec("Flatten", [(2, 3, 4)], {"axis": 2}),
    Spec("Transpose", [(2, 3, 4)], {"perm": [2, 0, 1]}),
    Spec("Transpose", [(2, 3, 4)], name="default-perm"),
    Spec("Squeeze", [(3, 1, 4), np.array([1])]),
    Spec("Squeeze", [(1, 3, 1)], name="all-ones"),
    Spec("Unsqueeze", [(3, 4), np.array([0, -1])]),
    Spec("Expand", [(3, 1), np.array([2, 3, 4])]),
    Spec("Expand", [(4,), np.array([3, 1])]),
    Spec("Concat", [(2, 3), (2, 5)], {"axis": 1}),
    Spec("Concat", [(1, 3), (2, 3), (3, 3)], {"axis": -2}),
]


def _input_name(index: int) -> str:
    return f"in{index}"


def _graph_input(name: str, array: np.ndarray, symbolic: bool) -> onnx.ValueInfoProto:
    dims = [f"{name}_d{j}" for j in range(array.ndim)] if symbolic else list(array.shape)
    return onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype), dims)


def _forward_model(spec: Spec, feeds: dict[str, np.ndarray], cotangent: np.ndarray | None, symbolic: bool):
    """The one-node model; with a cotangent c, also loss = ReduceSum(y * c)."""
    inputs, initializers, names = [], [], []
    for i, entry in enumerate(spec.inputs):
        name = _input_name(i)
        names.append(name)
        if isinstance(entry, np.ndarray):
            initializers.append(onnx.numpy_helper.from_array(entry, name))
        else:
            inputs.append(_graph_input(name, feeds[name], symbolic))
    nodes = [onnx.helper.make_node(spec.op, names, ["y"], name="op", **spec.attrs)]
    if cotangent is None:
        outputs = [onnx.helper.make_value_info("y", onnx.TypeProto())]
    else:
        initializers.append(onnx.numpy_helper.from_array(cotangent, "c"))
        nodes += [
            onnx.helper.make_node("Mul", ["y", "c"], ["yc"], name="weigh"),
            onnx.helper.make_node("ReduceSum", ["yc"], ["loss"], name="loss", keepdims=0),
        ]
        outputs = [
            onnx.helper.make_tensor_value_info(
                "loss", onnx.helper.np_dtype_to_tensor_dtype(cotangent.dtype), []
            )
        ]
    graph = onnx.helper.make_graph(nodes, "spec", inputs, outputs, initializers)
    return onnx.helper.make_model(graph, ir_version=10, opset_imports=[onnx.helper.make_opsetid("", OPSET)])


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_vjp_matches_finite_differences(spec: Spec, symbolic: bool):
    rng = np.random.default_rng(0)
    feeds = {
        _input_name(i): np.asarray(rng.uniform(*spec.ranges.get(i, (-2.0, 2.0)), size=entry))
        for i, entry in enumerate(spec.inputs)
        if not isinstance(entry, np.ndarray)
    }
    wrt_names = [_input_name(i) for i in spec.wrt] if spec.wrt is not None else list(feeds)
    y = _session(_forward_model(spec, feeds, None, symbolic)).run(None, feeds)[0]
    cotangent = rng.standard_normal(y.shape).astype(y.dtype)

    model = onnx.shape_inference.infer_shapes(
        _forward_model(spec, feeds, cotangent, symbolic), strict_mode=True
    )
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    values = {v.name: v for v in graph.inputs}
    loss = graph.outputs[0]
    result = build_gradients(graph, loss, [values[n] for n in wrt_names])
    graph.outputs.extend(result.grads[values[n]] for n in wrt_names)
    grad_model = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(grad_model, full_check=True)
    session = _session(grad_model)

    loss_value, *grads = session.run(None, feeds)
    for name, grad in zip(wrt_names, grads):
        assert grad.shape == feeds[name].shape, f"gradient of {name} has the wrong shape"
        assert grad.dtype == feeds[name].dtype

    direction = {n: rng.standard_normal(feeds[n].shape) for n in wrt_names}
    vjp = sum(float(np.sum(direction[n] * g)) for n, g in zip(wrt_names, grads))

    def loss_at(step: float) -> float:
        moved = {n: np.asarray(v + step * direction[n]) if n in direction else v for n, v in feeds.items()}
        return float(session.run([loss.name], moved)[0])

    finite_difference = (loss_at(spec.eps) - loss_at(-spec.eps)) / (2 * spec.eps)
    np.testing.assert_allclose(vjp, finite_difference, rtol=spec.rtol, atol=spec.rtol * 1e-3)


def test_every_rule_has_a_spec():
    missing = registered_ops() - {s.op for s in SPECS}
    assert not missing, f"gradient rules without a finite-difference spec: {sorted(missing)}"


def test_docs_list_every_rule_and_non_differentiable_op():
    documented = set(re.findall(r"`(\w+)`", (Path(__file__).parents[1] / "docs" / "ops.md").read_text()))
    missing = (registered_ops() | non_differentiable_ops()) - documented
    assert not missing, f"ops missing from docs/ops.md: {sorted(missing)}"


def test_rules_and_non_differentiable_ops_are_disjoint():
    assert not registered_ops() & non_differentiable_ops()


def test_check_supported_lists_every_unsupported_node_at_once():
    # x -> Foo -> Bar -> Foo -> loss, plus a Bar off the path (from a non-parameter input): the
    # error names all three nodes on the path, both op types, and not the off-path node.
    model = onnx.parser.parse_model(
        """
        <ir_version: 10, opset_import: ["" : 18, "test.custom" : 1]>
        g (float[3] x, float[3] other) => (float loss, float[3] side) {
            a = test.custom.Foo (x)
            b = test.custom.Bar (a)
            c = test.custom.Foo (b)
            s = Shape (c)
            r = Reshape (c, s)
            loss = ReduceSum <keepdims = 0> (r)
            side = test.custom.Bar (other)
        }
        """
    )
    graph = ir.serde.deserialize_model(model).graph
    for node, name in zip(graph, ["foo1", "bar1", "foo2", "shape", "reshape", "loss", "bar_off_path"]):
        node.name = name
    x = graph.inputs[0]
    with pytest.raises(UnsupportedOpsError) as caught:
        check_supported(graph, graph.outputs[0], [x])
    assert sorted(caught.value.nodes) == [
        ("test.custom::Bar", "bar1"),
        ("test.custom::Foo", "foo1"),
        ("test.custom::Foo", "foo2"),
    ]
    message = str(caught.value)
    for text in ("test.custom::Foo", "test.custom::Bar", "'foo1'", "'foo2'", "'bar1'", "docs/ops.md"):
        assert text in message
    assert "bar_off_path" not in message
    # Nothing differentiable reaches the loss from `other`, so nothing is unsupported there.
    check_supported(graph, graph.outputs[0], [graph.inputs[1]])
