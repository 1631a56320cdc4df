"""ResNet-18 for 32x32 images (CIFAR layout), with its cross-entropy loss inside the graph.

Layout (He et al. 2016, the CIFAR variant used by most PyTorch CIFAR recipes): a 3x3 stride-1 stem
conv (no max-pool), BatchNorm, ReLU; ``len(depth)`` stages of BasicBlocks (two 3x3 convs with
BatchNorm, identity shortcut or a 1x1 strided conv + BatchNorm when the shape changes), stage ``i``
having ``width * 2**i`` channels and stride 2 from the second stage on; AdaptiveAvgPool2d(1)
(GlobalAveragePool in ONNX), Linear, mean cross-entropy. ``stem_pool=True`` adds the ImageNet
layout's 3x3 stride-2 MaxPool after the stem. ``ResNet()`` is ResNet-18 (width 64,
depth [2, 2, 2, 2], 11.2M parameters); ``CNNConfig(width=8, depth=(1, 1))`` (``SMALL``) is a 5.3k-parameter variant
for CI.

    forward(images float32 [B, C, H, W], labels int64 [B]) -> loss (float32 scalar)

Initial values are made pairwise distinct (``distinct_init``): both PyTorch exporters merge
initializers with equal values (every BatchNorm weight starts at ones), which would tie parameters
(docs/architecture.md). BatchNorm's running_mean / running_var are buffers: exported as
initializers, updated by the BatchNormalization node in training mode.

    python -m models.cnn -o DIR [--width 64] [--depth 2,2,2,2] [--classes 10] [--channels 3]
                          [--image-size 32] [--stem-pool] [--rows N] [--seed S] [--dynamo]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as exc:  # torch is only in the test extra
    raise ImportError("models.cnn needs PyTorch: pip install torch (or the project's [test] extra)") from exc

from models._common import data_rng
from models.torch_twins import export_onnx

INPUT_NAMES = ["images", "labels"]
OUTPUT_NAMES = ["loss"]


@dataclass(frozen=True)
class CNNConfig:
    width: int = 64  # channels of the first stage; stage i has width * 2**i
    depth: tuple[int, ...] = (2, 2, 2, 2)  # BasicBlocks per stage
    num_classes: int = 10
    in_channels: int = 3
    image_size: int = 32  # only for the example input and the data: the network is size-agnostic
    stem_pool: bool = False  # MaxPool(3, stride 2, pad 1) after the stem, as in the ImageNet ResNet


CIFAR_RESNET18 = CNNConfig()
SMALL = CNNConfig(width=8, depth=(1, 1), num_classes=10, in_channels=3, image_size=16)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, config: CNNConfig = CNNConfig()):
        super().__init__()
        self.config = config
        width = config.width
        self.conv1 = nn.Conv2d(config.in_channels, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.stem_pool = nn.MaxPool2d(3, stride=2, padding=1) if config.stem_pool else nn.Identity()
        stages = []
        cin = width
        for i, blocks in enumerate(config.depth):
            cout = width * 2**i
            layers = []
            for b in range(blocks):
                layers.append(BasicBlock(cin, cout, stride=2 if (i > 0 and b == 0) else 1))
                cin = cout
            stages.append(nn.Sequential(*layers))
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, config.num_classes)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem_pool(F.relu(self.bn1(self.conv1(images))))
        x = self.layers(x)
        return self.fc(torch.flatten(self.pool(x), 1))

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(images), labels)


def distinct_init(module: nn.Module, seed: int = 0) -> nn.Module:
    """Perturb every parameter and buffer that torch initializes to a constant (BatchNorm weight 1,
    bias 0, running_mean 0, running_var 1) so that no two initializers are equal. The perturbations
    are small (BatchNorm weight 1 +- 0.05, bias +- 0.05, running stats +- 0.01) and seeded."""
    gen = torch.Generator().manual_seed(seed + 12345)

    def noise(t: torch.Tensor, scale: float) -> torch.Tensor:
        return (torch.rand(t.shape, generator=gen) * 2 - 1) * scale

    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm)):
                if m.weight is not None:
                    m.weight.copy_(1.0 + noise(m.weight, 0.05))
                    m.bias.copy_(noise(m.bias, 0.05))
                if getattr(m, "running_mean", None) is not None:
                    m.running_mean.copy_(noise(m.running_mean, 0.01))
                    m.running_var.copy_(1.0 + noise(m.running_var, 0.01))
    return module


def make_module(config: CNNConfig = CNNConfig(), seed: int = 0) -> ResNet:
    torch.manual_seed(seed)
    return distinct_init(ResNet(config), seed)


def example_inputs(config: CNNConfig, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    data = make_data(config, seed, batch)
    return torch.from_numpy(data["images"]), torch.from_numpy(data["labels"])


def export(module: ResNet, path: str | Path, batch: int = 2, dynamo: bool = False, opset: int | None = None) -> Path:
    """Write ``module`` as ONNX (inputs images, labels with a dynamic batch axis; output loss), in
    training mode (BatchNormalization with batch statistics and running-statistics updates)."""
    return export_onnx(module, example_inputs(module.config, batch), path, input_names=INPUT_NAMES,
                       output_names=OUTPUT_NAMES, dynamo=dynamo, opset=opset)


def make_data(config: CNNConfig, seed: int, rows: int) -> dict[str, np.ndarray]:
    """Random images ~ N(0, 1) float32 [rows, C, H, W] and labels int64 [rows] in [0, classes), seeded."""
    rng = data_rng(seed)
    images = rng.standard_normal((rows, config.in_channels, config.image_size, config.image_size), dtype=np.float32)
    labels = rng.integers(0, config.num_classes, size=rows, dtype=np.int64)
    return {"images": images, "labels": labels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.cnn", description=__doc__.split("\n")[0])
    parser.add_argument("-o", "--out", required=True)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", default="2,2,2,2", help="BasicBlocks per stage, comma-separated")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stem-pool", action="store_true", help="MaxPool after the stem (ImageNet layout)")
    parser.add_argument("--dynamo", action="store_true", help="use the dynamo exporter (default TorchScript)")
    args = parser.parse_args(argv)
    config = CNNConfig(width=args.width, depth=tuple(int(d) for d in args.depth.split(",")),
                       num_classes=args.classes, in_channels=args.channels, image_size=args.image_size,
                       stem_pool=args.stem_pool)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    export(make_module(config, args.seed), out / "model.onnx", dynamo=args.dynamo)
    np.savez(out / "data.npz", **make_data(config, args.seed, args.rows))
    print(out / "model.onnx")
    print(out / "data.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
