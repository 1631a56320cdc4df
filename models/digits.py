"""A small CNN on scikit-learn's bundled 8x8 digits, trained with ``transpile run`` on CPU ranks.

Model (3.8k parameters): Conv(1->12, 3x3, pad 1) - BatchNorm - ReLU - MaxPool 2 -> [12, 4, 4];
Conv(12->24, 3x3, pad 1) - BatchNorm - ReLU - MaxPool 2 -> [24, 2, 2]; Flatten; Linear(96, 10);
mean cross-entropy. ``forward(images float32 [B, 1, 8, 8], labels int64 [B]) -> loss``.

Data: ``sklearn.datasets.load_digits`` (1797 images, shipped with scikit-learn, no download),
pixels / 16, split by a seeded permutation into 1437 training and 360 held-out images.

The exported model's only output is the loss, which needs labels. ``eval_model`` derives an
inference graph from a trained (``--export``ed) model: every BatchNormalization switched to
inference mode (running statistics), the logits (the input of the loss node) as the output, the
labels input and the loss dropped. ``accuracy`` runs it with onnxruntime.

    python -m models digits -o DIR                          # model.onnx + data.npz (training split)
    python -m models.digits --train [--plot docs/images/digits_loss.png] [--work DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as exc:  # torch is only in the test extra
    raise ImportError("models.digits needs PyTorch: pip install torch (or the project's [test] extra)") from exc

from models.cnn import distinct_init
from models.torch_twins import export_onnx

INPUT_NAMES = ["images", "labels"]
OUTPUT_NAMES = ["loss"]
HELD_OUT = 360


@dataclass(frozen=True)
class DigitsConfig:
    channels: tuple[int, int] = (12, 24)
    num_classes: int = 10


CONFIG = DigitsConfig()

# The recipe of docs/models.md and tests/test_digits.py.
RANKS = 4
TRANSPILE_ARGS = ["--gpus", str(RANKS), "--optimizer", "momentum", "--momentum", "0.9", "--lr", "0.05", "--sync-bn"]
RUN_ARGS = ["--batch", "64", "--epochs", "15", "--shuffle", "--seed", "0"]


class DigitsCNN(nn.Module):
    def __init__(self, config: DigitsConfig = CONFIG):
        super().__init__()
        self.config = config
        c1, c2 = config.channels
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c2)
        self.fc = nn.Linear(c2 * 2 * 2, config.num_classes)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(images))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(torch.flatten(x, 1))

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(images), labels)


def make_module(config: DigitsConfig = CONFIG, seed: int = 0) -> DigitsCNN:
    torch.manual_seed(seed)
    return distinct_init(DigitsCNN(config), seed)


def load_split(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train, held_out): {"images": float32 [N, 1, 8, 8] in [0, 1], "labels": int64 [N]}."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError("models.digits needs scikit-learn: pip install scikit-learn") from None
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    test, train = order[:HELD_OUT], order[HELD_OUT:]
    return ({"images": images[train], "labels": labels[train]},
            {"images": images[test], "labels": labels[test]})


def make_data(config: DigitsConfig = CONFIG, seed: int = 0, rows: int | None = None) -> dict[str, np.ndarray]:
    """The training split (``rows`` of it, repeated if more are asked)."""
    train, _ = load_split(seed)
    n = len(train["labels"])
    index = np.arange(n if rows is None else rows) % n
    return {k: np.ascontiguousarray(v[index]) for k, v in train.items()}


def export(module: DigitsCNN, path: str | Path, batch: int = 4, dynamo: bool = False) -> Path:
    data = make_data(module.config, 0, batch)
    args = (torch.from_numpy(data["images"]), torch.from_numpy(data["labels"]))
    return export_onnx(module, args, path, input_names=INPUT_NAMES, output_names=OUTPUT_NAMES, dynamo=dynamo)


LOSS_OPS = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")


def eval_model(trained: str | Path | onnx.ModelProto) -> onnx.ModelProto:
    """Inference graph of a trained model: images -> logits, BatchNormalization on running statistics."""
    model = trained if isinstance(trained, onnx.ModelProto) else onnx.load(str(trained))
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    loss_nodes = [n for n in graph.node if n.op_type in LOSS_OPS]
    if len(loss_nodes) != 1:
        raise ValueError(f"expected one loss node ({' or '.join(LOSS_OPS)}), found {len(loss_nodes)}")
    logits = loss_nodes[0].input[0]
    for node in graph.node:
        if node.op_type == "BatchNormalization":
            for attr in node.attribute:
                if attr.name == "training_mode":
                    attr.i = 0
            del node.output[1:]
    # Keep only the nodes that the logits depend on.
    producer = {out: node for node in graph.node for out in node.output}
    needed, stack = set(), [logits]
    while stack:
        name = stack.pop()
        node = producer.get(name)
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            stack.extend(i for i in node.input if i)
    kept = [n for n in graph.node if id(n) in needed]
    del graph.node[:]
    graph.node.extend(kept)
    used = {i for n in kept for i in n.input}
    inputs = [vi for vi in graph.input if vi.name in used]
    del graph.input[:]
    graph.input.extend(inputs)
    del graph.output[:]
    graph.output.append(onnx.helper.make_tensor_value_info(logits, onnx.TensorProto.FLOAT, ["batch", None]))
    del graph.value_info[:]
    onnx.checker.check_model(model)
    return model


def accuracy(trained: str | Path | onnx.ModelProto, data: dict[str, np.ndarray]) -> float:
    """Fraction of ``data``'s images whose argmax logit is the label, with onnxruntime."""
    import onnxruntime as ort

    session = ort.InferenceSession(eval_model(trained).SerializeToString(), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    (logits,) = session.run(None, {name: data["images"]})
    return float(np.mean(np.argmax(logits, axis=1) == data["labels"]))


def train(work: str | Path, *, log_every: int = 1) -> tuple[Path, list[tuple[int, float]], float]:
    """The documented recipe through the real CLI (``transpile`` then ``transpile run`` on 4 MPI
    ranks). Returns (trained model, [(step, loss)], held-out accuracy)."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    module = make_module()
    export(module, work / "model.onnx")
    np.savez(work / "data.npz", **make_data())
    cli = [sys.executable, "-m", "transpiler.cli"]
    done = subprocess.run([*cli, str(work / "model.onnx"), *TRANSPILE_ARGS, "-o", str(work / "out")],
                          capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"transpile failed: {done.stderr.strip()}")
    trained, metrics = work / "trained.onnx", work / "metrics.jsonl"
    done = subprocess.run([*cli, "run", str(work / "out"), "--data", str(work / "data.npz"), *RUN_ARGS,
                           "--log-every", str(log_every), "--export", str(trained), "--metrics", str(metrics)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"transpile run failed: {done.stderr.strip()}")
    from runtime.metrics import read_metrics

    curve = [(r["step"], r["loss"]) for r in read_metrics(metrics)[0] if "loss" in r]
    _, held_out = load_split()
    return trained, curve, accuracy(trained, held_out)


def plot(curve: list[tuple[int, float]], accuracy_value: float, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = zip(*curve)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, losses, lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("step (global batch 64 = 4 ranks x 16)")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_title(f"digits CNN, transpile run on 4 CPU ranks: held-out accuracy {accuracy_value:.1%}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.digits", description=__doc__.split("\n")[0])
    parser.add_argument("--train", action="store_true", help="train with the documented recipe and report accuracy")
    parser.add_argument("--plot", help="write the loss curve as PNG (with --train)")
    parser.add_argument("--work", help="working directory (default: a temporary one)")
    args = parser.parse_args(argv)
    if not args.train:
        parser.error("nothing to do: pass --train (python -m models digits -o DIR writes the model and data)")
    with tempfile.TemporaryDirectory() as tmp:
        trained, curve, acc = train(args.work or tmp)
        print(f"steps {len(curve)}  loss {curve[0][1]:.4f} -> {curve[-1][1]:.4f}  held-out accuracy {acc:.4f}")
        if args.plot:
            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
            plot(curve, acc, args.plot)
            print(args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
