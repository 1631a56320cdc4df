"""The zoo: the architectures people train today (tests/zoo_models.py), tiny and random-init, from
both PyTorch exporters at several opsets, transpiled for 2 ranks and trained 3 SGD steps in the
CPU simulator; the trained parameters must equal PyTorch's own 3 SGD steps on the same data.

The measure is tests/conftest.py's ``max_rel_error`` (max |ours - torch| relative to the tensor's
largest element) over the trained tensors with a resolvable update (see below), within 1e-4; the
global losses match within 1e-4 too.
``python -m pytest -s tests/test_zoo.py`` prints the table of docs/models.md at the end (and writes
it to $ZOO_TABLE when set).

Exports are made once per session. A case that cannot pass is xfail(strict=True) with the first
line of its error, so a fix shows up as an XPASS failure.
"""

from __future__ import annotations

import copy
import os
import re
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")
from conftest import assert_replicas_identical, max_rel_error  # noqa: E402
from test_models_real import batch_of  # noqa: E402
from zoo_models import ZOO  # noqa: E402

from models.torch_twins import export_onnx  # noqa: E402

TOLERANCE = 1e-4
RESOLVABLE = 1e-5
STEPS = 3
LR = 0.1
BATCH = 4  # 2 rows per rank
ROWS = 3 * BATCH
WORLD = 2

# (exporter, opset) per model: both exporters at their default opsets, more where cheap. The
# "dynamo-optimize" exporter is dynamo's default (optimize=True), not a faithful training export.
EXPORTS = [("torchscript", 17), ("dynamo", 18)]
EXTRA: dict[str, list[tuple[str, int]]] = {
    "gpt2": [("torchscript", 20), ("dynamo", 20), ("dynamo", 23), ("dynamo-optimize", 18)],
    "bert": [("torchscript", 18), ("torchscript", 19), ("dynamo", 22)],
    "llama": [("torchscript", 20), ("dynamo", 23), ("dynamo-optimize", 18)],
    "t5": [("torchscript", 20)],
    "mobilenet_v3": [("torchscript", 20), ("dynamo", 23), ("dynamo-optimize", 18)],
    "whisper_encoder": [("dynamo", 19)],
    "efficientnet": [("dynamo", 22)],
    "vit": [("dynamo", 21)],
    "unet": [("torchscript", 20), ("dynamo", 23)],
}
ONLY: dict[str, list[tuple[str, int]]] = {  # variants run at these exports only
    "gpt2_sdpa": [("dynamo", 23)],
    "llama_sdpa": [("dynamo", 23)],
    "rmsnorm_lm": [("dynamo", 18), ("dynamo", 23)],  # 23: RMSNormalization
}
CASES = [(m, e, o) for m in ZOO for e, o in ONLY.get(m, EXPORTS + EXTRA.get(m, []))]
OPTIMIZE_REASON = ("dynamo's default optimize=True merges equal-valued parameters, folds constants such as "
                   "GPT-2's position embedding and BatchNorm into other tensors: the transpiler freezes the "
                   "constants and warns about the merges (transpiler/trainable.py), but the graph is another "
                   "model than PyTorch's")

# Cases that cannot pass today, with the first line of their error.
XFAIL: dict[tuple[str, str, int], str] = {}  # none now (UNet from dynamo 23 passes since load.py types GroupNormalization)

RESULTS: dict[tuple[str, str, int], dict] = {}
FAILURES: dict[tuple[str, str, int], str] = {}


