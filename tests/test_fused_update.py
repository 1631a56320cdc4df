"""The fused optimizer update ops (domain graph_transpiler.optimizer) on CPU.

- A fused node (``emit_fused_update``) computes bit for bit what ``emit_update``'s ops compute, once
  onnxruntime has inlined its function body, and the rank graphs pass onnx.checker.
- The NumPy reference of the GPU kernel's arithmetic (runtime/update_reference.py) equals the function
  body bit for bit (both round torch's fused multiply-adds through float64) and torch within 1e-6.
- segments.py cuts update nodes out into NativeGroup items for a backend that asks for them, in
  topological order, and a CPU backend running those groups with the reference trains bit for bit
  like onnxruntime running the function bodies, on one device and on 2 ranks of every strategy.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from conftest import load_data
from test_optimizer import CASES, PARAM_SHAPE, STEPS, correctly_rounded_sqrt, learning_rates, torch_optimizer

import runtime.trainer
from contract.ops import FUSED_UPDATE_DOMAIN
from runtime import simulate
from runtime.collectives import CollectiveOp
from runtime.executor import CpuBackend
from runtime.segments import NativeGroup, Segment, cut_graph
from runtime.update_reference import ReferenceUpdateRunner, UpdateOp, reference_update
from transpiler import OptimizerConfig, Options, transpile
from transpiler.optimizer import emit_step_increment, emit_update
from transpiler.update_node import emit_fused_update


def _step_model(config: OptimizerConfig, *, fused: bool) -> onnx.ModelProto:
    """Inputs w, w.grad, lr, [optimizer.step], w.<slot>; outputs the updates (as test_optimizer's)."""
    graph = ir.Graph(inputs=[], outputs=[], nodes=[], opset_imports={"": 18}, name="optimizer_step")
    model = ir.Model(graph, ir_version=10)

    def add_input(name, shape):
        value = ir.val(name, ir.DataType.FLOAT, ir.Shape(shape))
        graph.inputs.append(value)
        return value

    param, grad, lr = add_input("w", PARAM_SHAPE), add_input("w.grad", PARAM_SHAPE), add_input("lr", [])
    step = add_input("optimizer.step", []) if config.uses_step() else None
    state = {slot: add_input(f"w.{slot}", PARAM_SHAPE) for slot in config.slots()}
    step_next = emit_step_increment(graph, step) if step is not None else None
    emit = emit_fused_update if fused else emit_update
    new_param, new_state = emit(model if fused else graph, config, param=param, grad=grad, lr=lr, step=step_next,
                                state=state, name="w")
    graph.outputs.extend([new_param, *(new_state[slot] for slot in config.slots())])
    if step_next is not None:
        graph.outputs.append(step_next)
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def _trajectory(config: OptimizerConfig, seed: int = 0):
    """Inputs of STEPS consecutive updates: (lr, step after increment, grad) and the initial value."""
    rng = np.random.default_rng(seed)
    initial = rng.standard_normal(PARAM_SHAPE).astype(np.float32)
    grads = [(rng.standard_normal(PARAM_SHAPE) * 10.0 ** rng.uniform(-2, 1)).astype(np.float32) for _ in range(STEPS)]
    return initial, list(zip(learning_rates(config), range(1, STEPS + 1), grads))


def _run_onnx(config: OptimizerConfig, fused: bool, seed: int = 0) -> list[list[np.ndarray]]:
    session = ort.InferenceSession(_step_model(config, fused=fused).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    initial, steps = _trajectory(config, seed)
    state = [initial, *(np.zeros(PARAM_SHAPE, np.float32) for _ in config.slots())]
    history = []
    for lr, t, grad in steps:
        feeds = {"w": state[0], "w.grad": grad, "lr": np.array(lr, np.float32),
                 **{f"w.{slot}": value for slot, value in zip(config.slots(), state[1:])}}
        if config.uses_step():
            feeds["optimizer.step"] = np.array(t - 1, np.float32)
        state = session.run(None, feeds)[:1 + len(config.slots())]
        history.append(state)
    return history


def _fused_op(config: OptimizerConfig) -> UpdateOp:
    node = next(n for n in _step_model(config, fused=True).graph.node if n.domain == FUSED_UPDATE_DOMAIN)
    return UpdateOp.from_node(node, "test")


def _run_reference(config: OptimizerConfig, seed: int = 0) -> list[list[np.ndarray]]:
    op = _fused_op(config)
    initial, steps = _trajectory(config, seed)
    state = [initial, *(np.zeros(PARAM_SHAPE, np.float32) for _ in config.slots())]
    history = []
    for lr, t, grad in steps:
        state = reference_update(op, np.float32(lr), np.float32(t) if config.uses_step() else None, state[0], grad,
                                 state[1:])
        history.append(state)
    return history


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_node_equals_the_standard_ops_bitwise(case):
    config = CASES[case].validate()
    for t, (fused, plain) in enumerate(zip(_run_onnx(config, True), _run_onnx(config, False))):
        for name, a, b in zip(["param", *config.slots()], fused, plain):
            np.testing.assert_array_equal(a, b, err_msg=f"{case}: {name} after step {t + 1}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_equals_the_function_body_bitwise(case):
    config = CASES[case].validate()
    for seed in range(3):
        for t, (ours, body) in enumerate(zip(_run_reference(config, seed), _run_onnx(config, True, seed))):
            for name, a, b in zip(["param", *config.slots()], ours, body):
                assert a.dtype == np.float32
                np.testing.assert_array_equal(a, b, err_msg=f"{case} seed {seed}: {name} after step {t + 1}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_is_torch_within_1e_6(case, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "sqrt", correctly_rounded_sqrt)
    config = CASES[case].validate()
    initial, steps = _trajectory(config)
    parameter = torch.nn.Parameter(torch.from_numpy(initial.copy()))
    optimizer = torch_optimizer(config, parameter)
    for (lr, _, grad), ours in zip(steps, _run_reference(config)):
        optimizer.param_groups[0]["lr"] = lr
        parameter.grad = torch.from_numpy(grad.copy())
        optimizer.step()
        np.testing.assert_allclose(ours[0], parameter.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_fused_node_reads_as_its_optimizer():
    model = _step_model(OptimizerConfig("adamw", lr=1e-3, betas=(0.8, 0.99)), fused=True)
    (node,) = [n for n in model.graph.node if n.domain == FUSED_UPDATE_DOMAIN]
    assert node.op_type == "AdamW" and list(node.input) == ["w", "w.grad", "lr", "optimizer.step.next",
                                                            "w.exp_avg", "w.exp_avg_sq"]
    assert list(node.output) == ["w.next", "w.exp_avg.next", "w.exp_avg_sq.next"]
    assert UpdateOp.from_node(node, "test").h == {"beta1": 0.8, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.01}
    (function,) = model.functions
    assert (function.domain, function.name) == (FUSED_UPDATE_DOMAIN, "AdamW")
    assert {o.domain: o.version for o in model.opset_import}[FUSED_UPDATE_DOMAIN] == 1


def test_one_graph_holds_one_configuration():
    graph = ir.Graph(inputs=[], outputs=[], nodes=[], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    lr = ir.val("lr", ir.DataType.FLOAT, ir.Shape([]))
    for index, wd in enumerate((0.0, 0.0, 0.1)):
        param = ir.val(f"p{index}", ir.DataType.FLOAT, ir.Shape([2]))
        config = OptimizerConfig("sgd", weight_decay=wd)
        if index < 2:
            emit_fused_update(model, config, param=param, grad=param, lr=lr, step=None, state={}, name=f"p{index}")
        else:
            with pytest.raises(ValueError, match="one configuration"):
                emit_fused_update(model, config, param=param, grad=param, lr=lr, step=None, state={}, name="p2")
    assert len(model.functions) == 1


def _check_topological(cut, graph_inputs) -> None:
    available = set(graph_inputs) | set(cut.constants)
    for item in cut.items:
        missing = [name for name in item.inputs if name not in available]
        assert not missing, f"{type(item).__name__} reads {missing} before they exist"
        available |= set(item.outputs)


@pytest.mark.parametrize("strategy", ["allreduce", "sharded", "zero"])
def test_update_nodes_become_native_groups_in_order(strategy, model_dir, tmp_path):
    options = Options(world_size=2, strategy=strategy, optimizer=OptimizerConfig("adamw"), bucket_mb=0.0001)
    plan = transpile(model_dir("perceptron") / "model.onnx", tmp_path / "out", options)
    assert len(plan["buckets"]) > 1
    for rank in range(2):
        model = onnx.load(str(tmp_path / "out" / plan["graphs"]["ranks"][rank]["step"]))  # ranks may share a file
        updates = sum(n.domain == FUSED_UPDATE_DOMAIN for n in model.graph.node)
        plain = cut_graph(model, rank, "rank.onnx", split_tail=True)
        cut = cut_graph(model, rank, "rank.onnx", split_tail=True, native_domains={FUSED_UPDATE_DOMAIN},
                        late_domains={FUSED_UPDATE_DOMAIN})
        assert not plain.native_groups
        groups = cut.native_groups
        assert sum(len(g.nodes) for g in groups) == updates > 0
        assert all(n.domain == FUSED_UPDATE_DOMAIN for g in groups for n in g.nodes)
        assert all(n.domain != FUSED_UPDATE_DOMAIN for s in cut.segments for n in s.model.graph.node)
        assert [type(i) for i in cut.items if isinstance(i, CollectiveOp)] == [type(i) for i in plain.collectives]
        _check_topological(cut, [i.name for i in model.graph.input])
        for item in cut.items:
            if isinstance(item, Segment):
                onnx.checker.check_model(item.model)
    # One device, no collectives: the whole step is one segment, then every update in one group.
    transpile(model_dir("perceptron") / "model.onnx", tmp_path / "single", Options(optimizer=OptimizerConfig("adamw")))
    model = onnx.load(str(tmp_path / "single" / "train.onnx"))
    cut = cut_graph(model, 0, "train.onnx", split_tail=True, native_domains={FUSED_UPDATE_DOMAIN},
                        late_domains={FUSED_UPDATE_DOMAIN})
    assert [type(i).__name__ for i in cut.items] == ["Segment", "NativeGroup"]
    assert len(cut.items[1].nodes) == 4


class ReferenceBackend(CpuBackend):
    """The CPU backend with the fused updates taken out of onnxruntime and run by the NumPy reference,
    as the GPU backend takes them out for its kernel."""

    native_domains = late_native_domains = frozenset({FUSED_UPDATE_DOMAIN})

    def __init__(self, threads: int | None = None):
        super().__init__(threads)

    def compile(self, segment, where):
        if isinstance(segment, NativeGroup):
            return ReferenceUpdateRunner(segment, where)
        return super().compile(segment, where)


@pytest.mark.parametrize(("world", "strategy"), [(1, "sharded"), (2, "allreduce"), (2, "sharded"), (2, "zero")])
@pytest.mark.parametrize("opt", ["momentum", "adamw"])
def test_native_groups_train_like_the_function_bodies(world, strategy, opt, model_dir, tmp_path, monkeypatch):
    config = {"momentum": OptimizerConfig("momentum", lr=1e-3, nesterov=True, weight_decay=1e-3),
              "adamw": OptimizerConfig("adamw", lr=1e-2)}[opt]
    options = Options(world_size=world, strategy=strategy, optimizer=config, bucket_mb=0.0001)
    transpile(model_dir("perceptron") / "model.onnx", tmp_path / "out", options)
    data = load_data(model_dir("perceptron") / "data.npz")
    plain = simulate(tmp_path / "out", data, batch=16, steps=5)
    monkeypatch.setattr(runtime.trainer, "CpuBackend", ReferenceBackend)
    native = simulate(tmp_path / "out", data, batch=16, steps=5)
    for rank, (a, b) in enumerate(zip(native.states, plain.states)):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"rank {rank} {name}")


def test_gpt_step_graph_has_one_update_node_per_parameter(model_dir, tmp_path):
    transpile(model_dir("gpt") / "model.onnx", tmp_path / "out", Options(optimizer=OptimizerConfig("adamw")))
    model = onnx.load(str(tmp_path / "out" / "train.onnx"))
    ops = collections.Counter(n.op_type for n in model.graph.node)
    params = sum(1 for i in model.graph.input if i.name + ".exp_avg" in {j.name for j in model.graph.input})
    assert ops["AdamW"] == params > 0
    assert ops["Cast"] < 20 and ops["Pow"] == 0  # the float64 update math lives in the function body
