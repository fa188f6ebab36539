"""Manifests, shard URLs and the dealing of shards to (rank, worker) slots.

A shard location is a local directory, a path to its manifest.json, an http(s) URL of
the directory a shard server serves, or an s3:// or gs:// prefix in a bucket (the scheme
table is raywds.data.stores). A manifest written by `raywds index` for shards raywds did not
write says where they are (`shards_at`), which members hold the image and the label, and each
shard's first key, checked when the shard is opened.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import operator
import re
import urllib.error
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raywds.data import columns, stores
from raywds.data.columns import ShardInfo, ShardTable, sample_counts
from raywds.data.members import Members
from raywds.data.stores import Storage, write_atomic
from raywds.errors import DataError

MANIFEST = "manifest.json"
TIMM_INFO = "_info.json"
"""timm's view of the same shards, written beside the manifest."""
FORMAT = "raywds-shards/1"


@dataclass(frozen=True)
class Manifest:
    """What `raywds convert` wrote, plus where the shards live (`base`)."""

    base: str
    classes: list[str]
    splits: dict[str, Sequence[ShardInfo]]
    """Each split's shards: a list, or a ShardTable when read from manifest.npz."""
    kept: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """What `index`, `first_ids` and `fingerprint` made, by split: made once per manifest."""
    members: Members = field(default_factory=lambda: Members())
    """Which members of a sample hold its image and label (raywds's own shards: .jpg and .cls)."""
    first_keys: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Each shard's first sample key, by shard name, where the manifest records it: checked at open."""

    def shards(self, split: str) -> Sequence[ShardInfo]:
        if split not in self.splits or not self.splits[split]:
            raise DataError(f"no {split!r} shards in the manifest at {self.base}; it has {sorted(self.splits)}")
        return self.splits[split]

    def num_samples(self, split: str) -> int:
        shards = self.shards(split)
        return int(shards.samples.sum()) if isinstance(shards, ShardTable) else sum(s.num_samples for s in shards)

    def url(self, shard: ShardInfo) -> str:
        return shard_url(self.base, shard.name)

    def index(self, split: str) -> dict[str, int]:
        """Each shard's place in the split, by name (made once: a rank looks up its own shards)."""
        key = f"index:{split}"
        if key not in self.kept:
            shards = self.shards(split)
            names = shards.name_list() if isinstance(shards, ShardTable) else [s.name for s in shards]
            self.kept[key] = {name: i for i, name in enumerate(names)}
        return self.kept[key]

    def first_ids(self, split: str) -> list[int]:
        """Each shard's first sample id, in manifest order: samples are numbered through the split."""
        key = f"first:{split}"
        if key not in self.kept:
            counts = sample_counts(self.shards(split))
            self.kept[key] = (counts.cumsum() - counts).tolist()
        return self.kept[key]

    def first(self, split: str, count: int) -> Manifest:
        """This manifest with only the first `count` shards of `split`: the dataset as it was
        before an append added shards after them."""
        shards = self.shards(split)[:count]
        return dataclasses.replace(self, splits={**self.splits, split: shards}, kept={})

    def fingerprint(self, split: str) -> str:
        """A short hash of the split's shard names, counts and contents (kept: every checkpoint asks)."""
        key = f"fingerprint:{split}"
        if key not in self.kept:
            h = hashlib.sha256()
            for s in self.shards(split):
                h.update(f"{s.name} {s.num_samples} {s.sha256}\n".encode())
            self.kept[key] = h.hexdigest()[:16]
        return self.kept[key]


SHARD_NAME = columns.SEGMENTED
"""A shard's name in a manifest: a plain file name, or plain names joined by `/` (shards in
sub-folders of the manifest's base), neither `..` nor shell text (see shard_url)."""


def is_url(location: str) -> bool:
    """A location that is not a local path: http(s), s3 or gs (raywds.data.stores)."""
    return stores.is_url(location)