def _export(module, data, path: Path, exporter: str, opset: int) -> None:
    args = tuple(torch.from_numpy(v[:BATCH].copy()) for v in data.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo-optimize":
            batch = torch.export.Dim("batch")
            module.train()
            torch.onnx.export(module, args, str(path), dynamo=True, opset_version=opset, input_names=list(data),
                              output_names=["loss"], dynamic_shapes={n: {0: batch} for n in data},
                              external_data=False, verbose=False)
        else:
            export_onnx(module, args, path, input_names=list(data), output_names=["loss"],
                        dynamo=exporter == "dynamo", opset=opset)


# Ops worth naming in the table: the new rules and opset 23's fused ops.
NOTABLE = ("SplitToSequence", "HardSwish", "HardSigmoid", "Reciprocal", "Sin", "Cos", "InstanceNormalization",
           "GroupNormalization", "Resize", "Attention", "RMSNormalization", "RotaryEmbedding", "Elu", "Selu",
           "Celu", "PRelu", "Softplus", "Mish", "DepthToSpace", "GatherND", "ReduceL2", "ReduceLogSumExp", "LSTM",
           "GRU", "Clip")
OPS: dict[tuple[str, str, int], list[str]] = {}


_EXPORTS: dict[tuple[str, str, int], tuple] = {}  # per session, shared with tests/test_zoo_cli.py


def export_zoo_model(model: str, exporter: str, opset: int, tmp_path_factory):
    """(model.onnx, the torch module, data, export seconds) of a zoo case, exported once per session.

    The module's state is then set from the exported initializers: TorchScript's training export
    runs one forward, which advances BatchNorm's running statistics (docs/architecture.md)."""
    key = (model, exporter, opset)
    if key not in _EXPORTS:
        entry = ZOO[model]
        if entry.transformers:
            pytest.importorskip("transformers")
        module, data = entry.make(), entry.data(ROWS)
        path = tmp_path_factory.mktemp(f"{model}-{exporter}-{opset}") / "model.onnx"
        start = time.perf_counter()
        _export(module, data, path, exporter, opset)
        seconds = time.perf_counter() - start
        proto = onnx.load(str(path))
        OPS[key] = [op for op in NOTABLE if any(n.op_type == op for n in proto.graph.node)]
        arrays = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
        with torch.no_grad():
            for name, tensor in module.state_dict(keep_vars=True).items():
                if name in arrays and tensor.is_floating_point() and arrays[name].shape == tuple(tensor.shape):
                    tensor.copy_(torch.from_numpy(arrays[name].copy()))
        _EXPORTS[key] = (path, module, data, seconds)
    return _EXPORTS[key]


@pytest.fixture(scope="session")
def zoo_export(tmp_path_factory):
    """``zoo_export(model, exporter, opset)`` -> export_zoo_model's (model.onnx, module, data, export seconds)."""
    return lambda model, exporter, opset: export_zoo_model(model, exporter, opset, tmp_path_factory)


def zoo_freeze(model: str, path: Path) -> str | None:
    """The zoo entry's --freeze regex, or None where the export has no initializer it matches
    (TorchScript writes such buffers as Constant nodes: nothing to freeze)."""
    freeze = ZOO[model].freeze
    if freeze and not any(re.search(freeze, t.name) for t in onnx.load(str(path)).graph.initializer):
        return None
    return freeze


def _torch_tensors(module) -> dict[str, torch.Tensor]:
    """Every name a parameter or float buffer goes by (tied weights under each of their names)."""
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update((n, b) for n, b in module.named_buffers(remove_duplicate=False) if b.is_floating_point())
    return named


def train_torch(module, data: dict[str, np.ndarray]) -> tuple[list[float], dict[str, np.ndarray]]:
    module = copy.deepcopy(module).train()
    optimizer = torch.optim.SGD(module.parameters(), lr=float(np.float32(LR)), foreach=False)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = module(*(torch.from_numpy(v) for v in batch_of(data, step, BATCH).values()))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, {n: t.detach().numpy().copy() for n, t in _torch_tensors(module).items()}


@pytest.mark.parametrize(
    "model,exporter,opset",
    [pytest.param(*case, marks=pytest.mark.xfail(strict=True, reason=XFAIL[case])) if case in XFAIL
     else pytest.param(*case, marks=pytest.mark.xfail(strict=False, reason=OPTIMIZE_REASON))
     if case[1] == "dynamo-optimize" else case
     for case in CASES],
    ids=[f"{m}-{e}{o}" for m, e, o in CASES],
)
def test_two_ranks_train_like_pytorch(model, exporter, opset, zoo_export, tmp_path):
    measured: dict = {}
    try:
        _train_and_compare(model, exporter, opset, zoo_export, tmp_path, measured)
    except Exception as exc:  # the table shows the first line of what went wrong
        FAILURES[model, exporter, opset] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise
    finally:
        if measured:
            RESULTS[model, exporter, opset] = measured


# The other strategies on a few exports (each must equal allreduce, the reference, and so PyTorch).
STRATEGY_CASES = [("gpt2", "dynamo", 18), ("llama_sdpa", "dynamo", 23), ("mobilenet_v3", "torchscript", 17)]
STRATEGY_RESULTS: dict[tuple[str, str, int, str], float] = {}


@pytest.mark.parametrize("strategy", ["allreduce", "zero"])
@pytest.mark.parametrize("model,exporter,opset", STRATEGY_CASES, ids=[f"{m}-{e}{o}" for m, e, o in STRATEGY_CASES])
def test_other_strategies_train_like_pytorch(model, exporter, opset, strategy, zoo_export, tmp_path):
    measured: dict = {}
    try:
        _train_and_compare(model, exporter, opset, zoo_export, tmp_path, measured, strategy=strategy)
    finally:
        if measured:
            STRATEGY_RESULTS[model, exporter, opset, strategy] = measured["error"]


def _train_and_compare(model, exporter, opset, zoo_export, tmp_path, measured: dict, strategy: str = "sharded"):
    from runtime import simulate
    from transpiler import OptimizerConfig, Options, transpile

    entry = ZOO[model]
    path, module, data, export_s = zoo_export(model, exporter, opset)
    start = time.perf_counter()
    transpile(path, tmp_path / "out", Options(world_size=WORLD, optimizer=OptimizerConfig("sgd", lr=LR),
                                              strategy=strategy, sync_bn=entry.sync_bn),
              freeze=zoo_freeze(model, path), train=entry.train)
    transpile_s = time.perf_counter() - start
    start = time.perf_counter()
    result = simulate(tmp_path / "out", data, batch=BATCH, steps=STEPS)
    run_s = time.perf_counter() - start
    assert_replicas_identical(result.parameters)
    compare_with_torch(module, data, result.parameters[0], result.losses, measured, export_s=export_s,
                       transpile_s=transpile_s, run_s=run_s)


def compare_with_torch(module, data: dict[str, np.ndarray], ours: dict[str, np.ndarray], losses: list[float],
                       measured: dict, **extra: float) -> None:
    """Assert that ``ours`` (the trained tensors by name after STEPS steps of BATCH rows) and the
    global ``losses`` equal PyTorch's own STEPS steps of torch.optim.SGD on ``module``; the errors
    (error, loss, moved, tensors, noise) and ``extra`` go into ``measured`` before the asserts."""
    torch_losses, expected = train_torch(module, data)
    initial = {n: t.detach().numpy() for n, t in _torch_tensors(module).items()}
    unknown = sorted(set(ours) - set(expected))
    assert not unknown, f"trained tensors that are no torch parameter or buffer: {unknown[:5]}"
    trained_ids = {id(_torch_tensors(module)[n]) for n in ours}
    untrained = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in trained_ids]
    assert not untrained, f"torch parameters the transpiler does not train: {untrained[:5]}"

    # A tensor's update is resolvable when PyTorch moved it by more than RESOLVABLE of the largest
    # update in the model. Below that it is rounding noise on both sides: an analytically zero
    # gradient (BERT's attention key bias; a BatchNorm bias followed by another BatchNorm), or a
    # running mean of such noise, where no relative measure can compare. Those tensors are held to
    # an absolute bound instead: within TOLERANCE of the largest update.
    updates = {n: float(np.max(np.abs(expected[n].astype(np.float64) - initial[n]))) for n in ours}
    biggest = max(updates.values())
    resolvable = [n for n in ours if updates[n] > RESOLVABLE * biggest]
    noise = [n for n in ours if n not in resolvable]
    error = max_rel_error({n: ours[n] for n in resolvable}, {n: expected[n] for n in resolvable})
    noise_error = max((float(np.max(np.abs(ours[n].astype(np.float64) - expected[n]))) for n in noise), default=0.0)
    moved = max_rel_error({n: initial[n] for n in ours}, {n: expected[n] for n in ours})
    loss_error = float(np.max(np.abs(np.array(losses) - torch_losses) / np.abs(torch_losses)))
    measured.update(error=error, loss=loss_error, moved=moved, tensors=len(ours), noise=len(noise), **extra)
    assert moved > 1e-4, "3 SGD steps did not move the parameters"
    assert loss_error <= TOLERANCE, f"losses {losses} vs torch {torch_losses}"
    worst = max(resolvable, key=lambda n: max_rel_error({n: ours[n]}, {n: expected[n]}))
    assert error <= TOLERANCE, f"max relative error {error:.3g} vs torch.optim.SGD (worst: {worst})"
    assert noise_error <= TOLERANCE * biggest, f"tensors without a resolvable update differ by {noise_error:.3g}"


