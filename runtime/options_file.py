"""``transpile run --config FILE.json``: run options from a JSON object, the command line over it.

Every option of ``transpile run`` can be a key, by its long name with dashes or underscores
(``"log-every"``, ``"log_every"``, ``"keep_last"``), with a JSON value of the option's type: a number
for ``--batch``, ``true``/``false`` for a flag such as ``--shuffle``, a string for a path or a choice,
a list of strings for a repeatable option (``--ep-option``). A flag given on the command line wins
over the file, also over the file's value of an option it excludes (``--epochs`` on the command
line drops the file's ``steps``). An unknown key or a value of the wrong type is a one-line error
naming the file and the key. Relative paths are relative to the working directory, as on the
command line; ``null`` means the option's default. OUT stays on the command line.

How: ``install`` adds ``--config`` to the parser and has every option default to ``UNSET`` (and no
option required) while argparse parses, so that ``complete`` can tell what the command line gave;
``complete`` then fills in the file's values and the real defaults, and checks the required options.
The Python API (graph_transpiler/) passes its keyword arguments through ``complete`` as a dict: the
same names, checks and messages.
"""

from __future__ import annotations

import argparse
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import RunError, os_error_text


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()  # an option the command line did not give
_TABLE = "option_table"  # the namespace attribute that carries the table from install to complete


@dataclass
class OptionTable:
    """The options of one parser: by key (long name, dashes as underscores), their real defaults,
    and what argparse would have required."""

    keys: dict[str, argparse.Action] = field(default_factory=dict)
    defaults: dict[str, object] = field(default_factory=dict)  # dest -> default
    required: list[argparse.Action] = field(default_factory=list)
    groups: list[tuple[list[argparse.Action], bool]] = field(default_factory=list)  # mutually exclusive, required