def shard_url(base: str, name: str) -> str:
    """The address of shard `name` under `base`: a directory, an http(s) URL, or a template in
    which `{}` stands for the name (e.g. `pipe:aws s3 cp s3://bucket/shards/{} -`). An http(s)
    or s3 `base` may list several places that hold the same shards, comma-separated: each
    shard is always read from the same one (by a hash of its name), so they share the load."""
    if "," in base and is_url(base):
        servers = [b.strip() for b in base.split(",") if b.strip()]
        base = servers[int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "big") % len(servers)]
    if "{}" in base:
        return base.replace("{}", name)
    return stores.join(base, name)


def split_location(data: str) -> tuple[str, str]:
    """(base, manifest location) for a directory, a manifest path, or a URL."""
    if stores.scheme(data) == stores.PIPE:
        raise DataError(f"{data}: a pipe: command names shards, not a manifest; give it to `raywds index` or --data")
    if is_url(data):
        if data.endswith(".json"):
            return data.rsplit("/", 1)[0], data
        return data.rstrip("/"), data.rstrip("/") + "/" + MANIFEST
    path = Path(stores.local_path(data))
    if path.suffix == ".json":
        return str(path.parent), str(path)
    return str(path), str(path / MANIFEST)


def read_manifest(
    data: str,
    timeout_s: float = 30.0,
    *,
    shards_at: str | None = None,
    storage: Storage = Storage(),
    use_columns: bool = True,
) -> Manifest:
    """Load the manifest for the shards at `data` (directory, manifest path, URL or s3:// prefix);
    with `shards_at` the shards live there instead of beside the manifest (see shard_url). The
    columns beside it (`manifest.npz`, raywds.data.columns) are read instead of the JSON while
    they were made from a JSON of the size the JSON has (unless `use_columns` is False)."""
    base, where = split_location(data)
    try:
        found = _read_columns(where, timeout_s, storage) if use_columns else None
        if found is None:
            raw = json.loads(storage.read(where, timeout_s))
            _check_format(raw, where)
            splits: dict[str, Sequence[ShardInfo]] = {
                split: [ShardInfo(**shard) for shard in info["shards"]] for split, info in raw["splits"].items()
            }
        else:
            raw, splits = found
    except FileNotFoundError:
        raise DataError(
            f"no manifest at {where}: run `raywds convert SRC {base}` for an image tree, or `raywds index` "
            "for WebDataset shards (or give --data the shards themselves), or check --data"
        ) from None
    except (urllib.error.URLError, OSError) as e:
        raise DataError(f"cannot read manifest {where}: {e}; is the shard server running?") from None
    except json.JSONDecodeError as e:
        raise DataError(f"manifest {where} is not valid JSON ({e}); rerun `raywds convert`") from None
    _check_format(raw, where)
    bad = next((name for shards in splits.values() for name in _odd_names(shards)), None)
    if bad is not None:
        raise DataError(
            f"manifest {where} names a shard {bad!r}: a shard's name is a plain file name (letters, "
            "digits, . _ + -, no leading dot), so that it stays in its folder and out of a --shards-at command"
        )
    base = shards_at or raw.get("shards_at") or base
    first_keys = {name: key for info in raw["splits"].values() for name, key in info.get("first_keys", {}).items()}
    members = Members.of(raw.get("members"))
    return Manifest(base=base, classes=list(raw["classes"]), splits=splits, members=members, first_keys=first_keys)


