"""Tar members, read fast: a 512-byte header, then the data, for webdataset's key grouping.

webdataset reads tars with Python's tarfile in stream mode (`r|*`), at about 50 µs a member
(buffer joins and slices, full header parsing, compression sniffing). Shards hold three
members a sample, so that was about a sixth of a loader worker's time next to region JPEG
decoding. Most headers need only a name, a size and a checksum; pax headers (webdataset's
ShardWriter writes one before every member, for its float mtime), GNU long names, links,
directories and base-256 sizes are read here too, and only what is rarer (sparse files) hands
the rest of the stream to tarfile, so any tar tarfile reads is read the same way. Handing pax
headers to tarfile cost 112 µs a sample against 8 (benchmarks/index_bench.py).

`Entries` is the same walk with each member's offset and size, reading only the members asked
for and seeking past the rest: what `raywds index` reads a shard with.

    for sample in group_by_keys(tar_files(sources, handler), keys=key_and_ext): ...
    for name, offset, size, data in Entries(open(path, "rb", buffering=0), wanted=lambda n, s: n.endswith(".cls")): ...
"""

from __future__ import annotations

import re
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

BLOCK = 512
SKIP = re.compile(r"__[^/]*__($|/)")
"""webdataset's metadata members (`__key__`-like names), which it skips too."""
KEY_AND_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
"""webdataset's `base_plus_ext`: the key, then everything after the file name's first dot."""


def members(stream: BinaryIO) -> Iterator[tuple[str, bytes]]:
    """(name, data) for each regular file in the tar `stream`, in order."""
    for name, _, _, data in Entries(stream):
        yield name, data  # type: ignore[misc]


EXTENDED = (b"x", b"g", b"L")
"""Headers that describe the next member (pax `x`, GNU long name `L`) or the archive (pax `g`),
read here: webdataset's ShardWriter gives every member a pax header (for its float mtime)."""
SKIPPED = (b"1", b"2", b"3", b"4", b"5", b"6")
"""Links, devices, directories and FIFOs: no sample data, passed over as webdataset does."""


class Entries:
    """(name, offset of its first header, size, data) for each regular file in the tar `stream`,
    the data read only where `wanted(name, size)` says so (else None: skipped, by a seek where the
    stream can). `end` is where the end-of-archive block starts, once reached (None while the
    archive has not ended, and when the stream simply stops there)."""

    def __init__(self, stream: BinaryIO, wanted: Callable[[str, int], bool] | None = None):
        self.stream, self.wanted = stream, wanted
        self.seeks = wanted is not None and stream.seekable()
        self.pos = 0
        self.end: int | None = None

    def _read(self, size: int) -> bytes:
        data = _read(self.stream, size)
        self.pos += len(data)
        return data

    def _skip(self, size: int) -> None:
        if self.seeks:
            self.stream.seek(size, 1)
            self.pos += size
        elif len(self._read(size)) < size:
            raise tarfile.ReadError("unexpected end of data")

    def __iter__(self) -> Iterator[tuple[str, int, int, bytes | None]]:
        path: bytes | None = None
        length: int | None = None
        first: int | None = None
        while True:
            at = self.pos
            header = self._read(BLOCK)
            if len(header) < BLOCK or not any(header):
                if len(header) == BLOCK:
                    self.end = at
                return  # end of archive (a zero block), or a stream that simply ends there
            kind = header[156:157]
            if kind not in (b"0", b"\0", b"7", *EXTENDED, *SKIPPED):  # sparse files and the like
                yield from self._tarfile(header)
                return
            _check(header)
            size = _size(header)
            first = at if first is None else first
            if kind in EXTENDED:
                data = self._read(size)
                if len(data) < size:
                    raise tarfile.ReadError("unexpected end of data")
                self._skip(-size % BLOCK)
                if kind == b"x" and (b"path=" in data or b"size=" in data):  # most say only an mtime
                    records = _pax(data)
                    path = records.get(b"path", path)
                    length = int(records[b"size"]) if b"size" in records else length
                elif kind == b"L":
                    path = data.split(b"\0", 1)[0]
                elif kind == b"g":
                    first = None  # a global header belongs to no member
                continue
            if path is None:
                path = header[:100].split(b"\0", 1)[0]
                if header[257:263] == b"ustar\x00" and header[345] != 0:  # POSIX ustar: a prefix for long paths
                    path = header[345:500].split(b"\0", 1)[0] + b"/" + path
            size = length if length is not None else size
            name = path.decode("utf-8", "surrogateescape")
            path, length, member = None, None, first
            first = None
            if kind in SKIPPED:
                self._skip(size + (-size % BLOCK))
                continue
            if self.wanted is None or self.wanted(name, size):
                data = self._read(size)
                if len(data) < size:
                    raise tarfile.ReadError("unexpected end of data")
                self._skip(-size % BLOCK)
                yield name, member, size, data  # type: ignore[misc]
            else:
                self._skip(size + (-size % BLOCK))
                yield name, member, size, None  # type: ignore[misc]

    def _tarfile(self, header: bytes) -> Iterator[tuple[str, int, int, bytes | None]]:
        """Hand the rest of the archive to tarfile (its offsets from this header on are relative)."""
        for name, data in _tarfile_members(header, self.stream):
            yield name, -1, len(data), data
        self.end = -1  # tarfile read to the archive's end; where it lies is tarfile's


