"""Shard lists as WebDataset users write them: brace notation (`imagenet-train-{0000..1023}.tar`),
globs (`shards/*.tar`, `s3://b/x/train-*.tar`: `*` and `?` inside one folder, `**` across
folders), a folder or bucket prefix (every `.tar` under it), or `pipe:` templates; each name
goes through the one scheme table (raywds.data.stores).

    >>> expand(["https://host/imagenet-train-{000000..000002}.tar"])  # doctest: +NORMALIZE_WHITESPACE
    ['https://host/imagenet-train-000000.tar', 'https://host/imagenet-train-000001.tar',
     'https://host/imagenet-train-000002.tar']
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Sequence

import braceexpand

from raywds.data.columns import SEGMENTED
from raywds.data.stores import GS, LOCAL, PIPE, S3, Storage, local_path, scheme
from raywds.errors import DataError

SHARD_SUFFIX = ".tar"
SPLIT_NAMES = {"train": ("train",), "val": ("validation", "val", "valid", "test")}
"""Shard names that say their split, when --train and --val are not given."""
_GLOB = re.compile(r"[*?\[]")


def expand(specs: Iterable[str], storage: Storage = Storage()) -> list[str]:
    """Shard locations from shard lists as WebDataset users write them: brace notation, globs,
    folders and bucket prefixes (their `.tar` files, sorted), `pipe:` templates. DataError when a
    spec names no shard."""
    found: list[str] = []
    for spec in specs:
        before = len(found)
        for one in _braces(spec):
            kind = scheme(one)
            if kind == PIPE or (not _GLOB.search(one) and one.endswith(SHARD_SUFFIX)):
                found.append(one)
            elif _GLOB.search(one):
                found.extend(_globbed(one, kind, storage))
            else:
                found.extend(url for url, _, _ in storage.listing(one) if url.endswith(SHARD_SUFFIX))
        if len(found) == before:
            raise NoShards(f"{spec}: names no shard (no .tar file there); check the path, the braces or the prefix")
    return found


class NoShards(DataError):
    """A shard list that names no shard."""


def _braces(spec: str) -> Iterable[str]:
    try:
        return braceexpand.braceexpand(spec)  # parses the whole spec at once: refuses it here or never
    except ValueError:  # braceexpand.UnbalancedBracesError, the one it raises
        raise DataError(
            f"{spec}: unbalanced braces; close each {{ with }} (e.g. train-{{000000..000099}}.tar)"
        ) from None


def _globbed(pattern: str, kind: str, storage: Storage) -> list[str]:
    if kind == LOCAL:
        return sorted(glob.glob(local_path(pattern), recursive=True))
    if kind in (S3, GS):
        head = pattern[: _GLOB.search(pattern).start()]  # type: ignore[union-attr]
        matches = folder_glob(pattern).fullmatch
        return [url for url, _, _ in storage.listing(head) if matches(url)]
    raise DataError(f"{pattern}: a glob needs a folder or a bucket to list; over {kind} name shards in brace notation")


def folder_glob(pattern: str) -> re.Pattern[str]:
    """A glob over object names as a local glob (and gsutil) reads it: `*` and `?` stay inside one
    folder, `**` spans folders, `[...]` is a set."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1 : end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    try:
        return re.compile("".join(out))
    except re.error as e:
        raise DataError(f"{pattern}: not a glob ({e}); check its [...] sets") from None


def split_by_name(urls: Sequence[str]) -> dict[str, list[str]]:
    """Shards sorted into train and val by their names (`*train*`, `*val*`, `*validation*`)."""
    found: dict[str, list[str]] = {}
    for url in urls:
        name = url.rsplit("/", 1)[-1].lower()
        for split, words in SPLIT_NAMES.items():
            if any(re.search(rf"(^|[^a-z]){w}([^a-z]|$)", name) for w in words):
                found.setdefault(split, []).append(url)
                break
        else:
            found.setdefault("train", []).append(url)
    return found


def common_base(urls: Sequence[str]) -> tuple[str, list[str]]:
    """(base, names) such that each URL is manifest.shard_url(base, name): the folder the shards
    share, or for `pipe:` commands a template with `{}` where their names go."""
    prefix = os.path.commonprefix(list(urls))
    suffix = os.path.commonprefix([u[::-1] for u in urls])[::-1] if scheme(urls[0]) == PIPE else ""
    cut = prefix.rfind("/") + 1
    if cut == 0:
        raise DataError(f"shards {urls[0]} … share no folder: index them in groups, one folder each")
    tail = suffix[suffix.find(SHARD_SUFFIX) + len(SHARD_SUFFIX) :] if SHARD_SUFFIX in suffix else ""
    names = [u[cut : len(u) - len(tail)] for u in urls]
    bad = next((n for n in names if not SEGMENTED.fullmatch(n)), None)
    if bad is not None:
        raise DataError(f"shard name {bad!r} is not a plain file name (letters, digits, . _ + -, folders with /)")
    base = prefix[:cut]
    if scheme(base) == PIPE:
        return f"{base}{{}}{tail}", names
    return (base.rstrip("/") or "/"), names


SHARD_SUFFIX = ".tar"


def splits_of(
    shards: list[str] | None, train: list[str] | None, val: list[str] | None, storage: Storage = Storage()
) -> dict[str, list[str]]:
    """`raywds index`'s shards by split: --train and --val as given, else SHARDS split by name."""
    if train:
        splits = {"train": expand(train, storage)}
        return splits | ({"val": expand(val, storage)} if val else {})
    if shards:
        return split_by_name(expand(shards, storage))
    raise DataError("index needs SHARDS (or --train SHARDS [--val SHARDS])")
