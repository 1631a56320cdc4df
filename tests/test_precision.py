"""--precision and --grad-dtype, the transpiler's side (docs/precision.md): fp32 graphs unchanged
byte for byte; where the bf16/fp16 rewrite puts each op, its casts, the float32 master weights,
gradients and optimizer state; fp16's loss-scaling graph; the gradient buckets' dtype; the plan's
precision section. Training against PyTorch is tests/test_precision_torch.py; the CPU backend's
handling of the low-precision nodes is tests/test_precision_runtime.py."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

from commands.main import main
from contract.plan import parse_plan
from transpiler import OptimizerConfig, Options, TranspileError, build, transpile
from transpiler.collectives import collective_nodes
from transpiler.job import GROWTH_TRACKER_STATE, LOSS_SCALE_STATE, SKIPPED_OUTPUT, LossScale
from transpiler.passes.precision import FP32_OPS, LOWER_OPS, precision_json

BF16, FP16, FLOAT = ir.DataType.BFLOAT16, ir.DataType.FLOAT16, ir.DataType.FLOAT
LOW = (BF16, FP16)


def _hashes(out: Path) -> dict[str, str]:
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.onnx"))}
    plan = json.loads((out / "plan.json").read_text())
    plan.pop("versions")
    files["plan.json"] = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()
    return files


@pytest.mark.parametrize("model", ["perceptron", "gpt"])
def test_fp32_graphs_are_byte_identical_with_and_without_the_flags(model, model_dir, tmp_path, capsys):
    """`transpile MODEL` and `transpile MODEL --precision fp32 --grad-dtype fp32` write the same
    bytes: every rank graph, init graph and plan.json (two ranks, sharded and zero)."""
    source = model_dir(model) / "model.onnx"
    for strategy in ("sharded", "zero"):
        plain, flagged = tmp_path / f"plain-{strategy}", tmp_path / f"flagged-{strategy}"
        common = [str(source), "--gpus", "2", "--strategy", strategy, "--optimizer", "adamw"]
        assert main([*common, "-o", str(plain)]) == 0
        assert main([*common, "-o", str(flagged), "--precision", "fp32", "--grad-dtype", "fp32"]) == 0
        capsys.readouterr()
        assert _hashes(plain) == _hashes(flagged)
        assert len(_hashes(plain)) >= 5
        for path in plain.glob("rank*.onnx"):  # and nothing low precision in them
            text = onnx.load(path).SerializeToString()
            assert b"autocast" not in text and b"amp." not in text


def _dtypes(model: ir.Model) -> dict[str, ir.DataType]:
    return {v.name: v.dtype for v in (*model.graph.inputs, *(o for n in model.graph for o in n.outputs))}


def _forward(job) -> list[ir.Node]:
    """The forward part of the single-device step graph (before the first backward node)."""
    nodes = list(job.single.step.graph)
    end = next(i for i, n in enumerate(nodes) if "/grad" in (n.name or ""))
    return nodes[:end]


def test_bf16_gpt_follows_the_autocast_op_lists(model_dir):
    job = build(model_dir("gpt") / "model.onnx", Options(world_size=2, precision="bf16",
                                                        optimizer=OptimizerConfig("adamw", lr=1e-3)))
    forward = _forward(job)
    by_op: dict[str, Counter] = {}
    for node in forward:
        if node.op_type != "Cast" and node.outputs and node.outputs[0].dtype in (FLOAT, BF16):
            by_op.setdefault(node.op_type, Counter())[node.outputs[0].dtype] += 1
    # Matrix products (the Q/K/V/MLP/head projections) in bf16; each attention (its two products,
    # the scale, the causal mask and the float32 softmax between) is one fused node on bf16 heads,
    # its rows' log-sum-exp float32 (transpiler/attention.py).
    assert by_op["MatMul"] == Counter({BF16: 25}) and by_op["Attention"] == Counter({BF16: 4})
    assert all(n.outputs[1].dtype == FLOAT for n in forward if n.op_type == "Attention")
    assert not {"Softmax", "Where"} & set(by_op)
    # LayerNorm and the loss: float32.
    for op in ("LayerNormalization", "SoftmaxCrossEntropyLoss"):
        assert set(by_op[op]) == {FLOAT}, op
    # A bias added to a bf16 output is float32 (a float32 parameter meets it: torch's type promotion).
    assert set(by_op["Add"]) == {FLOAT}
    loss = job.problem.loss
    assert _dtypes(job.single.step)[loss] == FLOAT
    report = job.precision_report["single"]
    assert report["low_precision_ops"]["MatMul"] == 33 and report["opset"] == 18
    assert report["fused_attention"] == 4


def test_casts_are_made_once_per_value(model_dir):
    """No value is cast to the same dtype twice, in the forward or in the whole step graph; a
    parameter's bf16 copy is a cast in the forward, shared by its readers."""
    job = build(model_dir("gpt") / "model.onnx", Options(precision="bf16"))
    for graph in (job.single.step.graph, job.ranks[0].step.graph):
        pairs = Counter((n.inputs[0].name, n.attributes["to"].as_int()) for n in graph if n.op_type == "Cast")
        assert max(pairs.values()) == 1, [p for p, c in pairs.items() if c > 1][:5]
    # Every bf16 cast reads a float32 value: nothing is cast down twice, nor up and down again.
    assert all(n.inputs[0].dtype == FLOAT for n in job.single.step.graph
               if n.op_type == "Cast" and n.attributes["to"].as_int() == BF16)
    # The perceptron's Gemms read its weights directly: each weight's bf16 copy is one cast.
    job = build(model_dir("perceptron") / "model.onnx", Options(precision="bf16"))
    params = set(job.problem.params)
    casts = [n for n in _forward(job) if n.op_type == "Cast" and n.inputs[0].name in params]
    assert sorted(n.inputs[0].name for n in casts) == sorted(params)
    assert all(n.outputs[0].dtype == BF16 for n in casts)


