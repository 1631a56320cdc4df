"""Real exports through torch.onnx (dynamo, with its default ``optimize=True``, and the faithful
settings): what is trained, what the exporter changed, and that nothing trains to NaN.

- GPT-2 style (models/gpt.py's module, tiny, with GPT-2's tanh GELU written as HF writes it, so
  ``x ** 3`` puts a Pow exponent into the graph): before the rules its 0-d constants were trained and
  the exponent's gradient ``y*ln(x)`` made every parameter NaN after one step. Now: with torch's own
  init (LayerNorm weights all ones) the default export merges parameters and transpile warns, naming
  them; with distinct initial values the default export trains at PyTorch parity.
- Llama style (RMSNorm, rotary embedding with an ``inv_freq`` buffer, SiLU MLP): inv_freq is trained
  only with ``--train``.
- Conv + BatchNorm: dynamo's default export folds the BatchNorm into the Conv; transpile says so.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn

from models.gpt import GPT, GPTConfig, init_weights, make_data
from transpiler import OptimizerConfig, Options, UnsupportedOpsError, build, transpile

CONFIG = GPTConfig(layers=2, width=32, heads=4, vocab=64, seq=16)
LR, STEPS, BATCH = 0.05, 3, 8
TOLERANCE = 1e-4


class NewGELU(nn.Module):
    """GPT-2's GELU as transformers writes it (``gelu_new``): a Pow with exponent 3.0."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gpt2(distinct: bool, tied: bool = False) -> GPT:
    torch.manual_seed(0)
    module = GPT(CONFIG)
    for block in module.blocks:
        block.mlp.act = NewGELU()
    module = init_weights(module, 0) if distinct else module
    if tied:  # GPT-2 proper: the LM head is the token embedding
        module.head.weight = module.wte.weight
    return module


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Rotary(nn.Module):
    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, t: int):
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), self.inv_freq)
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


class Llama(nn.Module):
    """One Llama block (RMSNorm, rotary attention, SiLU-gated MLP), LM head, cross-entropy."""

    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 4, hidden: int = 64):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.norm1, self.norm2, self.norm = RMSNorm(width), RMSNorm(width), RMSNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)
        self.rotary = Rotary(width // heads)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens, targets):
        b, t = tokens.shape
        x = self.embed(tokens)
        h = self.norm1(x)
        d = h.shape[-1] // self.heads
        q, k, v = (proj(h).view(b, t, self.heads, d).transpose(1, 2) for proj in (self.q, self.k, self.v))
        cos, sin = self.rotary(t)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        x = x + self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1))
        h = self.norm2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def llama() -> Llama:
    torch.manual_seed(0)
    module = Llama()
    with torch.no_grad():  # distinct RMSNorm weights, so even the default export merges nothing
        for norm in (module.norm1, module.norm2, module.norm):
            norm.weight.add_(0.02 * torch.randn(norm.weight.shape))
    return module


def export(module: nn.Module, path: Path, *, optimize: bool = True) -> Path:
    """torch.onnx.export(module, args, dynamo=True) as a user would call it (``optimize`` left at its
    default unless told), with a dynamic batch axis and the weights inside the file."""
    batch = torch.export.Dim("batch")
    module.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {} if optimize else {"optimize": False}
        torch.onnx.export(module, _example(), str(path), dynamo=True, input_names=["tokens", "targets"],
                          output_names=["loss"], dynamic_shapes={"tokens": {0: batch}, "targets": {0: batch}},
                          external_data=False, **kwargs)
    return path


