"""How a documented dataclass field becomes a command-line flag where it takes more than its type
says, and which values it takes: `field(metadata=flag(...))`. The flag is always `--` and the
field's name with dashes (one name per setting: the flag, the config file and config.json say the
same word). raywds.cli.flags makes every command's flags from such dataclasses; the field's docstring
is the flag's help, its default the flag's default, a Literal type its choices.

Every value a field takes is declared here, where the field is: a number's range (`minimum`,
`maximum`, or `above`/`below` for open ends), a text's form (a path, a URL, a brace list of
shards...), a word's choices. `problem` checks a value against its field's declaration, in one
place for every flag of every command (raywds.cli.options.Flags.build, before a command starts) and
for every section of a config (check_fields, below: for values from a file or from Python).

    epochs: int = field(default=3, metadata=flag(minimum=1, maximum=100_000))   # --epochs 0: one line, its range
    src: str = field(metadata=flag(positional=True, form=PLACE))              # `raywds convert SRC ...`
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import math
import re
import types
import typing
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raywds.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """The numbers a setting takes: from `minimum` (or above `above`) to `maximum` (or below `below`)."""

    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None
    below: float | None = None

    @property
    def closed(self) -> bool:
        return self.above is None and self.below is None

    def __str__(self) -> str:
        """`from 1 to 65536`, or with an open end `(0, 1]`."""
        if self.closed:
            return f"from {number(self.minimum)} to {number(self.maximum)}"
        low = f"({number(self.above)}" if self.above is not None else f"[{number(self.minimum)}"
        high = f"{number(self.below)})" if self.below is not None else f"{number(self.maximum)}]"
        return f"{low}, {high}"

    def problem(self, value: float) -> str | None:
        """What is wrong with the number `value`, or None."""
        low_ok = (self.minimum is None or value >= self.minimum) and (self.above is None or value > self.above)
        high_ok = (self.maximum is None or value <= self.maximum) and (self.below is None or value < self.below)
        if low_ok and high_ok:
            return None
        if not self.closed:
            return f"must lie in {self}"
        if math.isnan(value):
            return f"is not a number: give one {self}"
        return (
            f"must be at least {number(self.minimum)} ({self})"
            if not low_ok
            else f"must be at most {number(self.maximum)} ({self})"
        )


def number(x: float | None) -> str:
    """A bound as a person writes it: 1, 0.5, 1e-06."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:g}"


def _nothing_more(text: str) -> str | None:
    return None


@dataclass(frozen=True)
class Form:
    """What a text setting holds: `what` names it in a message; `more` says what is wrong with a
    text beyond what every text is refused for (empty, or more than one line), or None."""

    name: str
    what: str
    more: Callable[[str], str | None] = _nothing_more

    def problem(self, text: str) -> str | None:
        if not text:
            return f"is empty: give {self.what}"
        if "\n" in text or "\0" in text:
            return f"holds a line break or a NUL: give {self.what} on one line"
        return self.more(text)


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_NAME = re.compile(r"^[A-Za-z0-9_+-][A-Za-z0-9_.+-]*$")


def _url_problem(text: str) -> str | None:
    """Each `scheme://` location in `text` (several are comma-separated) as urllib parses it."""
    for part in text.split(","):
        if _URL.match(part) is None:
            continue
        try:
            parts = urllib.parse.urlsplit(part)
            _ = parts.port  # a port that is not a number from 0 to 65535 raises here
        except ValueError as e:
            return f"does not parse as a URL ({e})"
        if not parts.netloc and parts.scheme != "file":  # file:///path names no host, as it should
            return f"names no host or bucket after {parts.scheme}://"
    return None


def _http_problem(text: str) -> str | None:
    if not text.startswith(("http://", "https://")):
        return "is not an http(s) URL: give one such as http://127.0.0.1:9000"
    return _url_problem(text)


def _host_problem(text: str) -> str | None:
    if ":" in text:
        try:
            ipaddress.IPv6Address(text)
        except ValueError:
            return "is not a host name or IP address (give the port with its own flag)"
        return None
    return None if _HOST_NAME.match(text) else "is not a host name or IP address"


