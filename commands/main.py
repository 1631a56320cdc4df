"""Dispatch ``transpile [run|export|inspect|view] ...`` to the layer that owns the subcommand.

Today the first word picks the subcommand and anything else is ``transpile MODEL``; each command
has its own parser (``add_arguments``) and handler (``execute``), so moving to argparse subparsers
is a matter of registering ``COMMANDS`` on one parser.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

from contract.errors import UserError


@dataclass(frozen=True)
class Command:
    name: str  # "" for the default command, ``transpile MODEL``
    module: str  # imported when the command runs: add_arguments(parser) and execute(args) -> int
    prog: str
    description: str

    def parser(self) -> tuple[argparse.ArgumentParser, Callable[[argparse.Namespace], int]]:
        module = importlib.import_module(self.module)
        parser = argparse.ArgumentParser(prog=self.prog, description=self.description)
        module.add_arguments(parser)
        return parser, module.execute

    def run(self, argv: list[str]) -> int:
        parser, execute = self.parser()
        return execute(parser.parse_args(argv))


COMMANDS = {
    "": Command("", "transpiler.cli", "transpile",
                "Rewrite a single-device ONNX model (loss inside the graph) into data-parallel training graphs for "
                "N ranks. Subcommands: 'transpile run OUT ...' trains, 'transpile inspect OUT' shows the result, "
                "'transpile view FILE' opens a graph in Netron."),
    "run": Command("run", "runtime.cli", "transpile run", "Train on the graphs in OUT, one process per rank."),
    "export": Command("export", "runtime.export_cli", "transpile export",
                      "Write the user's model with the trained values of a checkpoint (docs/reliability.md)."),
    "inspect": Command("inspect", "inspection.cli", "transpile inspect",
                       "Show what 'transpile' wrote into OUT (or summarize a plain model.onnx). Docs: docs/inspect.md."),
    "view": Command("view", "inspection.view", "transpile view", "Serve an ONNX graph in Netron on localhost."),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # onnx-ir warns, per value, when serializing a value that has a shape but no dtype yet; ours are
    # typed by the shape inference that runs right after, so the warnings would only be noise.
    logging.getLogger("onnx_ir.serde").setLevel(logging.ERROR)
    # SIGTERM unwinds like Ctrl-C, so a transpile being written removes its temporary directory.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        if argv and argv[0] in ("--version", "-V"):
            print(f"transpile (graph-transpiler) {_version()}")
            return 0
        if argv and argv[0] == "help":
            return _help(argv[1:])
        if argv and argv[0] in COMMANDS and argv[0]:
            return COMMANDS[argv[0]].run(argv[1:])
        return COMMANDS[""].run(argv)
    except UserError as exc:
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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("graph-transpiler")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _help(argv: list[str]) -> int:
    """``transpile help``: the commands, one line each; ``transpile help CMD``: that command's help."""
    if argv:
        name = "" if argv[0] in ("compile", "transpile") else argv[0]
        if name not in COMMANDS:
            print(f"transpile: error: help: no command {argv[0]!r} (commands: {', '.join(c or 'MODEL' for c in COMMANDS)})",
                  file=sys.stderr)
            return 2
        COMMANDS[name].parser()[0].print_help()
        return 0
    print("usage: transpile MODEL [options] | transpile {run,export,inspect,view} ... | transpile help [COMMAND] | "
          "transpile --version\n")
    for command in COMMANDS.values():
        print(f"  {command.prog + (' MODEL' if not command.name else ''):20s} {command.description.split('. ')[0].rstrip('.')}")
    print("\n'transpile help COMMAND' (or 'transpile COMMAND --help') shows a command's options.")
    return 0
