"""Every value of every flag of every command is checked where it is parsed: out of range, zero,
negative, absurd, not a number, empty or malformed, each is one line (`raywds: error: ...`, exit
code 2 or 1, no traceback) naming the flag and the value, before the command starts anything: no
run folder, no Ray, no server.

The walk enumerates the flags from the parser and the fields they are made from, so a new flag is
walked too, and fails here until its field declares what it takes (raywds.fields: a number's
range, a text's form, a word's choices) or is listed below as free-form, with the reason. It runs
`raywds.cli.main` in this process with each command swapped for one that only records that it was
reached: an accepted value can never start a run, a Ray cluster or a server from here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from raywds.cli import main as cli
from raywds.cli.flags import flag_fields
from raywds.cli.options import COMMAND_FLAGS, MainOptions
from raywds.data.shardlists import expand, folder_glob
from raywds.errors import DataError
from raywds.fields import FORMS, TEXT, Range, check_values, hints, kinds
from raywds.train.config import TrainConfig

FREE_FORM = {
    "model": "a model source's name: the sources' tables are asked before any work (an unknown one is one line)",
    "image": "a Docker image reference, which Docker reads (and says which it cannot pull)",
    "label_field": "any key of the samples' JSON member",
    "names": "shard names as they are given, folded into brace notation as text",
}
"""Text flags that take any one line (every text refuses '' and line breaks), with the reason."""
MALFORMED = {
    "text": [],
    "path": ["a\nb"],
    "place": ["http://[::1/x", "s3://", "http://host:99999/x"],
    "url": ["localhost:9000", "http://[::1", "ftp://host", "http://host:port"],
    "host": ["a b", "host:80", "x/y"],
    "address": ["host:99999", "ray://", "a b", "host", "host:x"],
    "name": ["a/b", "x y", ".."],
    "shards": ["train-{000000..", "train-{0..9}}.tar", "http://[::1/x.tar"],
    "pair": ["160", "a:b", "nan:1", "1:inf", "1:2:3"],
    "rgb": ["0.5,0.5", "a,b,c", "0.5,0.5,2", "nan,0,0"],
}
"""Texts each form must refuse, besides '' and a line break, which every text refuses."""
PARSED = {
    "worker_count": ["0", "-1", "3..2", "1..", "x", "", "0..4", "1000000", "1000000000000"],
    "resource": ["x=0", "x=-1", "x=nan", "x=inf", "=1", "x", "", "x=1e12"],
}
"""Texts each flag with a parser of its own must refuse."""


@dataclasses.dataclass(frozen=True)
class Flag:
    command: str
    action: argparse.Action
    cls: type
    field: dataclasses.Field[Any]

    @property
    def name(self) -> str:
        """As the message says it: `--epochs`, or a positional's name."""
        return self.action.option_strings[0] if self.action.option_strings else self.action.dest

    def argv(self, value: str, base: list[str]) -> list[str]:
        """`base` with this flag given `value`: `--epochs=VALUE` (so `-inf` is a value, not a flag;
        the top level's before the command), or a positional in the place of its own (`<NAME>`)."""
        if not self.action.option_strings:
            at = f"<{self.action.dest}>"
            return [value if b == at else b for b in base] if at in base else [*base, value]
        given = f"{self.name}={value}"
        return [given, *base] if self.command == "raywds" else [*base, given]


def bases(tmp: Path) -> dict[str, list[str]]:
    """Each command with what it needs to parse (paths under `tmp`, none of which exist), its
    positionals as `<NAME>`: the one walked takes that place, the others stay as they are."""
    data = str(tmp / "shards")
    return {
        "raywds": ["demo", "--out", str(tmp / "demo")],
        "demo": ["demo", "--out", str(tmp / "demo")],
        "convert": ["convert", "<src>", "<out>"],
        "verify": ["verify", "<shards>"],
        "index": ["index", "--out", str(tmp / "index")],
        "audit": ["audit", "<audit_dir>", "--data", data],
        "shardsum": ["shardsum", "a-000000.tar"],
        "serve": ["serve", "<shards>"],
        "plan": ["plan", "--num-shards", "8", "--samples-per-shard", "16"],
        "report": ["report", "<run_dir>"],
        "doctor": ["doctor", "<run_dir>"],
        "train": ["train", "--data", data, "--out", str(tmp / "run")],
        "ray": ["ray", "--data", data, "--storage-path", str(tmp / "ray")],
        "export": ["export", "<model>", "--out", str(tmp / "export")],
        "evaluate": ["evaluate", "<model>", "--data", data],
        "predict": ["predict", "<model>", "--data", data, "--out", str(tmp / "predict")],
    }


