"""``python -m models NAME -o DIR [--seed S] [--rows N]``: write DIR/model.onnx and DIR/data.npz."""

from __future__ import annotations

import argparse
import sys

import models


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models",
        description="Generate a built-in example model (model.onnx, loss inside the graph) and its data (data.npz).",
        epilog="models: "
        + "; ".join(f"{name}: {spec.summary}" for name, spec in sorted(models.MODELS.items())),
    )
    parser.add_argument("name", help=f"one of {', '.join(sorted(models.MODELS))}")
    parser.add_argument("-o", "--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the parameters and the data (default 0)")
    parser.add_argument("--rows", type=int, default=None, help="rows of data (default: the model's)")
    args = parser.parse_args(argv)
    try:
        paths = models.generate(args.name, args.out, seed=args.seed, rows=args.rows)
    except ValueError as error:
        print(f"python -m models: error: {error}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
