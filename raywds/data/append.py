"""`raywds convert NEWSRC OUT --append`: new images added to the dataset in OUT as new shards and a
new version of its manifest; every shard already there is kept, byte for byte.

    manifest = append(Path("new-images"), Path("shards"), options)

NEWSRC is an image tree as `raywds convert` reads one (train/ and val/, or one ImageFolder). Its
classes are matched to the dataset's by name (ignoring case, as val folders are to train's); the
classes the dataset lacks get the indices after its own, in sorted order, so that no label of a
shard already there changes (a sorted class list of the union would renumber them). The new
shards are cut with the dataset's own settings (prefix, seed, --maxcount, --maxsize, --max-side,
restart markers; those given are left aside), shuffled with the seed and the new version, and
numbered on from each split's last shard. The manifest gains `version` (1 before the first
append) and an `appended` entry per append: its version, source, listing fingerprint, new
classes and shards.

An image the dataset holds already is refused, by its bytes: `sources.npz` beside the manifest
keeps the sha256 of every sample's image file (raywds.data.sources), and each new shard's images,
hashed as they are read, are looked up there as the shard is done. The first shard that holds
one stops the append; the images not yet read are hashed to count them all, the new shards are
removed, and the line names the first few and what they repeat. Nothing is published.

An interrupted append, rerun with the same arguments, keeps the new shards it finished (its own
fingerprint in OUT's `.raywds-convert.json`, its own journal); until the new manifest replaces the
old one, atomically and last, readers see the dataset as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from raywds.data.convert import (
    Conversion,
    Runner,
    ShardJob,
    check_options,
    check_outside,
    fingerprint,
    plan_jobs,
    processes,
    publish,
    same_bytes,
    source_of,
    split_entry,
    write_all,
)
from raywds.data.layout import scan
from raywds.data.listed import Tree
from raywds.data.manifest import MANIFEST
from raywds.data.resume import prepare_append
from raywds.data.shardoptions import ConvertOptions
from raywds.data.sources import DIGESTS, Sources, image_digest, stored_paths
from raywds.data.sources import read as read_sources
from raywds.errors import DataError


def base_manifest(out: Path) -> tuple[dict[str, Any], str]:
    """The manifest of the dataset in `out` and the sha256 of its bytes; one line where there is none."""
    path = out / MANIFEST
    if not path.is_file():
        raise DataError(
            f"--append adds to a dataset, and {out} holds no {MANIFEST}: convert the first images into it "
            "without --append (an unfinished conversion: run it again to finish it first)"
        )
    data = path.read_bytes()
    manifest = json.loads(data)
    if not manifest.get("classes"):
        raise DataError(f"{path} lists no classes: raywds cannot tell which label a folder of NEWSRC is")
    return manifest, hashlib.sha256(data).hexdigest()


def same_settings(options: ConvertOptions, base: dict[str, Any]) -> ConvertOptions:
    """`options` with the dataset's own shard settings, so the new shards are cut as the old were."""
    return dataclasses.replace(
        options,
        prefix=base["prefix"],
        seed=base.get("seed", options.seed),
        maxcount=base.get("maxcount", options.maxcount),
        maxsize=base.get("maxsize", options.maxsize),
        max_side=base.get("max_side_px"),
        keep_jpeg_bytes=not base.get("jpeg_restarts", False),
    )


@dataclasses.dataclass(frozen=True)
class Append:
    """An append planned: its shards, the manifest they are added to and the dataset's sources, its
    version and listing fingerprint."""

    conversion: Conversion
    base: dict[str, Any]
    known: Sources
    version: int
    listing: str


def plan_append(src: Tree, out: Path, options: ConvertOptions) -> Append:
    """The new shards planned, and the manifest they are added to."""
    check_outside(src, out)
    base, digest = base_manifest(out)
    options = same_settings(options, base)
    check_options(options)
    known = read_sources(out, base)
    found = scan(src, val_labels=options.val_labels, val_wnids=options.val_wnids, known=list(base["classes"]))
    listing = fingerprint(found, options)
    version = base.get("version", 1) + 1
    done = prepare_append(out, hashlib.sha256(f"{listing} {digest}".encode()).hexdigest())
    first = {split: len(info["shards"]) for split, info in base["splits"].items()}
    jobs = plan_jobs(found, out, options, done, first=first, salt=f"-v{version}")
    return Append(Conversion(src, out, options, found, jobs), base, known, version, listing)


def grown(planned: Append, records: dict[str, dict[str, Any]], table: Sources) -> dict[str, Any]:
    """The dataset's manifest with the new shards after each split's old ones; `table`: the
    sources of every sample, the new ones last."""
    conversion, base, version, listing = planned.conversion, planned.base, planned.version, planned.listing
    found = conversion.found
    splits = {split: dict(info) for split, info in base["splits"].items()}
    added = {}
    for split in found.splits:
        new = split_entry(conversion.jobs, records, split)
        old = splits.get(split, {"num_samples": 0, "shards": [], "first_keys": {}})
        splits[split] = {
            "num_samples": old["num_samples"] + new["num_samples"],
            "shards": [*old["shards"], *new["shards"]],
            "first_keys": {**old.get("first_keys", {}), **new["first_keys"]},
        }
        added[split] = {"num_samples": new["num_samples"], "shards": [s["name"] for s in new["shards"]]}
    skipped = [s for r in records.values() for s in r["skipped"]]
    entry = {
        "version": version,
        "source": source_of(conversion.src),
        "fingerprint": listing,
        "classes_added": found.added,
        "splits": added,
        "skipped": len(skipped),
        "same_bytes": same_bytes(table, since=len(planned.known))["count"],
    }
    return {
        **base,
        "classes": found.classes,
        "splits": splits,
        "layouts": {**base.get("layouts", {}), **found.layouts},
        "skipped": [*base.get("skipped", []), *skipped],
        "version": version,
        "appended": [*base.get("appended", []), entry],
        "kept_from_earlier_run": sum(r["kept"] for r in records.values()),
        "sources": {**base["sources"], "count": len(table)},
        "same_bytes": same_bytes(table),
    }