def test_casts_sit_before_the_moves_and_never_round_trip(model_dir):
    """A float32 value that reaches the low-precision products only through moves (an attention's
    query: the bias Add, Reshape, Transpose) is cast before the moves, next to the node that made
    it; and no gradient is cast up and straight down again (the backward of such a cast)."""
    job = build(model_dir("gpt") / "model.onnx", Options(precision="bf16"))
    graph = job.single.step.graph
    moves = {"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"}
    down = [n for n in graph if n.op_type == "Cast" and n.attributes["to"].as_int() == BF16]
    assert not [n.name for n in down if (p := n.inputs[0].producer()) is not None and p.op_type in moves]
    queries = [n for n in down if (p := n.inputs[0].producer()) is not None and p.op_type == "Add"
               and any(u.node.op_type == "Reshape" for u in n.outputs[0].uses())]
    assert len(queries) == 12  # Q, K and V of each of the 4 blocks
    round_trips = [n.name for n in down if (p := n.inputs[0].producer()) is not None and p.op_type == "Cast"
                   and p.inputs[0].dtype == BF16]
    assert round_trips == []


def test_master_weights_gradients_and_optimizer_state_stay_float32(model_dir):
    job = build(model_dir("gpt") / "model.onnx", Options(world_size=2, precision="bf16",
                                                        optimizer=OptimizerConfig("adamw", lr=1e-3)))
    for rank in job.ranks:
        assert {e.dtype for e in rank.state} == {FLOAT}
        graph = rank.step.graph
        # Every gradient reaches its collective in float32: the Cast rule casts it back after the
        # backward's bf16 matrix product.
        for node in collective_nodes(graph):
            assert {v.dtype for v in node.inputs if v is not None} <= {FLOAT}, node.name
        for node in graph:
            if node.domain == "graph_transpiler.optimizer":
                assert {v.dtype for v in (*node.inputs, *node.outputs) if v is not None} == {FLOAT}
    # The gradient of a parameter read by a bf16 matmul is the Cast (to float32) of a bf16 value.
    grads = {v.name: v for n in job.variants["single"][0].graph for v in n.outputs}
    weight = next(p for p in job.problem.params if p.endswith("attn.q.weight"))
    grad = grads[job.grad_names[weight]]
    assert grad.dtype == FLOAT
    producer = grad.producer()
    while producer.op_type == "Identity":
        producer = producer.inputs[0].producer()
    assert producer.op_type == "Cast" and producer.inputs[0].dtype == BF16


