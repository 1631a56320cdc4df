"""``transpile export OUT --checkpoint DIR|latest -o TRAINED.onnx``: the user's model with the
trained values of a checkpoint (docs/reliability.md). Rank 0's file holds every parameter and
buffer (they are replicated on every rank, whatever the strategy: what ``--export`` writes too)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from contract.plan import EXPORTED_KINDS
from runtime import checkpoint
from runtime.errors import RunError
from runtime.export import export_model
from runtime.plan import load_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", metavar="OUT", help="transpiler output directory (holds plan.json)")
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a checkpoint store (its newest complete checkpoint) or DIR/checkpoint-<step>")
    parser.add_argument("-o", "--output", required=True, metavar="TRAINED.onnx", help="the model to write")


def execute(args: argparse.Namespace) -> int:
    try:
        plan = load_plan(args.out)
        where = Path(args.checkpoint).resolve()
        directory, meta = checkpoint.find_resume(where, plan, batch=0, shuffle=False, seed=0, schedule=None,
                                                 check_data_order=False, option="--checkpoint")
        if not plan.model.is_file():
            raise RunError(f"{plan.model} (the user's model in OUT) is missing")
        state = checkpoint.load(directory, 0, meta.step)
        entries = plan.graphs(0).state
        missing = [s.input for s in entries if s.kind in EXPORTED_KINDS and s.input not in state]
        if missing:
            raise RunError(f"{directory}/rank0.npz: lacks {', '.join(missing[:3])} that the plan names")
        parameters = {s.param or s.input: np.asarray(state[s.input]) for s in entries if s.kind in EXPORTED_KINDS}
        bad = next((name for name, a in parameters.items() if a.dtype.kind == "f" and not np.isfinite(a).all()), None)
        if bad is not None:
            raise RunError(f"{directory}: '{bad}' holds non-finite values; not exported")
        output = Path(args.output).resolve()
        if output.is_dir() or not output.parent.is_dir():
            raise RunError(f"-o {args.output}: " + ("is a directory" if output.is_dir()
                                                    else f"directory {output.parent} does not exist"))
        export_model(plan, parameters, output)
    except RunError as exc:
        print(f"transpile: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: the trained model of {directory} (step {meta.step})")
    return 0
