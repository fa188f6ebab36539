"""An image tree in a bucket (s3:// or gs://), listed once, read as raywds.data.layout reads a folder.

    root = Listed.of("s3://bucket/imagenet", endpoint=None)
    found = scan(root)                       # the same Found as for a local copy of the tree
    data = found.splits["train"][0].path.read_bytes()

`Listed` is as much of pathlib.Path as the scan and the converter use (`/`, `name`, `stem`,
`suffix`, `parent`, `is_dir`, `is_file`, `iterdir`, `rglob("*")`, `relative_to`, `stat`,
`read_bytes`, `read_text`). A bucket has no folders, only keys: a folder is a prefix some key
has, so an empty class folder does not exist there. A Listed sent to another process (a Ray
task) keeps its URL, size and endpoint, not the listing: it can be read there, not walked.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from raywds.data import stores
from raywds.errors import DataError


class Tree(Protocol):
    """What the scan reads: a pathlib.Path, or a Listed."""

    @property
    def name(self) -> str: ...
    @property
    def stem(self) -> str: ...
    @property
    def suffix(self) -> str: ...
    @property
    def parent(self) -> Any: ...
    def __truediv__(self, name: str) -> Any: ...
    def __lt__(self, other: Any) -> bool: ...
    def is_dir(self) -> bool: ...
    def is_file(self) -> bool: ...
    def iterdir(self) -> Iterator[Any]: ...
    def rglob(self, pattern: str) -> Iterator[Any]: ...
    def relative_to(self, other: Any) -> Any: ...
    def stat(self) -> Any: ...
    def read_bytes(self) -> bytes: ...
    def read_text(self) -> str: ...


@dataclass(frozen=True)
class Listing:
    """The keys under a prefix: each file's size by its path below the prefix, and every folder."""

    root: str
    files: dict[str, int]
    folders: frozenset[str]
    endpoint: str | None


class Listed:
    """A file or folder of a Listing."""

    def __init__(self, listing: Listing | None, rel: str, *, url: str, size: int = -1):
        self._listing, self.rel, self.url, self.size = listing, rel, url, size

    @classmethod
    def of(cls, prefix: str, endpoint: str | None = None) -> Listed:
        """The tree under `prefix`, listed now; one line when nothing is there."""
        root = prefix.rstrip("/") + "/"
        files = {url[len(root) :]: size for url, size, _ in stores.listing(root, endpoint) if not url.endswith("/")}
        if not files:
            raise DataError(f"{prefix} holds no objects; give the prefix that holds train/ and val/")
        folders = {""}
        for rel in files:
            parts = rel.split("/")[:-1]
            folders.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        return cls(Listing(root, files, frozenset(folders), endpoint), "", url=root.rstrip("/"))

    # -- names ---------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.rel.rsplit("/", 1)[-1] if self.rel else self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        return os.path.splitext(self.name)[1]

    @property
    def stem(self) -> str:
        return os.path.splitext(self.name)[0]

    @property
    def parent(self) -> Listed:
        rel = self.rel.rsplit("/", 1)[0] if "/" in self.rel else ""
        return self._at(rel) if self.rel else Listed(None, "", url=self.url.rsplit("/", 1)[0])

    def __truediv__(self, name: str) -> Listed:
        if self._listing is None:  # beside the listed prefix (a labels file next to it): not listed, so absent
            return Listed(None, name, url=f"{self.url.rstrip('/')}/{name}")
        return self._at(f"{self.rel}/{name}" if self.rel else name)

    def relative_to(self, other: Listed) -> str:
        return self.rel[len(other.rel) :].lstrip("/") if other.rel else self.rel

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Listed({self.url!r})"

    def __lt__(self, other: Listed) -> bool:
        return self.rel < other.rel

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Listed) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    # -- what is there -------------------------------------------------------------------------
    def _at(self, rel: str) -> Listed:
        listing = self._walkable()
        return Listed(listing, rel, url=listing.root + rel, size=listing.files.get(rel, -1))

    def _walkable(self) -> Listing:
        if self._listing is None:
            raise DataError(f"{self.url}: only the listing's own process can walk a bucket tree")
        return self._listing

    def is_dir(self) -> bool:
        return self._listing is not None and self.rel in self._listing.folders

    def is_file(self) -> bool:
        return self._listing is not None and self.rel in self._listing.files

    def iterdir(self) -> Iterator[Listed]:
        """Files and folders directly in this folder, in name order."""
        listing, start = self._walkable(), f"{self.rel}/" if self.rel else ""
        names = {
            rel[len(start) :].split("/", 1)[0]
            for rel in [*listing.files, *listing.folders]
            if rel.startswith(start) and rel != self.rel
        }
        return iter(self / name for name in sorted(names) if name)

    def rglob(self, pattern: str) -> Iterator[Listed]:
        """Every file and folder below this folder (only "*" is understood)."""
        if pattern != "*":
            raise ValueError(f"Listed.rglob understands only '*', not {pattern!r}")
        listing, start = self._walkable(), f"{self.rel}/" if self.rel else ""
        below = sorted(rel for rel in [*listing.files, *listing.folders] if rel.startswith(start) and rel != self.rel)
        return iter(self._at(rel) for rel in below)

    def stat(self) -> Any:
        return os.stat_result((0, 0, 0, 0, 0, 0, self.size, 0, 0, 0))

    # -- reading -------------------------------------------------------------------------------
    def read_bytes(self) -> bytes:
        endpoint = self._listing.endpoint if self._listing is not None else self._endpoint
        try:
            return stores.read_bytes(self.url, s3_endpoint=endpoint)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url} is gone from the bucket since it was listed") from None

    def read_text(self) -> str:
        return self.read_bytes().decode()

    _endpoint: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        """What another process gets: the URL, size and endpoint, not the listing."""
        endpoint = self._listing.endpoint if self._listing is not None else self._endpoint
        return {"rel": self.rel, "url": self.url, "size": self.size, "_endpoint": endpoint, "_listing": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def tree_at(location: str, endpoint: str | None = None) -> Tree:
    """The image tree at a folder, or under an s3:// or gs:// prefix (listed now)."""
    from pathlib import Path

    if stores.scheme(location) in (stores.S3, stores.GS):
        return Listed.of(location, endpoint)
    return Path(stores.local_path(location))
