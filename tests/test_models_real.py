"""Real models exported from PyTorch, through both exporters: gradients == autograd, 5 SGD steps ==
torch.optim.SGD (running statistics included), N ranks == 1 device.

Models (small sizes, CPU, float32):
- ``mlp``: Linear(16, 32) - ReLU - Linear(32, 10), cross-entropy (Gemm, Relu, SoftmaxCrossEntropyLoss);
- ``cnn``: models.cnn.ResNet, width 8, stages [1, 1], with the stem MaxPool: Conv, BatchNormalization
  (training mode: batch statistics, running-statistics buffers), Relu, MaxPool, residual Add,
  GlobalAveragePool (dynamo: ReduceMean), Gemm, cross-entropy;
- ``gpt``: models.gpt.GPT, 2 layers x 32, 4 heads, vocab 64, sequence 16: Gather (embedding), a
  positional parameter (Slice), LayerNormalization, Q/K/V MatMuls, causal mask (Trilu, Not, Where),
  Softmax, GELU (Erf), cross-entropy.

Gradients come from ``transpiler.build(...).fwd_bwd`` (outputs: loss, grad.<param>...) run by
onnxruntime on one batch, and are compared with autograd on the same batch, relative to each
gradient's largest element (tests/conftest.py ``max_rel_error``) within 1e-4.

``python3 -m pytest -s tests/test_models_real.py`` prints the measured errors at the end.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
from conftest import assert_replicas_identical, max_rel_error  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from models import cnn, gpt  # noqa: E402
from models.torch_twins import export_onnx  # noqa: E402

TOLERANCE = 1e-4
STEPS = 5
LR = 0.1
EXPORTERS = ["torchscript", "dynamo"]
MODELS = ["mlp", "cnn", "gpt"]
BATCH = {"mlp": 16, "cnn": 16, "gpt": 8}  # divisible by 4 ranks
ROWS = {"mlp": 48, "cnn": 40, "gpt": 24}  # not multiples of the batch: the steps wrap around

CNN_CONFIG = cnn.CNNConfig(width=8, depth=(1, 1), num_classes=10, in_channels=3, image_size=16, stem_pool=True)
GPT_CONFIG = gpt.SMALL  # 2 layers x 32, 4 heads, vocab 64, sequence 16

# (model, exporter) cases that cannot pass, with the exact reason (none known: torch 2.13).
XFAIL: dict[tuple[str, str], str] = {}

RESULTS: dict[tuple[str, ...], dict[str, float]] = {}
EXPORT_INFO: dict[tuple[str, str], str] = {}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(torch.relu(self.fc1(x))), labels)


def make_module(model: str) -> nn.Module:
    if model == "mlp":
        torch.manual_seed(0)
        return MLP()
    if model == "cnn":
        return cnn.make_module(CNN_CONFIG, seed=0)
    return gpt.make_module(GPT_CONFIG, seed=0)


def make_data(model: str) -> dict[str, np.ndarray]:
    """Arrays keyed by input name, in forward()'s argument order."""
    rows = ROWS[model]
    if model == "mlp":
        rng = np.random.default_rng(0)
        return {"x": rng.standard_normal((rows, 16), dtype=np.float32),
                "labels": rng.integers(0, 10, size=rows, dtype=np.int64)}
    if model == "cnn":
        return cnn.make_data(CNN_CONFIG, 0, rows)
    return gpt.make_data(GPT_CONFIG, 0, rows)


def batch_of(data: dict[str, np.ndarray], step: int, batch: int) -> dict[str, np.ndarray]:
    """Global batch ``step``: rows [step*B, (step+1)*B) modulo the data (docs/contracts.md)."""
    rows = len(next(iter(data.values())))
    index = np.arange(step * batch, (step + 1) * batch) % rows
    return {k: v[index] for k, v in data.items()}


