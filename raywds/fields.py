"""How a documented dataclass field becomes a command-line flag where it takes more than its type
says: `field(metadata=flag(...))`. The flag is always `--` and the field's name with dashes (one
name per setting: the flag, the config file and config.json say the same word).
raywds.flags makes every command's flags from such dataclasses; the field's docstring is the
flag's help, its default the flag's default, a Literal type its choices.

    epochs: int = 3                                                    # --epochs, then the field's docstring
    src: str = field(metadata=flag(positional=True))                  # `raywds convert SRC ...`
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def flag(
    *,
    positional: bool = False,
    nargs: str | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    append: bool = False,
    choices: Sequence[str] | None = None,
    exclusive: str | None = None,
) -> dict[str, Any]:
    """The field as a `positional` argument (with
    `nargs`); `parse` turns its text into the value (default: the field's type); `append` collects
    each use into a list; `choices` where they are not the field's Literal type; fields with the
    same `exclusive` name cannot be given together."""
    how = {
        "positional": positional,
        "nargs": nargs,
        "parse": parse,
        "metavar": metavar,
        "append": append,
        "choices": tuple(choices) if choices is not None else None,
        "exclusive": exclusive,
    }
    return {k: v for k, v in how.items() if v not in (None, False)}