def test_bf16_cnn_runs_conv_in_bf16_at_opset_22_and_batchnorm_statistics_in_float32(model_dir):
    job = build(model_dir("cnn_small") / "model.onnx", Options(precision="bf16"))
    model = job.single.step
    assert model.graph.opset_imports[""] == 22
    forward = _forward(job)
    convs = [n for n in forward if n.op_type == "Conv"]
    assert convs and all(n.outputs[0].dtype == BF16 for n in convs)
    norms = [n for n in forward if n.op_type == "BatchNormTraining"]
    assert norms
    for node in norms:
        assert {v.dtype for v in node.inputs} == {FLOAT} and {v.dtype for v in node.outputs} == {FLOAT}
        # Y is rounded back to bf16 for its readers (torch: batch_norm keeps its input's dtype).
        assert {use.node.op_type for use in node.outputs[0].uses()} == {"Cast"}
    # The model-local functions were rebuilt for opset 22.
    for function in model.functions.values():
        assert function.opset_imports.get("", 22) == 22
    assert job.precision_report["single"]["note"].startswith("opset raised from 18 to 22")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_rank_graphs_are_standard_onnx(precision, model_dir, tmp_path, capsys):
    """onnx.checker with full_check (strict type and shape inference) accepts every graph written."""
    for model in ("perceptron", "cnn_small"):
        out = tmp_path / f"{model}-{precision}"
        assert main([str(model_dir(model) / "model.onnx"), "-o", str(out), "--gpus", "2",
                     "--precision", precision, "--grad-dtype", "bf16"]) == 0
        capsys.readouterr()
        for path in out.glob("*.onnx"):
            onnx.checker.check_model(onnx.load(path), full_check=True)


def test_the_op_lists_are_disjoint_and_name_real_ops():
    assert not LOWER_OPS & FP32_OPS
    for op in LOWER_OPS | FP32_OPS:
        if op not in ("Attention", "RMSNormalization", "SimplifiedLayerNormalization"):
            onnx.defs.get_schema(op, 22, "")


@pytest.mark.parametrize("strategy", ["allreduce", "sharded", "zero"])
def test_grad_dtype_bf16_buckets_are_bf16_in_the_rank_graphs(strategy, model_dir):
    """--grad-dtype bf16: every gradient collective moves bf16 tensors (half the bytes), named
    as before; the update reads them as float32; the single-device graph has no cast."""
    source = model_dir("perceptron") / "model.onnx"
    plain = build(source, Options(world_size=2, strategy=strategy))
    job = build(source, Options(world_size=2, strategy=strategy, grad_dtype="bf16"))
    for rank, plain_rank in zip(job.ranks, plain.ranks):
        graph = rank.step.graph
        reducing = [n for n in collective_nodes(graph) if n.op_type in ("AllReduce", "Reduce", "ReduceScatter")]
        assert reducing
        for node in reducing:
            assert {v.dtype for v in (*node.inputs, *node.outputs) if v is not None} == {BF16}
        plain_names = [v.name for n in collective_nodes(plain_rank.step.graph) for v in n.inputs]
        assert [v.name for n in collective_nodes(graph) for v in n.inputs] == plain_names
        for node in graph:
            if node.domain == "graph_transpiler.optimizer":
                assert node.inputs[1].dtype == FLOAT
    assert not [n for n in job.single.step.graph if n.op_type == "Cast" and n.attributes["to"].as_int() == BF16]


def test_fp16_step_graph_scales_checks_and_skips(model_dir):
    source = model_dir("perceptron") / "model.onnx"
    for strategy, flag_collective in (("sharded", True), ("zero", True), ("allreduce", False)):
        job = build(source, Options(world_size=2, strategy=strategy, precision="fp16",
                                    optimizer=OptimizerConfig("adam", lr=1e-3)))
        for rank in job.ranks:
            kinds = {e.input: e.kind for e in rank.state}
            assert kinds[LOSS_SCALE_STATE] == kinds[GROWTH_TRACKER_STATE] == "loss_scale"
            graph = rank.step.graph
            assert SKIPPED_OUTPUT in [v.name for v in graph.outputs]
            # Every updated value (parameters, Adam's moments, the step counter) is kept where skipped.
            kept = [n for n in graph if n.name.endswith("/kept_if_skipped")]
            updated = [e for e in rank.state if e.kind in ("optimizer", "step")]
            if rank.updates:
                assert len(kept) >= len(updated)
            flags = [n for n in collective_nodes(graph) if "amp.nonfinite" in " ".join(v.name for v in n.inputs)
                     or any(v.name == "amp.nonfinite.global" for v in n.outputs)]
            assert bool(flags) == flag_collective, strategy
    # The backward differentiates loss * scale: the forward reads the scale state.
    assert job.differentiated == f"{job.problem.loss}.scaled"


