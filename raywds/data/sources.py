"""What each sample was made from: the image file's path in its source tree and the sha256 of its
bytes as read (before restart markers or --max-side touch them), kept beside the manifest in
`sources.npz`, one row a sample, by which `raywds convert --append` refuses an image the dataset
holds already, under whatever name or class folder, after whatever appends.

    table = Sources.of(conversion.jobs, records, version=1)    # from what write_shard returned
    write(out, table)                                          # before the manifest that counts it
    known = read(out, manifest)                                # the rows that manifest counts
    known.find(table.digests)                                  # for each new row, the row it repeats

The file only grows: an append writes the dataset's rows, then its own, and the manifest says
how many rows are its (`sources.count`), so a manifest never counts a row a later append wrote
before it was stopped. Arrays: `sha256` (rows x 32 bytes), `version` (the dataset version that
added the row), `paths` (the paths, UTF-8, each ended by a NUL byte; no file name holds one).
"""

from __future__ import annotations

import functools
import hashlib
import io
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from raywds.data.layout import ImageFile
from raywds.data.stores import write_atomic
from raywds.errors import DataError

if TYPE_CHECKING:
    import numpy as np

SOURCES = "sources.npz"
DIGESTS = "sha256s"
"""A shard's record's key (write_shard, the journal): the sha256 of each sample's image file, in
the shard's order, hex."""


class Planned(Protocol):
    """A shard as planned (raywds.data.convert.ShardJob): its file and the image files it is made of."""

    @property
    def path(self) -> Path: ...
    @property
    def sources(self) -> list[ImageFile]: ...


def image_digest(data: bytes) -> str:
    """The sha256 of an image file's bytes, hex."""
    return hashlib.sha256(data).hexdigest()


def stored_paths(job: Planned, record: dict[str, Any]) -> list[str]:
    """The source paths of the samples `job`'s shard holds: its files but those it skipped."""
    skipped = {bad["path"] for bad in record["skipped"]}
    return [source.relpath for source in job.sources if source.relpath not in skipped]


def hashed_again(job: Planned, record: dict[str, Any]) -> list[str]:
    """The digests of a shard kept from a run of a raywds that did not record them: its files read again."""
    kept = set(stored_paths(job, record))
    return [image_digest(source.path.read_bytes()) for source in job.sources if source.relpath in kept]