def torch_state(module: nn.Module) -> dict[str, np.ndarray]:
    """Parameters and float buffers (BatchNorm running statistics), by name."""
    state = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    state.update({n: b.detach().numpy().copy() for n, b in module.named_buffers() if b.is_floating_point()})
    return state


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(model, exporter)`` -> (model.onnx, the torch module it came from, data)."""
    cache: dict[tuple[str, str], tuple[Path, nn.Module, dict[str, np.ndarray]]] = {}

    def get(model: str, exporter: str):
        if (model, exporter) in XFAIL:
            pytest.xfail(XFAIL[model, exporter])
        if (model, exporter) not in cache:
            if exporter == "dynamo":
                pytest.importorskip("onnxscript")
            module, data = make_module(model), make_data(model)
            path = tmp_path_factory.mktemp(f"{model}-{exporter}") / "model.onnx"
            args = tuple(torch.from_numpy(v[:4].copy()) for v in data.values())
            start = time.perf_counter()
            export_onnx(module, args, path, input_names=list(data), output_names=["loss"],
                        dynamo=exporter == "dynamo")
            proto = onnx.load(str(path))
            ops = Counter(n.op_type for n in proto.graph.node)
            opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
            EXPORT_INFO[model, exporter] = (f"opset {opset}, {time.perf_counter() - start:.1f} s, "
                                            + ", ".join(f"{k} {v}" for k, v in sorted(ops.items())))
            # Every torch parameter and float buffer has its own initializer, with torch's value
            # (an exporter that merged equal initializers would tie parameters).
            arrays = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
            for name, value in torch_state(module).items():
                assert name in arrays, f"{exporter} exporter dropped or renamed {name!r} (has {sorted(arrays)})"
                np.testing.assert_array_equal(arrays[name], value, err_msg=name)
            assert not [n.domain for n in proto.graph.node if n.domain not in ("", "ai.onnx")], "custom-domain ops"
            cache[model, exporter] = (path, module, data)
        return cache[model, exporter]

    return get


# ---------------------------------------------------------------------------------------------
# Gradients of one batch == autograd


def grad_error(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> float:
    """max_rel_error, except that a gradient is measured against at least 1e-3 of the largest
    gradient element of the model: the attention key bias has an analytically zero gradient
    (softmax is invariant to adding one constant to a row of scores), so both sides hold ~1e-12
    rounding noise that no relative measure can compare."""
    floor = 1e-3 * max(float(np.max(np.abs(e))) for e in expected.values())
    worst = 0.0
    for name, e in expected.items():
        a = actual[name]
        assert a.shape == e.shape and a.dtype == e.dtype, name
        scale = max(float(np.max(np.abs(e))), floor)
        worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - e.astype(np.float64)))) / scale)
    return worst


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("model", MODELS)
def test_gradients_equal_autograd(model, exporter, exported):
    import onnxruntime as ort

    from transpiler import Options, build

    path, module, data = exported(model, exporter)
    feeds = batch_of(data, 0, BATCH[model])
    job = build(path, Options(world_size=1))
    names = sorted(job.grad_names)
    assert names == sorted(n for n, _ in module.named_parameters()), "trainable parameters differ from torch's"

    # fwd_bwd: one ModelProto, or (with the BatchNorm pass) {"single": ..., "ranks": ...}.
    fwd_bwd = job.fwd_bwd["single"] if isinstance(job.fwd_bwd, dict) else job.fwd_bwd
    session = ort.InferenceSession(fwd_bwd.SerializeToString(), providers=["CPUExecutionProvider"])
    wanted = [job.problem.loss] + [job.grad_names[n] for n in names]
    outputs = session.run(wanted, feeds)
    loss, grads = float(outputs[0]), dict(zip(names, outputs[1:]))

    reference = copy.deepcopy(module).train()
    torch_loss = reference(*(torch.from_numpy(v) for v in feeds.values()))
    torch_loss.backward()
    expected = {n: p.grad.numpy() for n, p in reference.named_parameters()}

    error = grad_error(grads, expected)
    torch_loss = float(torch_loss.detach())
    loss_error = abs(loss - torch_loss) / abs(torch_loss)
    RESULTS["grad", model, exporter] = {"grad": error, "loss": loss_error}
    assert loss_error <= TOLERANCE, f"loss {loss} vs torch {torch_loss}"
    assert error <= TOLERANCE, f"max relative gradient error {error:.3g} vs autograd"


# ---------------------------------------------------------------------------------------------
# 5 SGD steps on one device == torch.optim.SGD


def train_torch(module: nn.Module, data: dict[str, np.ndarray], batch: int) -> tuple[list[float], dict]:
    module = copy.deepcopy(module).train()
    optimizer = torch.optim.SGD(module.parameters(), lr=float(np.float32(LR)), foreach=False)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = module(*(torch.from_numpy(v) for v in batch_of(data, step, batch).values()))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, torch_state(module)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("model", MODELS)
def test_sgd_steps_equal_torch(model, exporter, exported, tmp_path):
    from runtime import simulate
    from transpiler import OptimizerConfig, Options, transpile

    path, module, data = exported(model, exporter)
    transpile(path, tmp_path / "out", Options(world_size=1, optimizer=OptimizerConfig("sgd", lr=LR)))
    result = simulate(tmp_path / "out", data, batch=BATCH[model], steps=STEPS, single_device=True)
    torch_losses, expected = train_torch(module, data, BATCH[model])

    ours = result.parameters[0]
    # Parameters, and for the CNN the BatchNorm running statistics (state of kind "buffer").
    assert sorted(ours) == sorted(expected), "trained state differs from torch's parameters and buffers"
    error = max_rel_error(ours, expected)
    loss_error = float(np.max(np.abs(np.array(result.losses) - torch_losses) / np.abs(torch_losses)))
    moved = max_rel_error(expected, torch_state(module))
    RESULTS["sgd", model, exporter] = {"params": error, "loss": loss_error, "moved": moved}
    np.testing.assert_allclose(result.losses, torch_losses, rtol=TOLERANCE)
    assert error <= TOLERANCE, f"max relative error {error:.3g} vs torch.optim.SGD"
    assert moved > 1e-3, "training did not move the parameters"


# ---------------------------------------------------------------------------------------------
# N ranks == 1 device


def run_ranks(path: Path, data, batch: int, tmp_path: Path, **options):
    from runtime import simulate
    from transpiler import OptimizerConfig, Options, transpile

    opt = OptimizerConfig("sgd", lr=LR)
    transpile(path, tmp_path / "one", Options(world_size=1, optimizer=opt, **{k: v for k, v in options.items()
                                                                             if k == "sync_bn"}))
    one = simulate(tmp_path / "one", data, batch=batch, steps=STEPS, single_device=True)
    transpile(path, tmp_path / "four", Options(world_size=4, optimizer=opt, **options))
    four = simulate(tmp_path / "four", data, batch=batch, steps=STEPS)
    assert_replicas_identical(four.parameters)
    return one, four


@pytest.mark.parametrize("strategy", ["sharded", "allreduce"])
def test_gpt_four_ranks_equal_one_device(strategy, exported, tmp_path):
    path, _, data = exported("gpt", "torchscript")
    one, four = run_ranks(path, data, BATCH["gpt"], tmp_path, strategy=strategy)
    error = max_rel_error(four.parameters[0], one.parameters[0])
    RESULTS["ranks", "gpt", strategy] = {"params": error}
    assert error <= 1e-5, f"max relative error {error:.3g} vs one device"
    np.testing.assert_allclose(four.losses, one.losses, rtol=1e-5)


def test_cnn_sync_bn_four_ranks_equal_one_device(exported, tmp_path):
    """With sync_bn the BatchNorm statistics are all-reduced: each rank normalizes its 4 images with
    the statistics of all 16, so 4 ranks compute what one device computes (running stats too)."""
    path, _, data = exported("cnn", "torchscript")
    one, four = run_ranks(path, data, BATCH["cnn"], tmp_path, strategy="allreduce", sync_bn=True)
    assert any("running_var" in n for n in four.parameters[0]), "running statistics are not exported state"
    error = max_rel_error(four.parameters[0], one.parameters[0])
    RESULTS["ranks", "cnn", "sync_bn"] = {"params": error}
    assert error <= TOLERANCE, f"max relative error {error:.3g} vs one device"
    np.testing.assert_allclose(four.losses, one.losses, rtol=TOLERANCE)


def test_report():
    """Print exporter findings and measured errors (visible with -s); runs last in this file."""
    if not RESULTS and not EXPORT_INFO:
        pytest.skip("no case ran")
    for (model, exporter), info in EXPORT_INFO.items():
        print(f"\n{model:<4} {exporter:<12} {info}")
    for key, values in RESULTS.items():
        print(" ".join(key).ljust(28), "  ".join(f"{k} {v:.3g}" for k, v in values.items()))
