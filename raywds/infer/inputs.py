"""What `raywds predict` reads, as units that each become one part of its output: the shards of
--data (one split, or all of them), or a folder of image files, its sorted files cut into lists
of FILES_PER_UNIT that are dealt as shards are (a file's key: its path relative to the folder).
Units are numbered through as a split's shards are, so a sample's id says which unit it came from.

    inputs = inputs_for("shards/", split="val")           # or a folder of .jpg files
    inputs.units[0].name, inputs.fingerprint
    stages = [bind(worker_urls, urls, rank), inputs.reading(names, cfg, failures, opening)]
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial as bind
from pathlib import Path
from typing import Any, Protocol

from raywds.data import stores
from raywds.data.dataset import manifest_for
from raywds.data.manifest import MANIFEST, Manifest, ShardInfo, deal
from raywds.data.members import IMAGE_KEYS, Members
from raywds.data.stores import Storage
from raywds.errors import ConfigError, DataError
from raywds.loader.labels import Labels
from raywds.loader.loader import expected, labels_of
from raywds.loader.readers import Failures, tar_samples
from raywds.loader.settings import LoaderConfig

ALL = "all"
"""--split: every split's shards, in manifest order."""
PREDICTED = "predicted"
"""The one split of the manifest a predict reads (the chosen split's shards, or all of them)."""
FILES_PER_UNIT = 256
"""A folder's files per unit (one part of the output, dealt as a shard is)."""
IMAGE = "image"
"""The member a folder's sample keeps its file's bytes in."""
ERROR = "__error__"
"""A sample that could not be read carries why here, and no image."""


@dataclass(frozen=True)
class Unit:
    """A shard, or a list of a folder's files: read by one loader worker, written as one part."""

    name: str
    """The shard's name in the manifest, or `files-000000` for a folder's first FILES_PER_UNIT files."""
    url: str
    num_samples: int
    first_id: int
    """The id of its first sample: the units' samples are numbered through."""


Reading = Callable[[Iterable[dict[str, Any]]], Iterator[dict[str, Any]]]
"""A stage: {url} dicts -> sample dicts with `__key__`, `__url__` and `__id__`, and the image member."""


class Inputs(Protocol):
    location: str
    units: list[Unit]
    labels: Labels | None
    fingerprint: str
    """A short hash of what is read (names, counts, contents), kept with the predictions."""
    split: str
    """The split read (ALL for a folder)."""

    def reading(
        self, names: set[str], cfg: LoaderConfig, failures: Failures, opening: Callable[[str], None] | None
    ) -> Reading: ...


def dealt(units: Sequence[Unit], num_slots: int) -> list[list[Unit]]:
    """The units dealt to `num_slots` slots in order, balancing samples, as validation deals shards."""
    by_name = {u.name: u for u in units}
    infos = [ShardInfo(u.name, u.num_samples, 0, "") for u in units]
    return [[by_name[s.name] for s in slot] for slot in deal(infos, num_slots)]


def unit_of(units: Sequence[Unit], firsts: Sequence[int], sample_id: int) -> Unit:
    """The unit that sample `sample_id` belongs to (`firsts`: each unit's first id, ascending)."""
    return units[bisect.bisect_right(firsts, sample_id) - 1]


