"""The ``transpile`` command line: one argparse parser with a subparser per subcommand.

    transpile [compile] MODEL ...   transpiler/cli.py       transpile run OUT ...     runtime/cli.py
    transpile export OUT ...        runtime/export_cli.py   transpile inspect OUT ... inspection/cli.py
    transpile view FILE ...         inspection/view.py      transpile help [COMMAND], transpile --version

Each subcommand's options and handler belong to its layer (``add_arguments(parser)``,
``execute(args) -> int``). Only the subcommand being run has its module imported and its options
added to its subparser (``transpile inspect`` never loads onnxruntime); the others are registered
with their one-line summary, so ``transpile --help`` and the usage line list them all.
``transpile MODEL ...`` without a command word is ``transpile compile MODEL ...``.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import importlib
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from contract.errors import UserError


@dataclass(frozen=True)
class Command:
    name: str
    module: str  # imported when the command runs: add_arguments(parser) and execute(args) -> int
    usage: str  # what follows 'transpile' in the command list
    description: str  # its first sentence is the one-line summary

    @property
    def summary(self) -> str:
        return self.description.split(". ")[0].rstrip(".")


DEFAULT = "compile"
COMMANDS = {c.name: c for c in (
    Command("compile", "transpiler.cli", "[compile] MODEL -o OUT --gpus N",
            "Rewrite a single-device ONNX model (loss inside the graph) into data-parallel training graphs for "
            "N ranks. The command word is optional: 'transpile MODEL ...' is 'transpile compile MODEL ...'."),
    Command("run", "runtime.cli", "run OUT --data DATA --batch B --steps K",
            "Train on the graphs in OUT, one process per rank."),
    Command("export", "runtime.export_cli", "export OUT --checkpoint DIR -o FILE",
            "Write the user's model with the trained values of a checkpoint (docs/reliability.md)."),
    Command("inspect", "inspection.cli", "inspect OUT|MODEL.onnx",
            "Show what 'transpile' wrote into OUT (or summarize a plain model.onnx). Docs: docs/inspect.md."),
    Command("view", "inspection.view", "view FILE|OUT", "Serve an ONNX graph in Netron on localhost."),
)}
_HELP_USAGE = "help [COMMAND]"


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``load`` names the one subcommand whose options are added (its module
    imported), or None for none (usage and the command list need only the summaries)."""
    width = max(len(c.usage) for c in COMMANDS.values())
    epilog = "\n".join([f"  transpile {c.usage:{width}s}  {c.summary}" for c in COMMANDS.values()]
                       + [f"  transpile {_HELP_USAGE:{width}s}  the commands, or one command's options",
                          "", "'transpile help COMMAND' (or 'transpile COMMAND --help') shows a command's options. "
                          "Docs: docs/cli.md."])
    parser = argparse.ArgumentParser(prog="transpile", formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Data-parallel training from a single-device ONNX model.",
                                     epilog="commands:\n" + epilog)
    parser.add_argument("-V", "--version", action="version", version=f"transpile (graph-transpiler) {_version()}")
    # No per-command help here: the epilog lists them with their arguments. The usage line names them.
    sub = parser.add_subparsers(dest="command", required=True,
                                help="a command listed below; 'transpile MODEL ...' is 'transpile compile MODEL ...'")
    for command in COMMANDS.values():
        p = sub.add_parser(command.name, description=command.description)
        if command.name == load:
            module = importlib.import_module(command.module)
            module.add_arguments(p)
            p.set_defaults(execute=module.execute)
    helper = sub.add_parser("help", description="The commands, or one command's options.")
    helper.add_argument("topic", nargs="?", metavar="COMMAND")
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse a command line; ``SystemExit(2)`` with argparse's message on a usage error."""
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS and argv[0] != "help":
        _check_not_a_typo(argv[0])
        argv = [DEFAULT, *argv]
    elif argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "-V", "--version"):
        argv = [DEFAULT, *argv]  # 'transpile -o OUT MODEL': options first, still compile
    name = argv[0] if argv and argv[0] in COMMANDS else None
    return build_parser(name).parse_args(argv)


def _check_not_a_typo(word: str) -> None:
    """'transpile rnu OUT' would otherwise report that the model file 'rnu' does not exist."""
    close = difflib.get_close_matches(word, [*COMMANDS, "help"], n=1, cutoff=0.6)
    if close and not Path(word).exists():
        build_parser().error(f"'{word}' is neither a command nor a file (did you mean '{close[0]}'?)")


def _help(topic: str | None) -> int:
    """``transpile help``: the usage and the commands; ``transpile help CMD``: that command's options."""
    if topic is None:
        build_parser().print_help()
        return 0
    name = DEFAULT if topic in ("transpile", "MODEL") else topic
    if name not in COMMANDS:
        print(f"transpile: error: help: no command {topic!r} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    try:
        parse([name, "--help"])
    except SystemExit as exc:  # argparse prints the command's help and exits 0
        return int(exc.code or 0)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # onnx-ir warns, per value, when serializing a value that has a shape but no dtype yet; ours are
    # typed by the shape inference that runs right after, so the warnings would only be noise.
    logging.getLogger("onnx_ir.serde").setLevel(logging.ERROR)
    # SIGTERM unwinds like Ctrl-C, so a transpile being written removes its temporary directory.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        try:
            args = parse(argv)
        except SystemExit as exc:  # argparse: --help/--version (0), usage errors (2)
            return int(exc.code or 0) if not isinstance(exc.code, str) else 2
        if args.command == "help":
            return _help(args.topic)
        execute = args.execute
        del args.command, args.execute
        return execute(args)
    except UserError as exc:
        print(f"transpile: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file that cannot be read or written, not caught closer to it: still one line
        print(f"transpile: error: {_os_error_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("transpile: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("transpile: terminated", file=sys.stderr)
        return 143


def _os_error_line(exc: OSError) -> str:
    """'PATH: No space left on device (ENOSPC)' (runtime/errors.py has the same words; importing it
    here would load the runtime for every command)."""
    name = errno.errorcode.get(exc.errno or 0)
    text = exc.strerror or (str(exc).splitlines() or [type(exc).__name__])[0]
    where = f"{exc.filename}: " if exc.filename is not None else ""
    return f"{where}{text} ({name})" if name else f"{where}{text}"


class _Terminated(BaseException):
    pass


def _terminate(_signum, _frame) -> None:
    raise _Terminated()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("graph-transpiler")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


if __name__ == "__main__":
    sys.exit(main())
