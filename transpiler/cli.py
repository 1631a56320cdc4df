"""The ``transpile`` command.

    transpile MODEL.onnx --gpus N -o OUT [options]     rewrite for N ranks
    transpile run OUT --data DATA.npz --batch B ...    train (runtime/)
    transpile inspect OUT                              what the rewrite produced
    transpile view OUT/rank0.onnx                      a graph in Netron, on localhost
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from transpiler.errors import TranspileError

SUBCOMMANDS = ("run", "inspect", "view")


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like '0.9,0.999', got '{text}'") from None


def transpile_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="transpile",
        description="Rewrite a single-device ONNX model (loss inside the graph) into data-parallel training "
        "graphs for N ranks. Subcommands: 'transpile run OUT ...' trains, 'transpile inspect OUT' shows the result, "
        "'transpile view FILE' opens a graph in Netron.",
    )
    p.add_argument("model", help="the ONNX model; its loss is computed inside the graph")
    p.add_argument("-o", "--out", required=True, help="output directory (written atomically)")
    p.add_argument("--gpus", type=int, default=1, help="number of ranks (default 1)")
    p.add_argument("--strategy", default="sharded", help="sharded (default: reduce to a root, update there, broadcast), allreduce (DDP/Horovod) or zero "
                   "(reduce-scatter, each rank updates 1/N of every bucket, all-gather)")
    p.add_argument("--placement", default="hash", help="root of each parameter: hash (crc32 of the name, default) or balanced (greedy by bytes)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size cap in MiB (default 25)")
    p.add_argument("--loss", help="the graph output to minimize (default: the only scalar float output)")
    p.add_argument("--freeze", metavar="REGEX", help="initializers whose name matches are not trained")
    p.add_argument("--flat-update", action="store_true",
                   help="deprecated, ignored: every update is one fused node, and the GPU backend updates a "
                        "bucket in one kernel (docs/optimizers.md)")
    p.add_argument("--grad-accumulation", type=int, default=1, metavar="K",
                   help="micro-batches per optimizer step: each rank's shard is cut into K, their gradients are "
                        "averaged before the collectives (default 1)")
    p.add_argument("--sync-bn", action="store_true",
                   help="BatchNormalization statistics over the global batch (all-reduced), so N ranks equal one device")
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
    return p


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


def cmd_transpile(argv: list[str]) -> int:
    args = transpile_parser().parse_args(argv)
    from transpiler import transpile
    from transpiler.passes import Options

    options = Options(
        world_size=args.gpus,
        strategy=args.strategy,
        placement=args.placement,
        optimizer=optimizer_config(args),
        bucket_mb=args.bucket_mb,
        sync_bn=args.sync_bn,
        flat_update=args.flat_update,
        grad_accumulation=args.grad_accumulation,
    )
    plan = transpile(args.model, args.out, options, loss=args.loss, freeze=args.freeze)
    n_bytes = sum(p["bytes"] for p in plan["parameters"])
    print(
        f"wrote {args.out}: {plan['world_size']} rank(s), strategy {plan['strategy']}, "
        f"{len(plan['parameters'])} parameters ({n_bytes / 1e6:.3f} MB), "
        f"{len(plan['buckets'])} bucket(s), {len(plan['collectives']['step'])} collective(s) per step, "
        f"placement {plan['placement']['method']} (imbalance {plan['placement']['imbalance']:.2f}); "
        f"see: transpile inspect {args.out}"
    )
    return 0


def cmd_inspect(argv: list[str]) -> int:
    from transpiler.inspect import inspect_main

    return inspect_main(argv)


def cmd_view(argv: list[str]) -> int:
    from transpiler.inspect_view import view_main

    return view_main(argv)


def cmd_run(argv: list[str]) -> int:
    # The runtime is a separate package; it is imported only for this subcommand.
    from runtime.cli import add_run_arguments, run_command

    parser = argparse.ArgumentParser(prog="transpile run", description="Train on the graphs in OUT, one process per rank.")
    add_run_arguments(parser)
    return run_command(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # onnx-ir warns, per value, when serializing a value that has a shape but no dtype yet; ours are
    # typed by the shape inference that runs right after, so the warnings would only be noise.
    logging.getLogger("onnx_ir.serde").setLevel(logging.ERROR)
    # SIGTERM unwinds like Ctrl-C, so a transpile being written removes its temporary directory.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        if argv and argv[0] == "run":
            return cmd_run(argv[1:])
        if argv and argv[0] == "inspect":
            return cmd_inspect(argv[1:])
        if argv and argv[0] == "view":
            return cmd_view(argv[1:])
        return cmd_transpile(argv)
    except TranspileError as exc:
        print(f"transpile: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("transpile: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("transpile: terminated", file=sys.stderr)
        return 143


class _Terminated(BaseException):
    pass


def _terminate(_signum, _frame) -> None:
    raise _Terminated()


if __name__ == "__main__":
    sys.exit(main())