@dataclass(frozen=True)
class Sources:
    """Rows of `sources.npz`: each sample's digest, the version that added it, its source path."""

    digests: np.ndarray
    versions: np.ndarray
    paths: list[str]

    def __len__(self) -> int:
        return len(self.paths)

    @classmethod
    def of(cls, jobs: Iterable[tuple[str, Planned]], records: dict[str, dict[str, Any]], version: int) -> Sources:
        """The rows of the shards `jobs` planned, from their records, in shard order."""
        import numpy as np

        hexes: list[str] = []
        paths: list[str] = []
        for _, job in jobs:
            record = records[job.path.name]
            paths += stored_paths(job, record)
            hexes += record[DIGESTS]
            if len(hexes) != len(paths):
                raise DataError(f"{job.path.name}: {len(record[DIGESTS])} image digests for its samples; a raywds bug")
        raw = np.frombuffer(bytes.fromhex("".join(hexes)), np.uint8).reshape(-1, 32)
        return cls(raw, np.full(len(paths), version, np.int64), paths)

    def __add__(self, other: Sources) -> Sources:
        import numpy as np

        return Sources(
            np.concatenate([self.digests, other.digests]),
            np.concatenate([self.versions, other.versions]),
            [*self.paths, *other.paths],
        )

    @functools.cached_property
    def _sorted(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows in the order of their keys, and those keys (made once: each shard of an append asks)."""
        import numpy as np

        keys = _keys(self.digests)
        order = np.argsort(keys, kind="stable")
        return order, keys[order]

    def find(self, digests: np.ndarray) -> list[int | None]:
        """For each of `digests` (rows x 32 bytes), a row of this table with the same one, or None."""
        import numpy as np

        if not len(self) or not len(digests):
            return [None] * len(digests)
        order, ordered = self._sorted
        found: list[int | None] = [None] * len(digests)
        wanted = _keys(digests)
        places = np.searchsorted(ordered, wanted)
        near = np.flatnonzero(ordered[np.minimum(places, len(ordered) - 1)] == wanted)
        for i in near.tolist():  # the first 8 bytes agree: compare all 32
            at = int(places[i])
            while at < len(ordered) and ordered[at] == wanted[i]:
                if bytes(self.digests[order[at]]) == bytes(digests[i]):
                    found[i] = int(order[at])
                    break
                at += 1
        return found

    def repeats(self) -> list[tuple[int, int]]:
        """(row, the first earlier row of the same bytes) for every row that repeats one."""
        import numpy as np

        if not len(self):
            return []
        keys = _keys(self.digests)
        _, first, counts = np.unique(keys, return_index=True, return_counts=True)
        if (counts == 1).all():
            return []
        seen: dict[bytes, int] = {}
        out = []
        for row in np.flatnonzero(np.isin(keys, keys[first[counts > 1]])):
            whole = bytes(self.digests[row])
            if whole in seen:
                out.append((int(row), seen[whole]))
            else:
                seen[whole] = int(row)
        return out

    def to_bytes(self) -> bytes:
        import numpy as np

        out = io.BytesIO()
        paths = "".join(f"{p}\0" for p in self.paths).encode()
        np.savez(
            out, allow_pickle=False, sha256=self.digests, version=self.versions, paths=np.frombuffer(paths, np.uint8)
        )
        return out.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, rows: int) -> Sources:
        """The first `rows` rows of a `sources.npz`; ValueError when it holds fewer, or is not one."""
        import zipfile

        import numpy as np

        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                digests, versions, paths = npz["sha256"], npz["version"], npz["paths"].tobytes().decode()
        except (KeyError, EOFError, OSError, zipfile.BadZipFile) as e:
            raise ValueError(f"not a {SOURCES}: {e}") from None
        names = paths.split("\0")[:-1]
        if not len(digests) == len(versions) == len(names) >= rows:
            raise ValueError(f"{len(names)} rows, the manifest counts {rows}")
        return cls(digests[:rows], versions[:rows], names[:rows])


def _keys(digests: np.ndarray) -> np.ndarray:
    """Each digest's first 8 bytes as one integer: a key that sorts and searches in numpy."""
    return digests[:, :8].copy().view("<u8").ravel()


def entry(table: Sources) -> dict[str, Any]:
    """The manifest's `sources`: the file, and how many of its rows are this version's dataset."""
    return {"file": SOURCES, "count": len(table)}


def write(out: Path, table: Sources) -> None:
    """`sources.npz` in `out`, atomically: written before the manifest whose `sources.count` counts it."""
    write_atomic(out / SOURCES, table.to_bytes())


def read(out: Path, manifest: dict[str, Any]) -> Sources:
    """The rows of the dataset `manifest` (in `out`) describes; one line for a dataset that has none."""
    counted = manifest.get("sources")
    if counted is None:
        raise DataError(
            f"{out / 'manifest.json'} keeps no sha256 of its images (a raywds before {SOURCES} wrote it), so an "
            "append cannot tell which images it holds already: convert its source again into an empty folder "
            "(the same --seed and shard limits give the same samples, and records them; then append there "
            "what was appended to it, in order), and append to that"
        )
    try:
        return Sources.from_bytes((out / counted["file"]).read_bytes(), counted["count"])
    except (OSError, ValueError) as e:
        raise DataError(
            f"{out / counted['file']} cannot be read ({e}): it lists the dataset's images by their sha256 "
            "for --append; restore it from where OUT came from, or convert anew"
        ) from None