def _size(header: bytes) -> int:
    """A header's size field: octal, or base-256 (GNU, for members of 8 GiB and more)."""
    if header[124] & 0x80:
        return int.from_bytes(header[125:136], "big")
    return int(header[124:136].split(b"\0", 1)[0].strip() or b"0", 8)


def _pax(data: bytes) -> dict[bytes, bytes]:
    """A pax extended header's records (`LEN KEY=VALUE` and a newline, LEN counting the whole record)."""
    records, pos = {}, 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0 or not data[pos:space].isdigit():
            break
        end = pos + int(data[pos:space])
        key, _, value = data[space + 1 : end - 1].partition(b"=")
        records[key] = value
        pos = end
    return records


@dataclass
class Sample:
    """One sample of a tar as webdataset groups it: its key, its first header's offset, its
    members' extensions and the data of the one member read (`Entries`'s `wanted`), if any."""

    key: str
    offset: int
    exts: list[str] = field(default_factory=list)
    label: bytes | None = None


def samples(entries: Iterable[tuple[str, int, int, bytes | None]]) -> Iterator[Sample]:
    """`Entries` grouped into samples as webdataset groups members (consecutive members of one key;
    `__key__`-like members skipped), without keeping any member's data but a wanted one's."""
    current: Sample | None = None
    for name, offset, _, data in entries:
        if SKIP.match(name):
            continue
        key, ext = key_and_ext(name)
        if key is None or ext is None:
            continue
        if current is None or key != current.key:
            if current is not None:
                yield current
            current = Sample(key, offset)
        current.exts.append(ext)
        if data is not None:
            current.label = data
    if current is not None:
        yield current


def key_and_ext(name: str) -> tuple[str | None, str | None]:
    """A member's sample key and extension as webdataset's `base_plus_ext` splits them (at the
    file name's first dot), without its regular expression for the usual names (2x faster)."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot > slash:
        return name[:dot], name[dot + 1 :]
    match = KEY_AND_EXT.match(name)  # no dot, or a name that starts with one
    return (match.group(1), match.group(2)) if match else (None, None)


def tar_files(sources: Iterable[dict[str, Any]], handler: Callable[[BaseException], bool]) -> Iterator[dict[str, Any]]:
    """{url, stream} -> {fname, data, __url__} per member, then {} at the end of each shard, as
    webdataset's tar_file_expander gives them; a failing shard goes to `handler` (True: go on)."""
    for source in sources:
        try:
            for name, data in members(source["stream"]):
                if not SKIP.match(name):
                    yield {"fname": name, "data": data, "__url__": source["url"]}
            yield {}
        except Exception as exn:  # noqa: BLE001 - as webdataset's tar_file_expander: the handler decides
            exn.args = (*exn.args, source.get("url"))
            if not handler(exn):
                return


def _read(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    while 0 < len(data) < size:  # raw streams may return less than asked
        more = stream.read(size - len(data))
        if not more:
            break
        data += more
    return data


def _check(header: bytes) -> None:
    """The header checksum: its bytes summed with the checksum field read as spaces. zlib sums
    them, 5x faster than sum() (a sixth of a sample's reading): Adler-32's low 16 bits are 1 plus
    the bytes' sum modulo 65521, exact for 256 bytes (at most 65,280), so each half gives its sum."""
    field = header[148:156].split(b"\0", 1)[0].strip()
    total = (zlib.adler32(header[:256]) & 0xFFFF) + (zlib.adler32(header[256:]) & 0xFFFF) - 2
    if not field or int(field, 8) != total - sum(header[148:156]) + 8 * 32:
        raise tarfile.ReadError("bad checksum in a tar header: not a tar, or a corrupt one")


def _tarfile_members(header: bytes, stream: BinaryIO) -> Iterator[tuple[str, bytes]]:
    tar = tarfile.open(fileobj=_Prepended(header, stream), mode="r|")  # type: ignore[call-overload]
    for info in tar:
        if info.isreg():
            file = tar.extractfile(info)
            assert file is not None
            yield info.name, file.read()
        tar.members = []  # stream mode: keep no list of what went by


class _Prepended:
    """`head`, then the rest of `stream`: what tarfile's stream mode reads from."""

    def __init__(self, head: bytes, stream: BinaryIO):
        self.head, self.stream = head, stream

    def read(self, size: int = -1) -> bytes:
        if not self.head:
            return self.stream.read(size)
        if size < 0:
            out, self.head = self.head + self.stream.read(), b""
            return out
        out, self.head = self.head[:size], self.head[size:]
        return out