def test_options_are_validated():
    with pytest.raises(TranspileError, match="--precision 'fp8'"):
        Options(precision="fp8").validate()
    with pytest.raises(TranspileError, match="--grad-dtype"):
        Options(grad_dtype="int8").validate()
    with pytest.raises(TranspileError, match="growth_interval"):
        Options(precision="fp16", loss_scale=LossScale(growth_interval=0)).validate()
    assert Options(precision="bf16").loss_scaling is None and Options(precision="fp16").loss_scaling == LossScale()


def test_cli_takes_the_flags(model_dir, tmp_path, capsys):
    assert main([str(model_dir("perceptron") / "model.onnx"), "-o", str(tmp_path / "x"), "--precision", "fp64"]) == 2
    assert "--precision: invalid choice: 'fp64'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_the_plan_records_the_precision(model_dir, tmp_path):
    """precision_json is what plan.json's ``precision`` section holds; contract.plan reads it."""
    from transpiler.plan import plan_json, write_out

    job = build(model_dir("perceptron") / "model.onnx",
                Options(world_size=2, precision="fp16", grad_dtype="bf16", loss_scale=LossScale(growth_interval=7)))
    section = precision_json(job)
    assert section["compute"] == "fp16" and section["grad_dtype"] == "bf16"
    assert section["loss_scaling"] == {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                       "growth_interval": 7, "scale_state": LOSS_SCALE_STATE,
                                       "growth_tracker_state": GROWTH_TRACKER_STATE, "skipped_output": SKIPPED_OUTPUT}
    assert precision_json(build(model_dir("perceptron") / "model.onnx", Options())) is None
    write_out(job, tmp_path / "out")
    raw = plan_json(job)
    assert raw["precision"] == section
    assert "precision" not in plan_json(build(model_dir("perceptron") / "model.onnx", Options()))
    plan = parse_plan(json.loads((tmp_path / "out" / "plan.json").read_text()), tmp_path / "out" / "plan.json")
    assert plan.precision.compute == "fp16" and plan.precision.loss_scaling.growth_interval == 7
    assert plan.precision.loss_scaling.skipped_output == SKIPPED_OUTPUT
    raw = json.loads((tmp_path / "out" / "plan.json").read_text())
    raw["precision"] = {"compute": "fp8", "grad_dtype": "fp32"}
    with pytest.raises(Exception, match="precision.compute"):
        parse_plan(raw, tmp_path / "out" / "plan.json")


def test_a_backend_without_low_precision_collectives_refuses_grad_dtype(model_dir, tmp_path):
    """A backend that does not declare low-precision collectives (Backend.sends_low_precision)
    refuses a --grad-dtype plan in one line, never runs it with fp32 on the wire behind the user's
    back (the nccl backend did so until a GPU run checked its bf16 buckets)."""
    from runtime.collectives import LocalGroup
    from runtime.errors import RunError
    from runtime.executor import CpuBackend
    from runtime.plan import load_plan
    from runtime.trainer import Trainer

    class NotCpu(CpuBackend):
        name = "other"
        sends_low_precision = False

    transpile(model_dir("perceptron") / "model.onnx", tmp_path / "out",
              Options(world_size=2, precision="bf16", grad_dtype="bf16"))
    with pytest.raises(RunError, match="--grad-dtype bf16, whose collectives the other backend does not run yet"):
        Trainer(load_plan(tmp_path / "out"), LocalGroup(2).communicator(0), rank=0, backend=NotCpu())
    transpile(model_dir("perceptron") / "model.onnx", tmp_path / "out2", Options(world_size=2, precision="bf16"))
    Trainer(load_plan(tmp_path / "out2"), LocalGroup(2).communicator(0), rank=0, backend=NotCpu())