def _address_problem(text: str) -> str | None:
    if text in ("auto", "local"):
        return None
    host, colon, port = text.removeprefix("ray://").rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:6379
    if not colon or not port.isdigit() or not 0 < int(port) < 65536 or _host_problem(host):
        return "is not a Ray address: give auto, HOST:PORT or ray://HOST:PORT (a port from 1 to 65535)"
    return None


def _name_problem(text: str) -> str | None:
    return None if _NAME.match(text) else "must be letters, digits and . _ + - (no / or spaces)"


def _shards_problem(text: str) -> str | None:
    import braceexpand  # here: only where a brace list is checked

    try:
        braceexpand.braceexpand(text)
    except ValueError:  # braceexpand.UnbalancedBracesError, the one it raises
        return "has unbalanced braces: close each { with } (e.g. train-{000000..000099}.tar)"
    return _url_problem(text)


def _pair_problem(text: str) -> str | None:
    a, colon, b = text.partition(":")
    try:
        if colon and all(math.isfinite(float(x)) for x in (a, b)):
            return None
    except ValueError:
        pass
    return "must be two numbers as A:B"


def _rgb_problem(text: str) -> str | None:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if len(values) == 3 and all(0 <= v <= 1 for v in values):
        return None
    return "must be three numbers R,G,B from 0 to 1 (e.g. 0.485,0.456,0.406)"


MAX_SEED = 2**63 - 1
"""Seeds are 0 to this: torch.manual_seed takes them all (every command's --seed)."""
MAX_STEPS = 10**9
"""The most steps or batches a setting counts."""
MAX_EPOCHS = 100_000
"""The most epochs a setting counts."""
MAX_SECONDS = 10**6
"""The longest timeout a setting takes (11.6 days)."""

TEXT = Form("text", "some text")
"""Free-form: any one line (raywds hands it to what reads it, which says what is wrong)."""
PATH = Form("path", "a path")
PLACE = Form("place", "a path or a URL", _url_problem)
URL = Form("url", "an http(s) URL", _http_problem)
HOST = Form("host", "a host name or IP address", _host_problem)
ADDRESS = Form("address", "a Ray address (auto, HOST:PORT or ray://HOST:PORT)", _address_problem)
NAME = Form("name", "a name of letters, digits and . _ + -", _name_problem)
SHARDS = Form("shards", "shards (a folder, manifest.json, a URL, a brace list or a glob)", _shards_problem)
PAIR = Form("pair", "two numbers as A:B", _pair_problem)
RGB = Form("rgb", "three numbers R,G,B", _rgb_problem)
FORMS = (TEXT, PATH, PLACE, URL, HOST, ADDRESS, NAME, SHARDS, PAIR, RGB)
"""Every form a text setting may declare."""


def flag(
    *,
    positional: bool = False,
    nargs: str | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    append: bool = False,
    choices: Sequence[str] | None = None,
    exclusive: str | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    below: float | None = None,
    form: Form | None = None,
    set_otherwise: bool = False,
) -> dict[str, Any]:
    """The field as a `positional` argument (with
    `nargs`); `parse` turns its text into the value (default: the field's type); `append` collects
    each use into a list; `choices` where they are not the field's Literal type; fields with the
    same `exclusive` name cannot be given together. A number takes `minimum` to `maximum` (or
    numbers `above` and `below`, open ends); a text has a `form` (each of a list's numbers and
    texts alike). `set_otherwise`: the command sets the field otherwise (a run's --data: a
    positional, --data or --demo), so the dataclass's flags leave it out."""
    bounds = Range(minimum, maximum, above, below)
    how = {
        "positional": positional,
        "nargs": nargs,
        "parse": parse,
        "metavar": metavar,
        "append": append,
        "choices": tuple(choices) if choices is not None else None,
        "exclusive": exclusive,
        "set_otherwise": set_otherwise,
        "range": bounds if bounds != Range() else None,
        "form": form,
    }
    return {k: v for k, v in how.items() if v not in (None, False)}