# transformers' own CLIP loss, ``arange(len(logits))`` labels over the batch: both exporters bake the
# example batch (TorchScript the labels [0, 1, 2, 3], dynamo a static export whose first fixed shape is
# the patch embedding's view), and `transpile` must refuse it in one line (transpiler/batch_constants.py).
# The zoo's `clip` entry is the same model with the contrastive loss per group of pairs in a row.
OWN_LOSS_CASES = [("torchscript", 17, "SoftmaxCrossEntropyLoss node"), ("dynamo", 18, "Reshape node")]
REFUSED: dict[tuple[str, int], str] = {}


@pytest.mark.parametrize("exporter,opset,where", OWN_LOSS_CASES, ids=[f"{e}{o}" for e, o, _ in OWN_LOSS_CASES])
def test_clip_own_loss_is_refused_at_transpile(exporter, opset, where, tmp_path):
    pytest.importorskip("transformers")
    from test_cli_errors import assert_clean_error, transpile_cli
    from zoo_models import clip_own_loss_data, make_clip_own_loss

    data = clip_own_loss_data(BATCH)
    _export(make_clip_own_loss(), data, tmp_path / "model.onnx", exporter, opset)
    done = transpile_cli(tmp_path / "model.onnx", "-o", tmp_path / "out", "--gpus", str(WORLD), cwd=tmp_path)
    line = assert_clean_error(done, "model.onnx", where, f"batch size ({BATCH})", "dynamic_axes / dynamic_shapes",
                              "x.shape[0], not len(x)")
    # The table shows what is blamed, without the path and the fix.
    REFUSED[exporter, opset] = line.split("model.onnx: ", 1)[1].split(": the exporter baked", 1)[0]
    assert not (tmp_path / "out").exists()


