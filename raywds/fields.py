"""How a documented dataclass field becomes a command-line flag: `field(metadata=flag(...))`
where the flag is not `--` and the field name with dashes, or takes more than its type says.
raywds.flags makes every command's flags from such dataclasses; the field's docstring is the
flag's help, its default the flag's default, a Literal type its choices.

    epochs: int = field(default=3, metadata=flag("--epochs"))     # then the field's docstring
    src: str = field(metadata=flag(positional=True))                  # `raywds convert SRC ...`
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def flag(
    name: str | None = None,
    *,
    positional: bool = False,
    nargs: str | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    append: bool = False,
    choices: Sequence[str] | None = None,
    exclusive: str | None = None,
) -> dict[str, Any]:
    """The field's flag `name` (default `--field-name`), or a `positional` argument (with
    `nargs`); `parse` turns its text into the value (default: the field's type); `append` collects
    each use into a list; `choices` where they are not the field's Literal type; fields with the
    same `exclusive` name cannot be given together."""
    how = {
        "flag": name,
        "positional": positional,
        "nargs": nargs,
        "parse": parse,
        "metavar": metavar,
        "append": append,
        "choices": tuple(choices) if choices is not None else None,
        "exclusive": exclusive,
    }
    return {k: v for k, v in how.items() if v not in (None, False)}
