"""``transpile MODEL.onnx --gpus N -o OUT [options]``: its options and what it does.

The ``transpile`` command (commands/) dispatches here for the rewrite; ``run`` belongs to runtime/,
``inspect`` and ``view`` to inspection/.
"""

from __future__ import annotations

import argparse
import os
import sys

from transpiler.errors import TranspileError
from transpiler.strategies import DEFAULT_STRATEGY, STRATEGIES, user_strategies


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like '0.9,0.999', got '{text}'") from None


class _Removed(argparse.Action):
    """An option that no longer exists: giving it is a one-line usage error naming what replaced it
    (raised while parsing, before any other check; commands/ prints it, status 2)."""

    def __init__(self, option_strings, dest, *, why: str, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        raise TranspileError(f"{option_string} was removed: {self.why}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``transpile MODEL`` (the parser itself belongs to commands/)."""
    p.add_argument("model", help="the ONNX model; its loss is computed inside the graph")
    p.add_argument("-o", "--out", required=True, help="output directory (written atomically)")
    p.add_argument("--gpus", type=int, default=1, help="number of ranks (default 1)")
    p.add_argument("--strategy", default=DEFAULT_STRATEGY, help="; ".join(
        f"{name}: {STRATEGIES[name].summary}" + (" (default)" if name == DEFAULT_STRATEGY else "")
        for name in user_strategies()))
    p.add_argument("--placement", default="balanced", help="root of each parameter: balanced (greedy by bytes, default) or hash (crc32 of the name)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="gradient bucket size cap in MiB (default: an eighth of the model's gradients, within "
                        "[25, 100]: 25 for models up to 200 MiB, as DDP's)")
    p.add_argument("--first-bucket-mb", type=float, default=None,
                   help="cap of the first bucket (of each root, under sharded) in MiB, as DDP's 1 MiB first bucket: "
                        "the first collective starts earlier in the backward (default: --bucket-mb)")
    p.add_argument("--loss", help="the graph output to minimize (default: the only scalar float output)")
    p.add_argument("--freeze", metavar="REGEX", help="initializers whose name matches are not trained")
    p.add_argument("--train", metavar="REGEX",
                   help="initializers whose name matches are trained even where the default rules freeze them "
                        "(0-d constants, Pow exponents, rotary inv_freq, masks, ...; docs/models.md)")
    p.add_argument("--flat-update", action=_Removed,
                   why="every optimizer update is already one fused node per tensor and the GPU backend updates "
                       "each bucket in one multi-tensor kernel (docs/optimizers.md); drop the option")
    p.add_argument("--grad-accumulation", type=int, default=1, metavar="K",
                   help="micro-batches per optimizer step: each rank's shard is cut into K, their gradients are "
                        "averaged before the collectives (default 1)")
    p.add_argument("--sparse-grads", action="store_true",
                   help="a table whose gradient is a scatter of the batch's rows (an embedding lookup) sends those "
                        "rows (an all-gather) instead of the dense table; allreduce and sharded (docs/gpu.md)")
    p.add_argument("--sync-bn", action="store_true",
                   help="BatchNormalization statistics over the global batch (all-reduced), so N ranks equal one device")
    m = p.add_argument_group("mixed precision (docs/precision.md)")
    m.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="compute dtype of the matrix products and convolutions (torch.autocast's op lists); "
                        "master weights and optimizer state stay fp32; fp16 adds dynamic loss scaling "
                        "(GradScaler's: skipped steps on overflow) (default fp32)")
    m.add_argument("--grad-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="dtype of the gradient buckets in the collectives (DDP's bf16_compress_hook: half the "
                        "bytes); the update reads them as fp32 (default fp32)")
    o = p.add_argument_group("optimizer (torch.optim formulas, docs/optimizers.md)")
    o.add_argument("--optimizer", default="sgd", help="sgd, momentum, adam or adamw (default sgd)")
    o.add_argument("--lr", type=float, default=None, help="default learning rate (run --lr overrides it)")
    o.add_argument("--momentum", type=float, default=None)
    o.add_argument("--nesterov", action="store_true")
    o.add_argument("--weight-decay", type=float, default=None)
    o.add_argument("--betas", type=_floats, default=None, help="adam betas, e.g. 0.9,0.999")
    o.add_argument("--eps", type=float, default=None)
    o.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help="clip the gradients to global L2 norm MAX before the update (torch.nn.utils.clip_grad_norm_)")


def optimizer_config(args: argparse.Namespace):
    from transpiler.optimizer import OptimizerConfig

    given = {
        "lr": args.lr,
        "momentum": args.momentum,
        "weight_decay": args.weight_decay,
        "betas": args.betas,
        "eps": args.eps,
        "max_grad_norm": args.clip_grad_norm,
    }
    if args.betas is not None and len(args.betas) != 2:
        raise TranspileError(f"--betas takes two numbers (got {len(args.betas)})")
    # An option the chosen optimizer does not read is a mistake, not something to ignore silently.
    # Which optimizer reads which option is the optimizer table's; lr, --weight-decay (read by all)
    # and --clip-grad-norm (no optimizer's: it wraps any update) need no check.
    from transpiler.optimizer_table import OPTIMIZER_TABLE, optimizers_using

    for option in given:
        optimizers = optimizers_using(option)
        if given[option] is not None and 0 < len(optimizers) < len(OPTIMIZER_TABLE) and args.optimizer not in optimizers:
            raise TranspileError(f"--{option}: only used by --optimizer {' or '.join(optimizers)}, not {args.optimizer!r}")
    kwargs = {k: v for k, v in given.items() if v is not None}
    if args.nesterov:
        kwargs["nesterov"] = True
    return OptimizerConfig(name=args.optimizer, **kwargs)


def execute(args: argparse.Namespace) -> int:
    from transpiler import transpile
    from transpiler.passes import Options

    options = Options(
        world_size=args.gpus,
        strategy=args.strategy,
        placement=args.placement,
        optimizer=optimizer_config(args),
        bucket_mb=args.bucket_mb,
        first_bucket_mb=args.first_bucket_mb,
        sync_bn=args.sync_bn,
        grad_accumulation=args.grad_accumulation,
        sparse_grads=args.sparse_grads,
        precision=args.precision,
        grad_dtype=args.grad_dtype,
    )
    from transpiler.progress import LARGE_MODEL_BYTES, LARGE_WORLD, Progress

    try:
        large = os.path.getsize(args.model) >= LARGE_MODEL_BYTES or args.gpus >= LARGE_WORLD
    except OSError:
        large = False  # the load stage names the problem
    plan = transpile(args.model, args.out, options, loss=args.loss, freeze=args.freeze, train=args.train,
                     progress=Progress(large=large))
    trainable = plan.get("trainable", {})
    for warning in trainable.get("warnings", []):
        print(f"transpile: warning: {warning}", file=sys.stderr)
    if trainable.get("summary"):
        print(trainable["summary"])
    n_bytes = sum(p["bytes"] for p in plan["parameters"])
    print(
        f"wrote {args.out}: {plan['world_size']} rank(s), strategy {plan['strategy']}, "
        f"{len(plan['parameters'])} parameters ({n_bytes / 1e6:.3f} MB), "
        f"{len(plan['buckets'])} bucket(s), {len(plan['collectives']['step'])} collective(s) per step, "
        f"placement {plan['placement']['method']} (imbalance {plan['placement']['imbalance']:.2f}); "
        f"see: transpile inspect {args.out}"
    )
    return 0


if __name__ == "__main__":
    # ``python -m transpiler.cli`` is kept as another name of the ``transpile`` command (the tests and
    # older scripts call it); the command itself lives above the layers, in commands/.
    from commands.main import main  # noqa: TID251 - the one upward import, only when run as a script

    sys.exit(main())
