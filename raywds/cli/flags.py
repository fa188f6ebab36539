"""Every command's flags, made from documented dataclasses (TrainConfig, ConvertOptions, the
options in raywds.cli.options and raywds.launch.rayoptions): one flag per field, its help the field's
docstring, its default the field's default, its choices the field's Literal type. A flag is `--`
and the field name with dashes, unless the field says otherwise (raywds.fields.flag). A field
without a default is a required flag or positional.

    add_flags(parser, ServeOptions)                      # each flag's default the field's
    add_flags(parser, TrainConfig, with_defaults=False)  # each None unless given (given(args, TrainConfig))
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

from raywds.fields import hints


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), base classes' too."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body  # type: ignore[attr-defined]
        for node, after in zip(body, body[1:]):
            documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            if isinstance(node, ast.AnnAssign) and documented:
                docs[node.target.id] = " ".join(str(after.value.value).split())  # type: ignore[union-attr]
    return docs


def _value_type(cls: type, field: dataclasses.Field[Any]) -> Any:
    """The field's type without None: a number or a word for `int | Literal[...]`."""
    hint = hints(cls)[field.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        words = [w for a in kinds if typing.get_origin(a) is typing.Literal for w in typing.get_args(a)]
        if words and int in kinds:
            return _int_or(tuple(words))
        hint = kinds[0]
    if typing.get_origin(hint) is list:  # nargs or append: each value's type
        (hint,) = typing.get_args(hint)
    return hint


def _int_or(words: tuple[str, ...]) -> Any:
    """A flag's parser for a whole number or one of `words` (`--loader-workers auto`)."""

    def parse(text: str) -> int | str:
        return text if text in words else int(text)

    parse.__name__ = "number or " + "|".join(words)  # argparse names it: "invalid number or auto value"
    return parse


def _not_empty(kind: Any) -> Any:
    """A text flag's parser that refuses '' before `kind` sees it (Path('') would be '.')."""

    def parse(text: str) -> Any:
        if not text:
            raise argparse.ArgumentTypeError("'' is empty: give a value")
        return kind(text)

    parse.__name__ = kind.__name__
    return parse


def flag_fields(
    cls: type, *, skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None
) -> list[dataclasses.Field[Any]]:
    """The fields of `cls` that are flags (those in `only`, but `skip`, and none that is set otherwise)."""
    return [
        f
        for f in dataclasses.fields(cls)
        if not f.metadata.get("set_otherwise") and f.name not in skip and (only is None or f.name in only)
    ]


def flag_name(field: dataclasses.Field[Any]) -> str:
    return "--" + field.name.replace("_", "-")


def _has_default(field: dataclasses.Field[Any]) -> bool:
    return field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING


def _help(cls: type, field: dataclasses.Field[Any]) -> str:
    text = field_docs(cls).get(field.name, "")
    bounds = field.metadata.get("range")
    said = [str(bounds) if bounds.closed else f"in {bounds}"] if bounds is not None else []
    if _has_default(field) and field.default is not None and field.default is not False:
        said.insert(0, f"default {field.default}")  # None and False say nothing
    return f"{text} ({'; '.join(said)})" if said else text


def _options(cls: type, field: dataclasses.Field[Any], with_defaults: bool) -> dict[str, Any]:
    """add_argument's keywords for the field, but its name."""
    how, hint = field.metadata, _value_type(cls, field)
    options: dict[str, Any] = {"help": _help(cls, field)}
    if not how.get("positional"):
        options["dest"] = field.name
    if hint is bool:  # None unless given, where the config underneath keeps its value
        options.update({"action": "store_true"} if with_defaults else {"action": "store_const", "const": True})
    else:
        parse = how.get("parse") or (str if typing.get_origin(hint) is typing.Literal else hint)
        if parse is hint and hint not in (int, float):
            parse = _not_empty(parse)
        options.update(type=parse, action="append" if how.get("append") else "store")
    choices = how.get("choices") or (typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None)
    if choices:
        options["choices"] = list(choices)
    options.update({key: how[key] for key in ("nargs", "metavar") if key in how})
    if not _has_default(field):
        options.update({} if how.get("positional") else {"required": True})
    elif with_defaults and not (how.get("positional") and field.default is None):
        options["default"] = field.default
    return options


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    skip: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
    with_defaults: bool = True,
    aliases: dict[str, tuple[str, ...]] | None = None,
) -> None:
    """One flag (or positional) per field of the dataclass `cls` (those in `only`, but `skip`),
    each the field's default, or unless `with_defaults` None until given."""
    groups: dict[str, Any] = {}
    for field in flag_fields(cls, skip=skip, only=only):
        exclusive = field.metadata.get("exclusive")
        if exclusive and exclusive not in groups:
            groups[exclusive] = parser.add_mutually_exclusive_group()
        target = groups[exclusive] if exclusive else parser
        names = [field.name] if field.metadata.get("positional") else [flag_name(field)]
        target.add_argument(*names, *(aliases or {}).get(field.name, ()), **_options(cls, field, with_defaults))


def values(
    args: argparse.Namespace, cls: type, *, skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """The fields of `cls` (those in `only`, but `skip`) as the parsed flags hold them: the
    keywords of the typed options a command takes (raywds.cli.main.command_options)."""
    return {f.name: getattr(args, f.name) for f in flag_fields(cls, skip=skip, only=only)}


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` (the training config: raywds.resolve's keywords) set by flags, None where not given."""
    return {f.name: getattr(args, f.name, None) for f in flag_fields(cls)}


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusals are one line as raywds's own are (exit code 2):
    `raywds: error: argument --epochs: invalid int value: 'x' (see raywds train --help)`."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"raywds: error: {message} (see {self.prog} --help)\n")