def _key(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


def option_table(parser: argparse.ArgumentParser) -> OptionTable:
    """The table of ``parser``'s optional arguments (positionals and --help left out)."""
    table = OptionTable()
    for action in parser._actions:
        if not action.option_strings or action.default == argparse.SUPPRESS or action.dest == "config":
            continue
        for name in [s for s in action.option_strings if s.startswith("--")] + [action.dest]:
            table.keys.setdefault(_key(name), action)
        table.defaults[action.dest] = action.default
        if action.required:
            table.required.append(action)
    table.groups = [(list(g._group_actions), g.required) for g in parser._mutually_exclusive_groups]
    return table


def install(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` to ``parser`` and leave options not on the command line UNSET (see the
    module docstring); ``complete(args)`` must run on what the parser returns."""
    parser.add_argument("--config", metavar="FILE.json",
                        help="run options from a JSON object, keyed by their long names (e.g. {\"batch\": 64, "
                             "\"lr-schedule\": \"cosine\"}); flags on the command line override it (docs/cli.md)")
    table = option_table(parser)
    for action in table.keys.values():
        if not isinstance(action, argparse._AppendAction):  # an append default must stay a list or None
            action.default = UNSET
        action.required = False
    for group in parser._mutually_exclusive_groups:
        group.required = False
    parser.set_defaults(**{_TABLE: table})


def complete(args: argparse.Namespace, values: dict | None = None, where: str | None = None) -> argparse.Namespace:
    """``args`` with the options the command line left out taken from ``--config FILE`` (or from
    ``values``, named ``where`` in errors), else their defaults; a one-line RunError for an unknown
    key, a wrong type, or a required option given nowhere. Completing twice changes nothing."""
    table: OptionTable | None = getattr(args, _TABLE, None)
    if table is None:  # completed already (or a parser without install)
        return args
    delattr(args, _TABLE)
    config = getattr(args, "config", None)
    if config is not None:
        values, where = load(config), f"--config {config}"
    given = {dest for dest in table.defaults if getattr(args, dest) is not UNSET
             and not (getattr(args, dest) is None and table.defaults[dest] is None)}
    chosen = convert(table, values or {}, where or "options")
    for members, _ in table.groups:
        if any(a.dest in given for a in members):  # the command line's choice drops the file's
            for action in members:
                chosen.pop(action.dest, None)
        elif sum(a.dest in chosen for a in members) > 1:
            both = [_key(a.option_strings[-1]) for a in members if a.dest in chosen]
            raise RunError(f"{where}: {' and '.join(repr(k) for k in both)} exclude each other; give one")
    for dest, default in table.defaults.items():
        if dest not in given:
            setattr(args, dest, chosen.get(dest, default))
    source = "in " + where if where else "in --config FILE"
    for action in table.required:
        if getattr(args, action.dest) is None:
            raise RunError(f"{action.option_strings[-1]} is required (on the command line, or as "
                           f"\"{_key(action.option_strings[-1])}\" {source})")
    for members, required in table.groups:
        if required and all(getattr(args, a.dest) is None for a in members):
            names = " or ".join(a.option_strings[-1] for a in members)
            raise RunError(f"{names} is required (on the command line, or {source})")
    return args


def load(path: str) -> dict:
    """The JSON object of ``--config path``, or a one-line RunError."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise RunError(f"--config {path}: {os_error_text(exc)}") from None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RunError(f"--config {path}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(values, dict):
        raise RunError(f"--config {path}: expected a JSON object of run options (like {{\"batch\": 64}}), "
                       f"got {_json_kind(values)}")
    return values


def convert(table: OptionTable, values: dict, where: str, command: str = "transpile run") -> dict[str, object]:
    """``values`` (key -> JSON value) checked against ``table``: {dest: value as argparse would give it}."""
    chosen: dict[str, object] = {}
    named: dict[str, str] = {}
    noun = "key" if where.startswith("--config") else "argument"
    for key, value in values.items():
        action = table.keys.get(_key(str(key)))
        if action is None:
            close = difflib.get_close_matches(_key(str(key)), list(table.keys), n=1)
            hint = f" (did you mean {close[0].replace('_', '-')!r}?)" if close else ""
            outside = " (OUT is given on the command line)" if _key(str(key)) == "out" else ""
            raise RunError(f"{where}: unknown {noun} {key!r}: not an option of {command}{outside or hint}")
        if action.dest in named:
            raise RunError(f"{where}: {noun}s {named[action.dest]!r} and {key!r} name the same option")
        named[action.dest] = key
        if value is not None:  # null: the option's default
            chosen[action.dest] = _value(action, key, value, where, noun)
    return chosen


def _value(action: argparse.Action, key: str, value, where: str, noun: str):
    def wrong(expected: str):
        try:
            shown = json.dumps(value) if _json_kind(value) != "an object" else "{...}"
        except (TypeError, ValueError):
            shown = repr(value)
        return RunError(f"{where}: {noun} {key!r} must be {expected}, got {shown[:60]} ({_json_kind(value)})")

    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if isinstance(action, argparse._AppendAction):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise wrong("a string or a list of strings")
        return [_one(action, v, wrong) for v in items]
    return _one(action, value, wrong)


def _one(action: argparse.Action, value, wrong):
    kind = action.type
    if isinstance(value, bool) and kind is not None:
        raise wrong("an integer" if kind is int else "a number" if kind is float else "a string")
    if kind is int:
        if not isinstance(value, int):
            raise wrong("an integer")
    elif kind is float:
        if not isinstance(value, (int, float)):
            raise wrong("a number")
        value = float(value)
    elif kind is None or kind is str:
        if not isinstance(value, str):
            raise wrong("a string")
    else:  # an argparse type function: it reads the command line's text
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        try:
            value = kind(str(value))
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise wrong(str(exc) or "a valid value") from None
    if action.choices is not None and value not in action.choices:
        raise wrong("one of " + ", ".join(repr(c) for c in action.choices))
    return value


def _json_kind(value) -> str:
    for kinds, name in ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (list, "a list"),
                        (dict, "an object")):
        if isinstance(value, kinds):
            return name
    return "null" if value is None else type(value).__name__