def append(src: Tree, out: Path, options: ConvertOptions, *, run: Runner | None = None) -> dict[str, Any]:
    """Add the images of `src` to the dataset in `out` (with `run`, else `options.workers`
    processes here); returns the new manifest."""
    planned = plan_append(src, out, options)
    conversion = planned.conversion
    checked = Checked(run or processes(conversion.options.workers), planned.known)
    try:
        records = write_all(conversion, checked)
    except Repeats:
        raise refusal(planned, checked.done) from None
    table = planned.known + Sources.of(conversion.jobs, records, planned.version)
    manifest = grown(planned, records, table)
    publish(out, manifest, table)
    return manifest


class Repeats(Exception):
    """A new shard holds an image the dataset holds already (Checked)."""


class Checked:
    """A Runner that runs `run` and stops it after the first shard holding an image of `known`,
    raising Repeats; `done` keeps each finished shard's record."""

    def __init__(self, run: Runner, known: Sources):
        self.run, self.known = run, known
        self.done: dict[str, dict[str, Any]] = {}

    def __call__(self, jobs: list[ShardJob]) -> Iterator[tuple[ShardJob, dict[str, Any]]]:
        results = self.run(jobs)
        try:
            for job, record in results:
                self.done[job.path.name] = record
                yield job, record
                if any(row is not None for row in self.known.find(_raw(record[DIGESTS]))):
                    raise Repeats
        finally:
            close = getattr(results, "close", None)
            if close is not None:
                close()  # the runner cancels the shards not yet under way


def _raw(hexes: list[str]) -> Any:
    import numpy as np

    return np.frombuffer(bytes.fromhex("".join(hexes)), np.uint8).reshape(-1, 32)


READERS = 16
"""Files read at once to hash the images a refused append had not yet read (a bucket's are slow)."""


def refusal(planned: Append, done: dict[str, dict[str, Any]]) -> DataError:
    """The line refusing an append whose images the dataset holds: how many (those not yet read
    are read now to count them), the first few and what they repeat, what to do. The new shards
    written are removed; the manifest was never touched."""
    conversion, known = planned.conversion, planned.known
    paths: list[str] = []
    hexes: list[str] = []
    rest = []
    for _, job in conversion.jobs:
        if job.path.name in done:
            paths += stored_paths(job, done[job.path.name])
            hexes += done[job.path.name][DIGESTS]
        else:
            rest += job.sources
    with ThreadPoolExecutor(READERS) as pool:
        hexes += pool.map(lambda source: image_digest(source.path.read_bytes()), rest)
    paths += [source.relpath for source in rest]
    old = {s["name"] for info in planned.base["splits"].values() for s in info["shards"]}
    for _, job in conversion.jobs:
        if job.path.name not in old:
            job.path.unlink(missing_ok=True)
    repeats = sorted((path, row) for path, row in zip(paths, known.find(_raw(hexes))) if row is not None)
    named = "; ".join(f"{path} is {known.paths[row]} of version {known.versions[row]}" for path, row in repeats[:3])
    total = sum(len(job.sources) for _, job in conversion.jobs)
    return DataError(
        f"{len(repeats)} of the {total} images of {source_of(conversion.src)} {'is' if len(repeats) == 1 else 'are'} "
        f"in {conversion.out} already, "
        f"byte for byte: {named}{'; …' if len(repeats) > 3 else ''}; append only images that are new: take "
        f"{'these' if len(repeats) > 1 else 'it'} out of SRC and run it again (nothing was added)"
    )


def _shards(count: int) -> str:
    return f"{count} new shard{'s' if count != 1 else ''}"


def appended_lines(manifest: dict[str, Any]) -> list[str]:
    """What `raywds convert --append` says of the append it made."""
    entry = manifest["appended"][-1]
    counts = ", ".join(
        f"{info['num_samples']} {split} samples in {_shards(len(info['shards']))}"
        for split, info in entry["splits"].items()
    )
    lines = [f"appended {counts} as version {entry['version']}; the shards already there are unchanged"]
    new = entry["classes_added"]
    if new:
        first = len(manifest["classes"]) - len(new)
        named = ", ".join(f"{name} ({first + i})" for i, name in enumerate(new[:10])) + (
            f" and {len(new) - 10} more" if len(new) > 10 else ""
        )
        lines.append(
            f"{len(new)} new class{'es' if len(new) > 1 else ''} after the {first} there: {named}; "
            "a model trained before has too few outputs for " + ("them" if len(new) > 1 else "it")
        )
    return lines