def every_flag() -> Iterator[Flag]:
    """Every flag and positional of every command (the top level's as `raywds`), with the field it
    is made from (raywds.cli.options.COMMAND_FLAGS, raywds.cli.flags)."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    groups = [("raywds", parser, [(MainOptions, flag_fields(MainOptions))])]
    for command, (_, parts) in COMMAND_FLAGS.items():
        made = [(p.cls, flag_fields(p.cls, skip=p.skip, only=p.only)) for p in parts]
        groups.append((command, sub.choices[command], made))
    for command, each, made in groups:
        by_dest = {f.name: (cls, f) for cls, fs in made for f in fs}
        for action in each._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            cls, field = by_dest[action.dest]  # every flag is a field's
            yield Flag(command, action, cls, field)


def _outside(bounds: Range, x: float) -> bool:
    """Written out here, not asked of Range: which numbers the declared range leaves out."""
    return not (
        (bounds.minimum is None or x >= bounds.minimum)
        and (bounds.above is None or x > bounds.above)
        and (bounds.maximum is None or x <= bounds.maximum)
        and (bounds.below is None or x < bounds.below)
    )


def _text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e18 else repr(float(x))


def bad_values(flag: Flag) -> tuple[list[str], str | None]:
    """The texts `flag` must refuse, or why none can be made: what its field declares it takes."""
    how, action = flag.field.metadata, flag.action
    if action.nargs == 0:
        return ["x"], None  # a switch given a value
    if action.choices is not None:
        return ["", "x", "-1", "nan"], None
    if how.get("parse") is not None:
        name = how["parse"].__name__
        return PARSED.get(name, []), None if name in PARSED else f"parser {name} has no texts in PARSED"
    allowed = [k for h in kinds(hints(flag.cls)[flag.field.name]) for k in (kinds(getattr(h, "__args__", [h])[0]))]
    if int in allowed or float in allowed:
        bounds = how.get("range")
        if bounds is None or (bounds.maximum is None and bounds.below is None):
            return [], "declares no range, or none with an upper end"
        low = bounds.minimum - 1 if bounds.minimum is not None else bounds.above
        high = bounds.maximum + 1 if bounds.maximum is not None else bounds.below
        numbers = [x for x in (low, high, -1, 0, 10**12, 2**63) if x is not None and _outside(bounds, x)]
        words = ["nan", "inf", "-inf", "", "x"] + (["1.5"] if float not in allowed else [])
        return [*dict.fromkeys(_text(x) for x in numbers), *words], None
    form = how.get("form")
    if form is None:
        return [], "declares neither a form nor choices"
    if form is TEXT and flag.field.name not in FREE_FORM:
        return [], "is free-form text (TEXT) but not listed in FREE_FORM with a reason"
    return ["", "a\nb", *MALFORMED[form.name]], None


@pytest.fixture
def run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> Callable[[list[str]], tuple[Any, str, str, bool]]:
    """`raywds ARGV` in this process, each command swapped for one that records it was reached:
    (exit code, stdout, stderr, reached)."""
    reached: list[str] = []
    for name in cli.COMMANDS:
        monkeypatch.setitem(cli.COMMANDS, name, lambda *options, name=name: reached.append(name))
    monkeypatch.chdir(tmp_path)

    def call(argv: list[str]) -> tuple[Any, str, str, bool]:
        reached.clear()
        capsys.readouterr()
        try:
            code: Any = cli.main(argv)
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err, bool(reached)

    return call


def refusal_problem(flag: Flag, value: str, said: tuple[Any, str, str, bool]) -> str | None:
    """What is wrong with how `raywds` answered `flag` given `value`, or None: it must say one line,
    `raywds: error: ...`, naming the flag and the value, exit 2 or 1, and start nothing."""
    code, out, err, reached = said
    lines = err.strip().splitlines()
    shown = "''" if value == "" else value.split("\n")[0]
    if flag.field.metadata.get("parse") is not None:
        shown = ""  # its own parser's number, as parsed, is named: `--num-workers 0 must be at least 1`
    if reached or code not in (1, 2):
        return f"accepted (exit {code}{', the command started' if reached else ''})"
    if len(lines) != 1 or not lines[0].startswith("raywds: error: ") or "Traceback" in err or out:
        return f"not one line: {err!r}"
    if flag.name not in lines[0] or shown not in lines[0]:
        return f"does not name the flag and the value: {lines[0]}"
    return None


def test_every_flag_of_every_command_refuses_what_it_does_not_take_in_one_line(
    run: Callable[[list[str]], tuple[Any, str, str, bool]], tmp_path: Path
) -> None:
    base, walked, failures = bases(tmp_path), 0, []
    flags = list(every_flag())
    assert {f.command for f in flags} == {"raywds", *COMMAND_FLAGS} and len(flags) > 200
    for flag in flags:
        values, undeclared = bad_values(flag)
        if undeclared:
            failures.append(f"raywds {flag.command} {flag.name}: {undeclared}")
        for value in values:
            walked += 1
            said = refusal_problem(flag, value, run(flag.argv(value, base[flag.command])))
            if said is not None:
                failures.append(f"raywds {flag.command} {flag.name} {value!r}: {said}")
    assert failures == []
    assert walked > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing was written, no --out folder made"


def test_each_declaration_admits_its_ends_and_its_default() -> None:
    """The ranges are not stricter than they say: each closed end and each default is taken."""
    for flag in every_flag():
        how = flag.field.metadata
        if flag.field.default is not dataclasses.MISSING:
            check_values(flag.cls, {flag.field.name: flag.field.default}, flags=True)
        bounds = how.get("range")
        for end in (bounds.minimum, bounds.maximum) if bounds is not None else ():
            if end is not None and how.get("parse") is None:
                check_values(flag.cls, {flag.field.name: type(flag.field.default or 0)(end)}, flags=True)


def test_every_form_and_parser_has_malformed_texts_to_walk() -> None:
    assert sorted(MALFORMED) == sorted(f.name for f in FORMS)
    used = {f.field.name for f in every_flag() if f.field.metadata.get("form") is TEXT}
    assert sorted(used) == sorted(FREE_FORM), "FREE_FORM lists exactly the free-form flags"


# --- The values users met, through the real commands -------------------------------------------


@pytest.fixture
def real(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """`raywds ARGS` through the real commands (never `ray`); its one stderr line, which must be a
    refusal (exit 1 or 2) that made no run folder."""
    monkeypatch.chdir(tmp_path)

    def call(*args: str) -> str:
        capsys.readouterr()
        try:
            code: Any = cli.main(list(args))
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        assert code in (1, 2) and out == "" and "Traceback" not in err, (code, out, err)
        assert not (tmp_path / "run").exists(), "no run folder"
        (line,) = err.strip().splitlines()
        return line

    return call


def test_the_augmentations_out_of_range_are_one_line_before_training(real: Callable[..., str], shards: Path) -> None:
    """--ra-magnitude 40 and --augmix-severity 0 or 11 were taken; every sample then failed in the
    loader. -3 was taken silently (torchvision indexed its 31 magnitude bins from the end)."""
    train = ["train", "--data", str(shards), "--out", "run", "--model", "demo", "--epochs", "1"]
    for flag, value, said in [
        ("--ra-magnitude", "40", "must be at most 30 (from 0 to 30)"),
        ("--ra-magnitude", "-3", "must be at least 0 (from 0 to 30)"),
        ("--augmix-severity", "0", "must be at least 1 (from 1 to 10)"),
        ("--augmix-severity", "11", "must be at most 10 (from 1 to 10)"),
    ]:
        assert real(*train, "--auto-augment", "ra", flag, value) == f"raywds: error: {flag} {value} {said}"


def test_a_global_batch_below_one_says_so(real: Callable[..., str], shards: Path) -> None:
    train = ["train", "--data", str(shards), "--out", "run", "--model", "demo"]
    for value in ("0", "-32"):
        said = real(*train, "--batch-size", "16", "--global-batch", value)
        assert said == f"raywds: error: --global-batch {value} must be at least 1 (from 1 to 16777216)"
    said = real(*train, "--batch-size", "16", "--global-batch", "24")
    assert said == "raywds: error: --global-batch 24 must be a multiple of --batch-size 16"


def test_a_crop_too_small_for_the_model_says_the_smallest_it_takes(real: Callable[..., str], shards: Path) -> None:
    """The demo network pools 2x2 three times: 8 px at least (a 1 px crop was a 73-line traceback).
    A ResNet takes 1 px in a batch of two, but alone in training 33 px (its last BatchNorm needs
    two values a channel)."""
    train = ["train", "--data", str(shards), "--out", "run", "--model", "demo"]
    assert real(*train, "--train-crop-size", "1") == (
        "raywds: error: --train-crop-size 1 is too small for --model demo: it takes 8 px or more in training "
        "(a batch of 2); give --train-crop-size 8 or more"
    )
    assert real(*train, "--val-crop-size", "7", "--val-resize-size", "8") == (
        "raywds: error: --val-crop-size 7 is too small for --model demo: it takes 8 px or more in validation; "
        "give --val-crop-size 8 or more"
    )
    assert real(*train, "--image-size", "4").startswith("raywds: error: --image-size 4 is too small")
    assert (
        real(*train, "--train-crop-size", "0")
        == "raywds: error: --train-crop-size 0 must be at least 1 (from 1 to 8192)"
    )
    resnet = ["train", "--data", str(shards), "--out", "run", "--model", "resnet18", "--batch-size", "1"]
    assert real(*resnet, "--train-crop-size", "32") == (
        "raywds: error: --train-crop-size 32 is too small for --model resnet18: it takes 33 px or more in "
        "training (a batch of 1); give --train-crop-size 33 or more"
    )
    taken = cli.command_options(cli.build_parser().parse_args([*train, "--train-crop-size", "8", "--image-size", "8"]))
    assert taken[1].given["train_crop_size"] == 8, "8 px is taken: the bound is the smallest that works"


def test_a_malformed_brace_list_is_one_line(real: Callable[..., str], tmp_path: Path) -> None:
    """A brace list left open was braceexpand's 39-line UnbalancedBracesError traceback."""
    said = "has unbalanced braces: close each { with } (e.g. train-{000000..000099}.tar)"
    assert (
        real("train", "--data", "train-{000000..", "--out", "run") == f"raywds: error: --data 'train-{{000000..' {said}"
    )
    assert real("index", "--train", "train-{000000..") == f"raywds: error: --train 'train-{{000000..' {said}"
    assert real("index", "train-{000000..") == f"raywds: error: shards 'train-{{000000..' {said}"
    with pytest.raises(DataError, match=r"^train-\{000000\.\.: unbalanced braces; close each \{ with \}"):
        expand(["train-{000000.."])
    with pytest.raises(DataError, match=r"s3://b/x\[z-a\]\.tar: not a glob \(bad character range z-a"):
        folder_glob("s3://b/x[z-a].tar")


def test_a_config_files_values_are_checked_as_the_flags_are(real: Callable[..., str], tmp_path: Path) -> None:
    """A string where a number goes was a TypeError traceback from the config's own checks."""
    for values, said in [
        ({"train": {"epochs": "3"}}, "epochs='3' must be a whole number"),
        ({"loader": {"ra_magnitude": 40}}, "ra_magnitude=40 must be at most 30 (from 0 to 30)"),
        ({"train": {"lr": math.inf}}, "lr=inf must lie in (0, 100]"),
        ({"run": {"out": ""}}, "out='' is empty: give a path"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(values))
        assert real("train", "--data", "shards", "--config", "config.json") == f"raywds: error: {said}"
    assert TrainConfig(data="x", loader_workers="auto").loader_workers == "auto"


def test_a_place_takes_a_file_url_without_a_host_and_refuses_a_bucket_url_without_a_bucket() -> None:
    """`file:///path` is how Ray Train names a local storage path (--storage-path); `s3://` names nothing."""
    from raywds.fields import PLACE

    assert PLACE.problem("file:///tmp/runs") is None and PLACE.problem("s3://bucket/runs") is None
    assert PLACE.problem("s3:///runs") == "names no host or bucket after s3://"
