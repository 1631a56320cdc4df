"""``transpile export OUT --checkpoint DIR|latest -o TRAINED.onnx``: the user's model with the
trained values of a checkpoint of any world size and strategy of the same model (docs/reliability.md).
Rank 0's file holds every parameter and buffer (they are replicated on every rank, whatever the
strategy: what ``--export`` writes too); a checkpoint of another plan is read by name
(runtime/reshard.py).
``--outputs NAMES``: only the forward up to those values, for inference (runtime/inference.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from contract.plan import EXPORTED_KINDS
from runtime import checkpoint
from runtime.errors import RunError
from runtime.export import export_model
from runtime.inference import check_outputs, parse_outputs
from runtime.plan import load_plan
from runtime.reshard import Tensors
from runtime.resume import find_resume
from runtime.segments import load_graph


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", metavar="OUT", help="transpiler output directory (holds plan.json)")
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a checkpoint store (its newest complete checkpoint) or DIR/checkpoint-<step>")
    parser.add_argument("-o", "--output", required=True, metavar="TRAINED.onnx", help="the model to write")
    parser.add_argument("--outputs", metavar="NAMES",
                        help="write only the forward up to these values of the model (comma-separated, e.g. logits), "
                             "in inference mode: no loss, no inputs they do not read (labels)")


def execute(args: argparse.Namespace) -> int:
    try:
        outputs = parse_outputs(args.outputs)
        directory, step = export_checkpoint(args.out, args.checkpoint, args.output, outputs)
    except RunError as exc:
        print(f"transpile: error: {exc}", file=sys.stderr)
        return 2
    what = f"the forward up to {', '.join(outputs)}" if outputs else "the trained model"
    print(f"wrote {args.output}: {what} of {directory} (step {step})")
    return 0


def export_checkpoint(out: str | Path, checkpoint_dir: str | Path, output: str | Path,
                      outputs: tuple[str, ...] = ()) -> tuple[Path, int]:
    """Write the user's model of OUT with the trained values of a checkpoint (``outputs``: only the
    forward up to those values) to ``output``; returns the checkpoint directory and its step."""
    plan = load_plan(out)
    where = Path(checkpoint_dir).resolve()
    directory, meta = find_resume(where, plan, shuffle=False, seed=0, export=True, option="--checkpoint")
    if not plan.model.is_file():
        raise RunError(f"{plan.model} (the user's model in OUT) is missing")
    if outputs:  # checked before the checkpoint is read
        check_outputs(load_graph(plan.model), outputs, str(plan.model))
    if checkpoint.same_plan(meta, plan):
        state = checkpoint.load(directory, 0, meta.step)
        entries = plan.graphs(0).state
        missing = [s.input for s in entries if s.kind in EXPORTED_KINDS and s.input not in state]
        if missing:
            raise RunError(f"{directory}/rank0.npz: lacks {', '.join(missing[:3])} that the plan names")
        parameters = {s.param or s.input: np.asarray(state[s.input]) for s in entries if s.kind in EXPORTED_KINDS}
    else:  # written by another world size or strategy: its parameters by name (runtime/reshard.py)
        with Tensors(directory, meta, option="--checkpoint") as tensors:
            parameters = {s.param or s.input: np.asarray(tensors.read(s.input)) for s in plan.single.state
                          if s.kind in EXPORTED_KINDS}
    bad = next((name for name, a in parameters.items() if a.dtype.kind == "f" and not np.isfinite(a).all()), None)
    if bad is not None:
        raise RunError(f"{directory}: '{bad}' holds non-finite values; not exported")
    target = Path(output).resolve()
    if target.is_dir() or not target.parent.is_dir():
        raise RunError(f"-o {output}: " + ("is a directory" if target.is_dir()
                                           else f"directory {target.parent} does not exist"))
    export_model(plan, parameters, target, outputs)
    return directory, meta.step