class Shards:
    """--data's shards (of `split`, or all), one unit each."""

    def __init__(self, location: str, manifest: Manifest, split: str):
        names = list(manifest.splits) if split == ALL else [split]
        if split != ALL and split not in manifest.splits:
            raise ConfigError(f"--split {split}: the manifest at {manifest.base} has {', '.join(manifest.splits)}")
        shards = [s for name in names if manifest.splits.get(name) for s in manifest.splits[name]]
        if not shards:
            raise DataError(f"--data {location} holds no shards in {', '.join(names)}")
        self.manifest = dataclasses.replace(manifest, splits={PREDICTED: shards}, kept={})
        self.location, self.labels, self.split = location, labels_of(manifest), split
        firsts = self.manifest.first_ids(PREDICTED)
        self.units = [Unit(s.name, self.manifest.url(s), s.num_samples, f) for s, f in zip(shards, firsts)]
        self.fingerprint = self.manifest.fingerprint(PREDICTED)

    def reading(
        self, names: set[str], cfg: LoaderConfig, failures: Failures, opening: Callable[[str], None] | None
    ) -> Reading:
        wanted = expected(self.manifest, PREDICTED, names)
        return bind(
            tar_samples,
            policy=failures.policy,
            expected=wanted,
            verify_hashes=cfg.verify_hashes,
            failures=failures,
            opening=opening,
        )


class Folder:
    """A folder of image files (no shards): its files sorted, FILES_PER_UNIT a unit."""

    def __init__(self, root: Path, files: list[str]):
        self.location, self.root, self.split = str(root), root, ALL
        self.labels: Labels | None = Labels(Members(image=(IMAGE,), label="", label_keys=()))
        self.files = {}
        self.units = []
        for n, start in enumerate(range(0, len(files), FILES_PER_UNIT)):
            name = f"files-{n:06d}"
            self.files[name] = files[start : start + FILES_PER_UNIT]
            self.units.append(Unit(name, name, len(self.files[name]), start))
        sizes = "".join(f"{f} {(root / f).stat().st_size}\n" for f in files)
        self.fingerprint = hashlib.sha256(sizes.encode()).hexdigest()[:16]

    def reading(
        self, names: set[str], cfg: LoaderConfig, failures: Failures, opening: Callable[[str], None] | None
    ) -> Reading:
        units = {u.url: (u.first_id, self.files[u.name]) for u in self.units if u.name in names}
        return bind(folder_samples, root=str(self.root), units=units, opening=opening)


def folder_samples(
    sources: Iterable[dict[str, Any]],
    root: str,
    units: dict[str, tuple[int, list[str]]],
    opening: Callable[[str], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """{url} dicts of a folder's units -> a sample per file: its bytes, or why they cannot be read."""
    for source in sources:
        url = source["url"]
        first, files = units[url]
        if opening is not None:
            opening(url)
        for i, name in enumerate(files):
            sample: dict[str, Any] = {"__key__": name, "__url__": url, "__id__": first + i}
            try:
                sample[IMAGE] = Path(root, name).read_bytes()
            except OSError as e:
                sample[ERROR] = f"cannot read {name}: {e.strerror or e}"
            yield sample


def image_files(root: Path) -> list[str]:
    """The image files under `root` (by extension), as paths relative to it, sorted."""
    suffixes = {f".{ext}" for ext in IMAGE_KEYS}
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.relpath(os.path.join(folder, n), root) for n in names if Path(n).suffix.lower() in suffixes]
    return sorted(Path(f).as_posix() for f in found)


def is_image_folder(data: str) -> bool:
    """A local folder without manifest.json and without any .tar file under it."""
    if stores.scheme(data) != stores.LOCAL or not os.path.isdir(stores.local_path(data)):
        return False
    root = Path(stores.local_path(data))
    return not (root / MANIFEST).is_file() and next(root.rglob("*.tar"), None) is None


def inputs_for(
    data: str,
    *,
    split: str = ALL,
    storage: Storage = Storage(),
    index_cache: str | None = None,
    shards_at: str | None = None,
) -> Inputs:
    """What --data names: a folder of image files, or shards (a manifest's, or indexed once)."""
    if is_image_folder(data):
        root = Path(stores.local_path(data))
        files = image_files(root)
        if not files:
            extensions = ", ".join(IMAGE_KEYS)
            raise DataError(f"--data {data} holds neither shards nor image files ({extensions}); check the path")
        return Folder(root, files)
    manifest = manifest_for(data, shards_at=shards_at, storage=storage, index_cache=index_cache)
    return Shards(data, manifest, split)
