"""An image tree in a bucket (s3:// or gs://) or behind an HTTP server's directory listing, listed
once, read as raywds.data.layout reads a folder.

    root = Listed.of("s3://bucket/imagenet", Storage())     # or http://host/imagenet/
    found = scan(root)                       # the same Found as for a local copy of the tree
    data = found.splits["train"][0].path.read_bytes()

`Listed` is as much of pathlib.Path as the scan and the converter use (`/`, `name`, `stem`,
`suffix`, `parent`, `is_dir`, `is_file`, `iterdir`, `rglob("*")`, `relative_to`, `stat`,
`read_bytes`, `read_text`). A bucket has no folders, only keys: a folder is a prefix some key
has, so an empty class folder does not exist there. A Listed sent to another process (a Ray
task) keeps its URL, size and storage, not the listing: it can be read there, not walked.

Over HTTP the listing is the server's own pages, followed folder by folder (`crawl`): nginx's
`autoindex_format json` gives each file's size; from an HTML listing (nginx's default
autoindex, Apache's, `python -m http.server`'s) each file's size comes from a HEAD request, 16 at
a time. Links that leave the folder (`../`, `?C=N;O=D` sort links, other hosts) are not followed.
"""

from __future__ import annotations

import html.parser
import json
import os
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from raywds.data import stores
from raywds.data.stores import Storage
from raywds.errors import DataError

READ_TIMEOUT_S = 60.0


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
    quoted: bool = False
    """Whether a path below the root is %-quoted in its URL (http's)."""

    def url(self, rel: str) -> str:
        return self.root + (urllib.parse.quote(rel) if self.quoted else rel)


class Listed:
    """A file or folder of a Listing, read through `storage` (every one of a tree through the same)."""

    def __init__(self, listing: Listing | None, rel: str, *, url: str, storage: Storage, size: int = -1):
        self._listing, self.rel, self.url, self.storage, self.size = listing, rel, url, storage, size

    @classmethod
    def of(cls, prefix: str, storage: Storage = Storage()) -> Listed:
        """The tree under `prefix`, listed now; one line when nothing is there."""
        root = prefix.rstrip("/") + "/"
        if stores.scheme(root) == stores.HTTP:
            files = crawl(root)
        else:
            files = {url[len(root) :]: size for url, size, _ in storage.listing(root) if not url.endswith("/")}
        if not files:
            raise DataError(f"{prefix} holds no objects; give the prefix that holds train/ and val/")
        folders = {""}
        for rel in files:
            parts = rel.split("/")[:-1]
            folders.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        listing = Listing(root, files, frozenset(folders), quoted=stores.scheme(root) == stores.HTTP)
        return cls(listing, "", url=root.rstrip("/"), storage=storage)

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
        return self._at(rel) if self.rel else Listed(None, "", url=self.url.rsplit("/", 1)[0], storage=self.storage)

    def __truediv__(self, name: str) -> Listed:
        if self._listing is None:  # beside the listed prefix (a labels file next to it): not listed, so absent
            return Listed(None, name, url=f"{self.url.rstrip('/')}/{name}", storage=self.storage)
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
        return Listed(listing, rel, url=listing.url(rel), storage=self.storage, size=listing.files.get(rel, -1))

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
        try:
            return self.storage.read(self.url)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url} is gone from the bucket since it was listed") from None

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def __getstate__(self) -> dict[str, Any]:
        """What another process gets: the URL, size and storage, not the listing."""
        return {"rel": self.rel, "url": self.url, "size": self.size, "storage": self.storage, "_listing": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


MAX_DEPTH = 8
"""Folders below the root an HTTP listing is followed into (ImageNet's tree is 2 deep)."""
HEADS_AT_ONCE = 16


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.links.append(href)


def _page(url: str) -> tuple[str, bytes]:
    with urllib.request.urlopen(url, timeout=READ_TIMEOUT_S) as response:
        return response.headers.get_content_type(), response.read()


def _entries(folder: str) -> tuple[list[str], dict[str, int]]:
    """The subfolders (full URLs) and files (URL -> size, -1 when the page does not say) of one
    listing page."""
    kind, body = _page(folder)
    if kind == "application/json":  # nginx: autoindex_format json
        items = json.loads(body)
        folders = [folder + urllib.parse.quote(i["name"]) + "/" for i in items if i.get("type") == "directory"]
        return folders, {
            folder + urllib.parse.quote(i["name"]): int(i.get("size", -1)) for i in items if i.get("type") == "file"
        }
    parser = _Links()
    parser.feed(body.decode(errors="replace"))
    folders, files = [], {}
    for href in parser.links:
        url = urllib.parse.urljoin(folder, href.split("#", 1)[0])
        if "?" in href or not url.startswith(folder) or url == folder:
            continue  # a sort link, the parent folder, another place
        if url.endswith("/"):
            folders.append(url)
        else:
            files[url] = -1
    return folders, files


def crawl(root: str) -> dict[str, int]:
    """Each file under the HTTP listing at `root`, by its path below it (unquoted), with its size."""
    import concurrent.futures

    try:
        found: dict[str, int] = {}
        waiting, seen = [(root, 0)], {root}
        while waiting:
            folder, depth = waiting.pop()
            folders, files = _entries(folder)
            found.update(files)
            for sub in folders:
                if sub not in seen and depth < MAX_DEPTH:
                    seen.add(sub)
                    waiting.append((sub, depth + 1))
        unknown = [url for url, size in found.items() if size < 0]
        with concurrent.futures.ThreadPoolExecutor(HEADS_AT_ONCE) as pool:
            for url, (size, _) in zip(unknown, pool.map(Storage().stat, unknown)):  # http: no setting
                found[url] = size
    except (OSError, ValueError) as e:
        raise DataError(f"{root}: could not read its listing ({type(e).__name__}: {e})") from None
    return {urllib.parse.unquote(url[len(root) :]): size for url, size in found.items()}


def tree_at(location: str, storage: Storage = Storage()) -> Tree:
    """The image tree at a folder, under an s3:// or gs:// prefix, or behind an http(s):// listing
    (listed now)."""
    from pathlib import Path

    if stores.scheme(location) in (stores.S3, stores.GS, stores.HTTP):
        return Listed.of(location, storage)
    return Path(stores.local_path(location))
