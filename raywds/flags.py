"""The training flags of `raywds train` and `raywds ray`, made from TrainConfig itself: one
flag per field, its help the field's docstring, its choices the field's Literal type, its
default the field's default. A flag is `--` and the field name with dashes, unless the field
names another (`field(metadata=flag("--epochs"))`). A flag not given is None, so the recipe
and the config file underneath it keep their values.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import types
import typing
from typing import Any

from raywds.config import TrainConfig, choices

NOT_FLAGS = ("data",)
"""Fields the CLI sets otherwise (`--data` or `--demo`)."""


@functools.cache
def field_docs() -> dict[str, str]:
    """Each TrainConfig field's docstring (the string literal under it in the class body)."""
    body = ast.parse(inspect.getsource(TrainConfig)).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())  # type: ignore[union-attr]
    return docs


def _value_type(field: dataclasses.Field[Any]) -> Any:
    """int, float or str: the field's type without None; a number or a word for `int | Literal[...]`."""
    hint = typing.get_type_hints(TrainConfig)[field.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        words = [w for a in kinds if typing.get_origin(a) is typing.Literal for w in typing.get_args(a)]
        if words and int in kinds:
            return _int_or(tuple(words))
        hint = kinds[0]
    return str if typing.get_origin(hint) is typing.Literal else hint


def _int_or(words: tuple[str, ...]) -> Any:
    """A flag's parser for a whole number or one of `words` (`--loader-workers auto`)."""

    def parse(text: str) -> int | str:
        return text if text in words else int(text)

    parse.__name__ = "number or " + "|".join(words)  # argparse names it: "invalid number or auto value"
    return parse


def flag_fields() -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(TrainConfig) if f.name not in NOT_FLAGS]


def flag_name(field: dataclasses.Field[Any]) -> str:
    return str(field.metadata.get("flag", "--" + field.name.replace("_", "-")))


def _help(field: dataclasses.Field[Any]) -> str:
    text = field_docs().get(field.name, "")
    default = field.default
    if default is None or default is False:
        return text  # None and False say nothing
    return f"{text} (default {default})"


def add_config_flags(
    parser: argparse.ArgumentParser,
    *,
    skip: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
    with_defaults: bool = False,
    aliases: dict[str, tuple[str, ...]] | None = None,
) -> None:
    """One flag per TrainConfig field (those in `only`, but `skip`), each None unless given, or
    `with_defaults` the field's default (for commands that use the values without a config)."""
    for field in flag_fields():
        if field.name in skip or (only is not None and field.name not in only):
            continue
        kind = _value_type(field)
        options: dict[str, Any] = {"dest": field.name, "help": _help(field)}
        if kind is bool:
            options.update(action="store_const", const=True)
        else:
            options.update(type=kind)
        if field.name in choices():
            options.update(choices=choices()[field.name])
        if with_defaults:
            options.update(default=field.default)
        parser.add_argument(flag_name(field), *(aliases or {}).get(field.name, ()), **options)


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields set by flags (None: not given)."""
    return {f.name: getattr(args, f.name, None) for f in flag_fields()}
