"""The ``transpile`` command: one entry point above the three layers it drives.

    transpile MODEL.onnx --gpus N -o OUT [options]     rewrite for N ranks            (transpiler/)
    transpile run OUT --data DATA.npz --batch B ...    train                          (runtime/)
    transpile inspect OUT                              what the rewrite produced      (inspection/)
    transpile view OUT/rank0.onnx                      a graph in Netron, on localhost (inspection/)

Each subcommand is a ``Command``: a parser builder and a handler, both owned by its layer and
imported only when that subcommand runs (``transpile inspect`` never loads onnxruntime). This is
the only package that imports more than one layer. Docs: docs/cli.md.
"""

from commands.main import COMMANDS, Command, build_parser, main

__all__ = ["COMMANDS", "Command", "build_parser", "main"]