def zoo_table() -> str:
    lines = ["| model | exporter | opset | result | max rel error (params) | loss rel error | "
             "export s | transpile s | run s (3 steps, 2 ranks) | ops of note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model, exporter, opset in CASES:
        key = (model, exporter, opset)
        r = RESULTS.get(key)
        ops = ", ".join(OPS.get(key, []))
        if r is None:
            why = FAILURES.get(key, "not run").replace("|", "/")
            lines.append(f"| {model} | {exporter} | {opset} | fails: `{why}` | | | | | | {ops} |")
            continue
        ok = "parity" if r["error"] <= TOLERANCE and r["loss"] <= TOLERANCE else "MISMATCH"
        lines.append(f"| {model} | {exporter} | {opset} | {ok} | {r['error']:.1e} | {r['loss']:.1e} | "
                     f"{r['export_s']:.1f} | {r['transpile_s']:.1f} | {r['run_s']:.1f} | {ops} |")
    for exporter, opset, _ in OWN_LOSS_CASES:
        blamed = REFUSED.get((exporter, opset))
        result = f"refused by `transpile` (exit 2): `{blamed}`" if blamed else "not run"
        lines.append(f"| clip, transformers' own loss | {exporter} | {opset} | {result} | | | | | |  |")
    return "\n".join(lines)


def test_report():
    """Print the table (visible with -s); runs last in this file."""
    if not RESULTS and not STRATEGY_RESULTS and not REFUSED:
        pytest.skip("no case ran")
    table = zoo_table()
    print("\n" + table)
    for (model, exporter, opset, strategy), error in STRATEGY_RESULTS.items():
        print(f"{model} {exporter} {opset} --strategy {strategy}: max rel error {error:.1e}")
    if os.environ.get("ZOO_TABLE"):
        Path(os.environ["ZOO_TABLE"]).write_text(table + "\n")
