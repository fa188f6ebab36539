"""Every command's flags against their snapshot, `tests/cli_flags.json`: the same flags and
positionals, defaults, choices, types, metavars and exclusive groups, so nothing a user types is
lost or changed by accident. The snapshot is made from the code, and made again on purpose when a
command or a flag is added:

    .venv/bin/python -c "import json, sys; sys.path.insert(0, 'tests'); from test_flags import describe_all; \
        print(json.dumps(describe_all(), indent=1, sort_keys=True))" > tests/cli_flags.json

A change to an existing flag (its spelling, default, choices, type or nargs) changes what users
type and get: make it only on purpose, and read the snapshot's diff for nothing else changed.
Where a value lands in the parsed namespace (argparse's dest) is the code's business, and help
texts may be reworded; none may be empty."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from raywds.cli.main import build_parser

SNAPSHOT = Path(__file__).with_name("cli_flags.json")


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def _name(action: argparse.Action) -> str:
    """A flag's first spelling, or a positional's name as --help shows it."""
    return action.option_strings[0] if action.option_strings else action.dest


def describe(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Each action's flags and behaviour (not its help), and the mutually exclusive groups."""
    actions = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        kind = action.type
        actions[_name(action)] = {
            "flags": action.option_strings,
            "action": type(action).__name__,
            "default": _plain(action.default),
            "choices": _plain(list(action.choices)) if action.choices is not None else None,
            "nargs": action.nargs,
            "required": action.required,
            "const": _plain(action.const),
            "type": getattr(kind, "__name__", None) if kind not in (None, str) else "str",
            "metavar": _plain(action.metavar),
        }
    groups = [sorted(_name(a) for a in g._group_actions) for g in parser._mutually_exclusive_groups]
    return {"actions": actions, "exclusive": sorted(groups)}


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def describe_all() -> dict[str, Any]:
    parser = build_parser()
    return {"raywds": describe(parser)} | {name: describe(p) for name, p in commands(parser).items()}


def test_every_command_takes_the_flags_of_its_snapshot() -> None:
    before = json.loads(SNAPSHOT.read_text())
    now = describe_all()
    assert sorted(now) == sorted(before)
    for command in before:
        assert sorted(now[command]["actions"]) == sorted(before[command]["actions"]), command
        for dest, was in before[command]["actions"].items():
            assert now[command]["actions"][dest] == was, f"raywds {command}: {dest}"
        assert now[command]["exclusive"] == before[command]["exclusive"], command


@pytest.mark.parametrize("command", sorted(commands(build_parser())))
def test_every_flag_has_help(command: str) -> None:
    parser = commands(build_parser())[command]
    missing = [a.dest for a in parser._actions if not (a.help or "").strip()]
    assert missing == [], f"raywds {command}: no help for {missing}"


def test_every_flag_is_its_fields_name() -> None:
    """One name per setting: `--batch-size` sets `batch_size` in a config file, in config.json and
    in the code, for every command. Aliases (`raywds plan --workers`) may add a spelling, never
    replace the field's. (Thirteen training flags and three converter ones were named apart
    from their fields; two of them crossed the shuffle buffers.)"""
    parser = build_parser()
    apart = {
        f"raywds {name} {a.option_strings[0]} -> {a.dest}"
        for name, sub in commands(parser).items()
        for a in sub._actions
        if a.option_strings
        and not isinstance(a, argparse._HelpAction)
        and "--" + a.dest.replace("_", "-") not in a.option_strings
    }
    assert apart == set()