def _example():
    data = make_data(CONFIG, 0, 2)
    return torch.from_numpy(data["tokens"]), torch.from_numpy(data["targets"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cache: dict[str, Path] = {}
    makers = {
        "gpt2_torch_init": lambda p: export(gpt2(False), p),
        "gpt2_distinct": lambda p: export(gpt2(True), p),
        "gpt2_tied_default": lambda p: export(gpt2(True, tied=True), p),
        "gpt2_tied_faithful": lambda p: export(gpt2(True, tied=True), p, optimize=False),
        "llama_faithful": lambda p: export(llama(), p, optimize=False),
        "llama_default": lambda p: export(llama(), p),
    }

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = makers[name](tmp_path_factory.mktemp(name) / "model.onnx")
        return cache[name]

    return get


def data() -> dict[str, np.ndarray]:
    return make_data(CONFIG, 1, 64)


def train_torch(module: nn.Module, batches: dict[str, np.ndarray]) -> tuple[list[float], nn.Module]:
    module = copy.deepcopy(module).train()
    optimizer = torch.optim.SGD(module.parameters(), lr=float(np.float32(LR)), foreach=False)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        rows = slice(step * BATCH, (step + 1) * BATCH)
        loss = module(torch.from_numpy(batches["tokens"][rows]), torch.from_numpy(batches["targets"][rows]))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, module


def torch_names_of(path: Path, module: nn.Module) -> dict[str, tuple[str, bool]]:
    """ONNX initializer -> (torch parameter, transposed): by name, or by value for the transposed
    Linear weights dynamo's constant folding stores under new names (``val_4`` = ``q.weight.T``)."""
    params = dict(module.named_parameters())
    out = {}
    for t in onnx.load(path).graph.initializer:
        if t.name in params:
            out[t.name] = (t.name, False)
            continue
        array = numpy_helper.to_array(t)
        for name, p in params.items():
            if array.shape == tuple(p.shape) and np.array_equal(array, p.detach().numpy()):
                out[t.name] = (name, False)  # a tied parameter exported under its other name
            elif p.ndim == 2 and array.shape == tuple(p.shape[::-1]) and np.array_equal(array, p.detach().numpy().T):
                out[t.name] = (name, True)
    return out


def parity(path: Path, module: nn.Module, tmp_path: Path) -> tuple[float, float, list[str]]:
    """3 SGD steps on 2 ranks vs torch.optim.SGD: (max relative parameter error, max relative loss
    error, trained tensors)."""
    from runtime import simulate

    batches = data()
    plan = transpile(path, tmp_path / "out", Options(world_size=2, optimizer=OptimizerConfig("sgd", lr=LR)))
    result = simulate(tmp_path / "out", batches, batch=BATCH, steps=STEPS)
    torch_losses, trained = train_torch(module, batches)
    names = torch_names_of(path, module)
    torch_params = dict(trained.named_parameters())
    worst = 0.0
    for name, value in result.parameters[0].items():
        torch_name, transposed = names[name]
        expected = torch_params[torch_name].detach().numpy()
        expected = expected.T if transposed else expected
        worst = max(worst, float(np.max(np.abs(value - expected)) / np.max(np.abs(expected))))
    loss_error = float(np.max(np.abs(np.array(result.losses) - torch_losses) / np.abs(torch_losses)))
    return worst, loss_error, [p["name"] for p in plan["parameters"]]


# ---------------------------------------------------------------------------------------------
# GPT-2, dynamo default export


def test_gpt2_default_export_constants_frozen(exported):
    job = build(exported("gpt2_torch_init"), Options())
    status = job.problem.selection.status
    frozen = {n: r for n, (s, r) in status.items() if s == "frozen"}
    # GELU's 0.5, 0.044715, sqrt(2/pi), 1.0, the attention scale, the -inf mask fill, the exponent
    assert sorted(frozen.values()) == ["exponent", "non-finite", "scalar", "scalar", "scalar", "scalar", "scalar"]
    pow_exponent = next(n for n, r in frozen.items() if r == "exponent")
    assert numpy_helper.to_array(next(t for t in onnx.load(exported("gpt2_torch_init")).graph.initializer
                                      if t.name == pow_exponent)) == 3.0
    assert all(job.problem.model.graph.initializers[p].shape.rank() > 0 for p in job.problem.params)


def test_gpt2_default_export_forcing_the_exponent_trains_to_nan(exported, tmp_path):
    """What the rule prevents: the exponent trained (--train) makes the loss NaN from step 2 on (the
    runtime's non-finite guard then stops the run naming the step: docs/reliability.md)."""
    from runtime import simulate
    from runtime.errors import RunError

    path = exported("gpt2_torch_init")
    job = build(path, Options())
    exponent = next(n for n, (s, r) in job.problem.selection.status.items() if r == "exponent")
    transpile(path, tmp_path / "forced", Options(optimizer=OptimizerConfig("sgd", lr=LR)), train=f"^{exponent}$")
    with pytest.raises(RunError, match=r"step 2: the loss is nan \(non-finite\)"):
        simulate(tmp_path / "forced", data(), batch=BATCH, steps=STEPS)
    transpile(path, tmp_path / "default", Options(optimizer=OptimizerConfig("sgd", lr=LR)))
    default = simulate(tmp_path / "default", data(), batch=BATCH, steps=STEPS)
    assert np.all(np.isfinite(default.losses))
    assert all(np.all(np.isfinite(v)) for v in default.parameters[0].values())


def test_gpt2_default_export_with_torch_init_warns_naming_the_merged_tensors(exported, tmp_path, capsys):
    from commands.main import main

    assert main([str(exported("gpt2_torch_init")), "--gpus", "2", "-o", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("transpile: warning: ")]
    assert len(lines) == 2, captured.err
    assert "'blocks.0.ln_1.weight' (all 1) feeds 5 LayerNormalization nodes (blocks.0.ln_1, blocks.0.ln_2, " \
           "blocks.1.ln_1, blocks.1.ln_2, ln_f)" in lines[0]
    assert "'blocks.0.ln_1.bias' (all 0) feeds 5 LayerNormalization nodes" in lines[1]
    assert all("optimize=False" in ln for ln in lines)
    summary = next(ln for ln in captured.out.splitlines() if ln.startswith("trainable: "))
    assert summary == ("trainable: 29 tensor(s) trained, 7 frozen (5 0-d constant, 1 holds inf/nan (a fill value), "
                       "1 Pow exponent)")


@pytest.mark.mpi
def test_gpt2_default_export_cli_run_is_finite_and_exits_0(exported, tmp_path):
    np.savez(tmp_path / "data.npz", **data())
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "transpiler.cli"]
    done = subprocess.run([*cli, str(exported("gpt2_torch_init")), "--gpus", "2", "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([*cli, "run", str(out), "--data", str(tmp_path / "data.npz"), "--batch", "8", "--steps", "3",
                           "--log-every", "1", "--metrics", str(tmp_path / "m.jsonl")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    from runtime.metrics import read_metrics

    losses = [r["loss"] for r in read_metrics(tmp_path / "m.jsonl")[0]]
    assert len(losses) == 3 and all(np.isfinite(losses)), done.stdout


def test_gpt2_default_export_with_distinct_init_trains_at_torch_parity(exported, tmp_path):
    path = exported("gpt2_distinct")
    assert build(path, Options()).problem.warnings == []
    error, loss_error, trained = parity(path, gpt2(True), tmp_path)
    n_params = len(list(gpt2(True).parameters()))
    assert len(trained) == n_params  # every torch parameter, each once (transposed copies included)
    assert error <= TOLERANCE, f"max relative parameter error {error:.3g}"
    assert loss_error <= TOLERANCE, f"max relative loss error {loss_error:.3g}"


def test_gpt2_tied_head_faithful_export_is_not_warned_and_trains_at_parity(exported, tmp_path):
    """wte feeds the lookup (Gather) and the LM head (through Transpose -> MatMul): a tie, not a merge."""
    path = exported("gpt2_tied_faithful")
    job = build(path, Options())
    assert job.problem.warnings == []
    error, loss_error, trained = parity(path, gpt2(True, tied=True), tmp_path)
    assert len(trained) == len(list(gpt2(True, tied=True).parameters()))  # the tied tensor once
    assert error <= TOLERANCE and loss_error <= TOLERANCE, (error, loss_error)


def test_gpt2_tied_head_default_export_unties_and_is_warned(exported):
    """optimize=True folds Transpose(wte) into a new initializer: two tensors trained apart."""
    warned = build(exported("gpt2_tied_default"), Options()).problem.warnings
    assert len(warned) == 1, warned
    assert warned[0].startswith("'val_") and "is 'head.weight' transposed" in warned[0]
    assert "optimize=False" in warned[0]


# ---------------------------------------------------------------------------------------------
# Llama: inv_freq only on request


def test_llama_inv_freq_frozen_by_default_and_trains_at_parity(exported, tmp_path):
    path = exported("llama_faithful")
    job = build(path, Options())
    assert job.problem.selection.status["rotary.inv_freq"] == ("frozen", "rotary")
    assert "rotary.inv_freq" not in job.problem.params and job.problem.warnings == []
    error, loss_error, trained = parity(path, llama(), tmp_path)
    assert sorted(trained) == sorted(n for n, _ in llama().named_parameters())
    assert error <= TOLERANCE and loss_error <= TOLERANCE, (error, loss_error)


def test_llama_inv_freq_trained_only_with_train(exported, tmp_path):
    from transpiler.autodiff._registry import registered_ops

    path = exported("llama_faithful")
    if {"Sin", "Cos"} <= registered_ops():
        job = build(path, Options(), train="inv_freq")
        assert "rotary.inv_freq" in job.problem.params
        assert job.problem.selection.status["rotary.inv_freq"] == ("trained", "train")
    else:  # the rotary path needs Sin/Cos gradient rules: the request is honoured, and refused in one line
        with pytest.raises(UnsupportedOpsError) as err:
            build(path, Options(), train="inv_freq")
        assert "'Cos'" in str(err.value) and "'Sin'" in str(err.value) and "\n" not in str(err.value)


def test_llama_default_export_freezes_rotary_tables_and_constants(exported):
    job = build(exported("llama_default"), Options())
    frozen = {n: r for n, (s, r) in job.problem.selection.status.items() if s == "frozen"}
    # optimize=True folds inv_freq into precomputed cos/sin tables
    assert frozen.get("cos") == "rotary" and frozen.get("sin") == "rotary"
    assert "exponent" in frozen.values() and "scalar" in frozen.values()
    assert not any(n in job.problem.params for n in ("cos", "sin", "rotary.inv_freq"))
    assert job.problem.warnings == []


def test_llama_default_export_with_torch_init_merges_rmsnorm_weights(tmp_path):
    torch.manual_seed(0)
    job = build(export(Llama(), tmp_path / "m.onnx"), Options())
    assert len(job.problem.warnings) == 1
    assert "'norm1.weight' (all 1) feeds 3 Mul nodes (norm, norm1, norm2)" in job.problem.warnings[0]


# ---------------------------------------------------------------------------------------------
# BatchNorm folded into the convolution


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3))), y)


