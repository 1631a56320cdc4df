"""The ``transpile`` command: one entry point above the three layers it drives.

    transpile [compile] MODEL.onnx --gpus N -o OUT     rewrite for N ranks            (transpiler/)
    transpile run OUT --data DATA --batch B ...        train                          (runtime/)
    transpile export OUT --checkpoint DIR -o FILE      a checkpoint as the user's model (runtime/)
    transpile inspect OUT                              what the rewrite produced      (inspection/)
    transpile view OUT/rank0.onnx                      a graph in Netron, on localhost (inspection/)

One argparse parser, a subparser per ``Command``: its options and handler are owned by its layer
and imported only when that subcommand runs (``transpile inspect`` never loads onnxruntime). This is
one of the two packages that import more than one layer (the other: graph_transpiler/, the Python API). Docs: docs/cli.md.
"""

from commands.main import COMMANDS, Command, build_parser, main

__all__ = ["COMMANDS", "Command", "build_parser", "main"]