def _check_format(raw: Any, where: str) -> None:
    """A manifest another tool wrote (a `manifest.json` is a common name) is one line, not a KeyError."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        made = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise DataError(
            f"{where} is not a raywds manifest (format {made!r}, expected {FORMAT!r}): another tool wrote it; "
            "`raywds index SHARDS --out DIR` writes one for these shards in DIR"
        )


def _odd_names(shards: Sequence[ShardInfo]) -> Iterator[str]:
    """The names that SHARD_NAME refuses (a table's are looked at one by one only if one is)."""
    if isinstance(shards, ShardTable) and shards.plain_names():
        return iter(())
    return (s.name for s in shards if not SHARD_NAME.fullmatch(s.name))


def _read_columns(
    where: str, timeout_s: float, storage: Storage
) -> tuple[dict[str, Any], dict[str, Sequence[ShardInfo]]] | None:
    """The manifest from the columns beside the JSON at `where`, or None when there are none or
    they were made from another JSON (one of another size)."""
    if not where.endswith(".json"):
        return None
    beside = where[: -len(".json")] + ".npz"
    try:  # a local file is loaded from its path: one copy in memory, not two
        local = not is_url(beside) and Path(beside).is_file()
        npz = beside if local else storage.read(beside, timeout_s)
    except FileNotFoundError:
        return None
    try:
        rest, splits, json_size = columns.load(npz)
    except ValueError:  # unreadable: the JSON is the manifest
        return None
    if json_size != storage.stat(where, timeout_s)[0]:
        return None
    return rest, dict(splits)


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """`manifest.json` and its columns (`manifest.npz`, raywds.data.columns) in `folder`: the
    columns first, so that a reader never finds them made from a JSON other than the one there."""
    text = _json_text(manifest).encode()
    write_atomic(folder / columns.COLUMNS, columns.to_bytes(manifest, len(text)))
    write_atomic(folder / MANIFEST, text)


def write_json_atomic(path: Path, value: Any) -> None:
    """Write JSON so that a reader sees either the old file or the whole new one."""
    write_atomic(path, _json_text(value).encode())


def _json_text(value: Any) -> str:
    return json.dumps(value, indent=1) + "\n"


NUM_SAMPLES = operator.attrgetter("num_samples")  # a sort key; sum(map(NUM_SAMPLES, shards)) runs in C


def deal(shards: Sequence[ShardInfo], num_slots: int) -> list[list[ShardInfo]]:
    """Deal shards to `num_slots` slots, balancing sample counts (largest first, to the lightest slot).

    The order of `shards` breaks ties, so a shuffled list gives a shuffled deal; every shard
    lands in exactly one slot. The lightest slot is the least (samples, shards, index): a heap
    of those keys finds it in O(log slots), so 400k shards on 32k slots deal in half a second.
    """
    if num_slots < 1:
        raise ValueError(f"num_slots={num_slots} must be at least 1")
    slots: list[list[ShardInfo]] = [[] for _ in range(num_slots)]
    # Each slot's key (samples, shards, slot) as one int that orders as the tuple does and compares
    # in one step (slot < num_slots, shards <= len(shards)): 400k shards on 4,096 slots in 0.4 s, not 0.7.
    per_sample = (len(shards) + 1) * num_slots
    lightest = list(range(num_slots))  # every key at 0 samples, 0 shards: sorted, so a heap
    replace = heapq.heapreplace
    for shard in sorted(shards, key=NUM_SAMPLES, reverse=True):  # stable: ties keep the given order
        key = lightest[0]
        slots[key % num_slots].append(shard)
        replace(lightest, key + shard.num_samples * per_sample + num_slots)
    return slots


def shardsum(names: list[str]) -> list[str]:
    """Shard names in brace notation: `imagenet-train-{000000..001281}.tar`, one line per
    unbroken run, so gaps show as separate ranges. Names without a number pass through."""
    groups: dict[tuple[str, str, int], list[int]] = {}
    lines: list[str] = []
    for name in (n.strip() for n in names):
        if not name:
            continue
        match = re.fullmatch(r"(.*?)(\d+)(\.[^/]*)?", name)
        if match is None:
            lines.append(name)
            continue
        head, digits, tail = match.group(1), match.group(2), match.group(3) or ""
        groups.setdefault((head, tail, len(digits)), []).append(int(digits))
    for (head, tail, width), numbers in sorted(groups.items()):
        numbers = sorted(set(numbers))
        start = prev = numbers[0]
        for n in numbers[1:] + [None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            if start == prev:
                lines.append(f"{head}{start:0{width}d}{tail}")
            else:
                lines.append(f"{head}{{{start:0{width}d}..{prev:0{width}d}}}{tail}")
            if n is not None:
                start = prev = n
    return lines