def test_dynamo_default_export_folds_batchnorm_and_transpile_says_so(tmp_path):
    from models.torch_twins import export_onnx

    torch.manual_seed(0)
    module = ConvBN().train()
    args = (torch.randn(4, 3, 8, 8), torch.randint(0, 2, (4,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(tmp_path / "default.onnx"), dynamo=True, input_names=["x", "y"],
                          output_names=["loss"], external_data=False)
    assert not any(n.op_type == "BatchNormalization" for n in onnx.load(tmp_path / "default.onnx").graph.node)
    warned = build(tmp_path / "default.onnx", Options()).problem.warnings
    assert len(warned) == 1 and "BatchNormalization was folded into 1 convolution(s)" in warned[0]
    assert "'conv.weight'" in warned[0] and "optimize=False" in warned[0]
    # the faithful export keeps it, and nothing is warned
    export_onnx(module, args, tmp_path / "faithful.onnx", input_names=["x", "y"], output_names=["loss"], dynamo=True)
    job = build(tmp_path / "faithful.onnx", Options())
    assert job.problem.warnings == []
    assert sorted(n for n, (s, _) in job.problem.selection.status.items() if s == "buffer") == \
        ["bn.running_mean", "bn.running_var"]


def test_torchscript_eval_export_merges_through_identity_and_is_warned(tmp_path):
    """TorchScript in eval mode with constant folding (its defaults) keeps one LayerNorm weight and
    copies it with Identity nodes; the warning follows the copies."""
    torch.manual_seed(0)
    module = GPT(CONFIG).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, _example(), str(tmp_path / "m.onnx"), dynamo=False, input_names=["tokens", "targets"],
                          output_names=["loss"], dynamic_axes={"tokens": {0: "b"}, "targets": {0: "b"}})
    assert any(n.op_type == "Identity" for n in onnx.load(tmp_path / "m.onnx").graph.node)
    warned = build(tmp_path / "m.onnx", Options()).problem.warnings
    assert len(warned) == 2
    assert warned[0].startswith("'blocks.0.ln_1.weight' (all 1) feeds 5 LayerNormalization nodes (/blocks/blocks.0/ln_1, ")
    # the faithful TorchScript export of the same module: nothing merged
    from models.torch_twins import export_onnx

    export_onnx(module, _example(), tmp_path / "f.onnx", input_names=["tokens", "targets"], output_names=["loss"])
    assert build(tmp_path / "f.onnx", Options()).problem.warnings == []
