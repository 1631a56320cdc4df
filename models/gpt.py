"""A decoder-only transformer (GPT-2 layout), with its next-token cross-entropy inside the graph.

Token embedding + a learned positional parameter; ``layers`` pre-LayerNorm blocks, each
``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``; final LayerNorm; LM head (untied from the
embedding, no bias); mean cross-entropy of the logits against the targets. Attention is written
with explicit ops, no scaled_dot_product_attention: Q/K/V projections, MatMul, scale by
1/sqrt(head_dim), a causal mask from ``torch.tril`` applied with ``masked_fill`` (Where), Softmax,
MatMul, output projection. The MLP is Linear(C, 4C) - GELU (exact, erf) - Linear(4C, C).
``GPTConfig()`` is the GPT-2-small shape (12 layers, width 768, 12 heads, vocabulary 50304,
sequence 512: 163M parameters with the untied head).

    forward(tokens int64 [B, T], targets int64 [B, T]) -> loss (float32 scalar)

Initial values: weights ~ N(0, 0.02) as in GPT-2, biases and LayerNorm affine parameters drawn
around their usual constants (bias +- 0.02, LayerNorm weight 1 +- 0.02) so no two initializers are
equal (both PyTorch exporters merge equal initializers, docs/architecture.md).

    python -m models.gpt -o DIR [--layers 12] [--width 768] [--heads 12] [--vocab 50304] [--seq 512]
                          [--rows N] [--seed S] [--dynamo]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as exc:  # torch is only in the test extra
    raise ImportError("models.gpt needs PyTorch: pip install torch (or the project's [test] extra)") from exc

from models._common import data_rng
from models.torch_twins import export_onnx

INPUT_NAMES = ["tokens", "targets"]
OUTPUT_NAMES = ["loss"]


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 12
    width: int = 768
    heads: int = 12
    vocab: int = 50304
    seq: int = 512
    dropout: float = 0.0  # > 0 adds Dropout after attention softmax and in the residual branches


GPT2_SMALL = GPTConfig()
DEFAULT = GPTConfig(layers=4, width=256, heads=4, vocab=4096, seq=128)  # `python -m models gpt`
SMALL = GPTConfig(layers=2, width=32, heads=4, vocab=64, seq=16)


def dropout(config: GPTConfig) -> nn.Module:
    # With p = 0 no Dropout node at all: the TorchScript exporter in training mode would emit
    # Dropout(ratio 0) nodes that only add work (and need a gradient rule).
    return nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.width % config.heads == 0, "width must be divisible by heads"
        self.heads = config.heads
        self.q = nn.Linear(config.width, config.width)
        self.k = nn.Linear(config.width, config.width)
        self.v = nn.Linear(config.width, config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.drop = dropout(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h, d = self.heads, c // self.heads
        q = self.q(x).view(b, t, h, d).transpose(1, 2)  # [B, H, T, D]
        k = self.k(x).view(b, t, h, d).transpose(1, 2)
        v = self.v(x).view(b, t, h, d).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))  # [B, H, T, T]
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = self.drop(torch.softmax(scores, dim=-1))
        y = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, c)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.width, config.width)
        self.drop = dropout(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.width)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.width)
        self.wpe = nn.Parameter(torch.zeros(1, config.seq, config.width))
        self.blocks = nn.Sequential(*(Block(config) for _ in range(config.layers)))
        self.ln_f = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        # The exported graphs always take full sequences: no Slice then (the TorchScript exporter
        # would feed Slice its axes through Unsqueeze(Constant), which the Slice rule rejects).
        x = self.wte(tokens) + (self.wpe if t == self.config.seq else self.wpe[:, :t])
        return self.head(self.ln_f(self.blocks(x)))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def init_weights(module: GPT, seed: int = 0) -> GPT:
    """GPT-2's N(0, 0.02) weights; biases, LayerNorm parameters and the positional parameter drawn
    so that every initializer is distinct (see the module docstring). Seeded."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
                p.copy_(1.0 + 0.02 * (torch.rand(p.shape, generator=gen) * 2 - 1))
            elif name.endswith(".bias"):
                p.copy_(0.02 * (torch.rand(p.shape, generator=gen) * 2 - 1))
            elif name == "wpe":
                p.copy_(0.01 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return module


def make_module(config: GPTConfig = GPTConfig(), seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return init_weights(GPT(config), seed)


def make_data(config: GPTConfig, seed: int, rows: int) -> dict[str, np.ndarray]:
    """Random token sequences (seeded): ``tokens`` are positions [0, T) of a random sequence of T+1
    tokens and ``targets`` positions [1, T], both int64 [rows, T]."""
    rng = data_rng(seed)
    seq = rng.integers(0, config.vocab, size=(rows, config.seq + 1), dtype=np.int64)
    return {"tokens": np.ascontiguousarray(seq[:, :-1]), "targets": np.ascontiguousarray(seq[:, 1:])}


def example_inputs(config: GPTConfig, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    data = make_data(config, seed, batch)
    return torch.from_numpy(data["tokens"]), torch.from_numpy(data["targets"])


def export(module: GPT, path: str | Path, batch: int = 2, dynamo: bool = False, opset: int | None = None) -> Path:
    """Write ``module`` as ONNX (inputs tokens, targets with a dynamic batch axis; output loss)."""
    return export_onnx(module, example_inputs(module.config, batch), path, input_names=INPUT_NAMES,
                       output_names=OUTPUT_NAMES, dynamo=dynamo, opset=opset)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.gpt", description=__doc__.split("\n")[0])
    parser.add_argument("-o", "--out", required=True)
    defaults = GPTConfig()
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--width", type=int, default=defaults.width)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--vocab", type=int, default=defaults.vocab)
    parser.add_argument("--seq", type=int, default=defaults.seq)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dynamo", action="store_true", help="use the dynamo exporter (default TorchScript)")
    args = parser.parse_args(argv)
    config = GPTConfig(layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq=args.seq)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    module = make_module(config, args.seed)
    export(module, out / "model.onnx", dynamo=args.dynamo)
    elapsed = time.perf_counter() - start
    np.savez(out / "data.npz", **make_data(config, args.seed, args.rows))
    params = sum(p.numel() for p in module.parameters())
    print(f"{out / 'model.onnx'}  ({params / 1e6:.1f}M parameters, "
          f"{(out / 'model.onnx').stat().st_size / 2**20:.0f} MiB, exported in {elapsed:.1f} s)", file=sys.stderr)
    print(out / "model.onnx")
    print(out / "data.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