def kinds(hint: Any) -> tuple[Any, ...]:
    """The types a field's type hint allows: `int | None` -> (int, NoneType)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def problem(hint: Any, how: typing.Mapping[str, Any], value: Any) -> tuple[Any, str] | None:
    """What is wrong with `value` for a field of type `hint` declared `how` (its metadata): its
    type, choices, range or form, checking each item of a list or a tuple; None when nothing is,
    else the value (or the item) at fault and what is wrong with it."""
    allowed = kinds(hint)
    if value is None:
        return None if type(None) in allowed else (value, "must be given")
    words = [w for k in allowed if typing.get_origin(k) is typing.Literal for w in typing.get_args(k)]
    words += list(how.get("choices") or ())
    if (isinstance(value, str) and value in words) or (bool in allowed and isinstance(value, bool)):
        return None
    if isinstance(value, list | tuple):
        return _items(allowed, how, value)
    numbers = [k for k in (int, float) if k in allowed]
    texts = [k for k in allowed if k in (str, Path)]
    if how.get("choices") or (words and not numbers and not texts):
        return value, f"is not one of {', '.join(map(str, words))}"
    if numbers and isinstance(value, int | float) and not isinstance(value, bool):
        if numbers == [int] and not isinstance(value, int):
            return value, "must be a whole number"
        bounds = how.get("range")
        said = bounds.problem(value) if bounds is not None else None
        return (value, said) if said else None
    if texts and isinstance(value, str | Path):
        form = how.get("form")
        said = form.problem(str(value)) if form is not None else None
        return (value, said) if said else None
    if not (numbers or texts or words or bool in allowed):
        return None  # a type no flag has: its own class checks it
    kind = [
        *(["a whole number"] if numbers == [int] else ["a number"] if numbers else []),
        *(["text"] if texts else []),
    ]
    return value, "must be " + " or ".join([*kind, *([f"one of {', '.join(map(str, words))}"] if words else [])])


def _items(
    allowed: tuple[Any, ...], how: typing.Mapping[str, Any], value: list[Any] | tuple[Any, ...]
) -> tuple[Any, str] | None:
    """A list's items each as its item type says; a tuple's by position (`tuple[str, float]`)."""
    hint = next((k for k in allowed if typing.get_origin(k) is type(value)), None)
    if hint is None:
        return value, "must be one value, not a list"
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and Ellipsis not in args:
        if len(args) != len(value):
            return value, f"must be {len(args)} values"
        pairs = list(zip(args, value))
    else:
        pairs = [(args[0], item) for item in value]
    for item_hint, item in pairs:
        said = problem(item_hint, how, item)
        if said is not None:
            return said
    return None


def shown(value: Any) -> str:
    """A value as a message shows it: numbers as they are, texts quoted."""
    return repr(str(value)) if isinstance(value, str | Path) else str(value)


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The dataclass `cls`'s fields' types (typing.get_type_hints, once a class)."""
    return typing.get_type_hints(cls)


def check_values(cls: type, values: dict[str, Any], *, flags: bool = False) -> None:
    """Refuse the first of `values` (fields of the dataclass `cls` by name; None where not given)
    that its field's declaration does not admit (type, choices, range, form), in one line naming
    the setting, the value and what it takes: as the flag says it with `flags`
    (`--ra-magnitude 40 must be at most 30 (from 0 to 30)`), else as the field does (`ra_magnitude=40 ...`)."""
    types_ = hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in values or (flags and values[f.name] is None):
            continue
        found = problem(types_[f.name], f.metadata, values[f.name])
        if found is not None:
            value, said = found
            if not flags:
                raise ConfigError(f"{f.name}={shown(value)} {said}")
            name = f.name if f.metadata.get("positional") else "--" + f.name.replace("_", "-")
            raise ConfigError(f"{name} {shown(value)} {said}")


def check_fields(obj: Any, cls: type | None = None) -> None:
    """check_values for the fields the dataclass `cls` declares (default: all of `obj`'s), as
    `obj` holds them: a section's __post_init__ checks its own fields, on itself or on a config
    that composes it."""
    declared = dataclasses.fields(cls or obj)
    check_values(cls or type(obj), {f.name: getattr(obj, f.name) for f in declared})
