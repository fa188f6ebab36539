"""raywds.data.tars against webdataset's own tar reading: the same members from every kind of tar
tarfile writes, and errors, not silent garbage, from broken ones."""

from __future__ import annotations

import io
import tarfile

import pytest
import webdataset as wds

from raywds.data.tars import BLOCK, Entries, key_and_ext, members, tar_files


def tar_bytes(
    entries: list[tuple[str, bytes | None]], fmt: int = tarfile.PAX_FORMAT, mtime: float = 1_700_000_000
) -> bytes:
    """A tar of `entries`: (name, data) files, (name, None) directories, `name -> target` links."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.mtime = mtime  # type: ignore[assignment]
            if data is None and " -> " in name:
                info.name, info.linkname = name.split(" -> ")
                info.type = tarfile.SYMTYPE
                tar.addfile(info)
            elif data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def webdataset_members(data: bytes) -> list[tuple[str, bytes]]:
    return [(m["fname"], m["data"]) for m in wds.tariterators.tar_file_iterator(io.BytesIO(data))]


SAMPLES = [
    ("a/000.jpg", b"\xff\xd8" + bytes(range(256)) * 3),
    ("a/000.cls", b"7"),
    ("a/000.json", b"{}"),
    ("a/001.jpg", b""),
    ("a/001.cls", b"x" * 512),
]
LONG = "d" * 90 + "/" + "e" * 60 + "/sample.jpg"  # over 100 bytes: ustar's prefix field, or a pax/GNU long name


@pytest.mark.parametrize(
    "entries,fmt,mtime",
    [
        (SAMPLES, tarfile.PAX_FORMAT, 1_700_000_000),  # what webdataset's TarWriter writes
        (SAMPLES, tarfile.GNU_FORMAT, 1_700_000_000),
        ([(LONG, b"long"), *SAMPLES], tarfile.USTAR_FORMAT, 1_700_000_000),  # the ustar prefix
        ([(LONG, b"long"), *SAMPLES], tarfile.GNU_FORMAT, 1_700_000_000),  # a GNU long-name member: tarfile takes over
        (
            [*SAMPLES, ("b/ünï.jpg", b"non-ascii"), (LONG, b"long")],
            tarfile.PAX_FORMAT,
            1_700_000_000,
        ),  # pax headers midway
        (SAMPLES, tarfile.PAX_FORMAT, 1_700_000_000.5),  # a fractional mtime: a pax header on every member
        (
            [("a/", None), *SAMPLES[:2], ("a/link.jpg -> 000.jpg", None), *SAMPLES[2:]],
            tarfile.PAX_FORMAT,
            1_700_000_000,
        ),
        ([("__meta__", b"skipped"), *SAMPLES], tarfile.PAX_FORMAT, 1_700_000_000),
    ],
    ids=["pax", "gnu", "ustar-prefix", "gnu-longname", "pax-midway", "pax-every-member", "dirs-and-links", "meta"],
)
def test_members_are_webdatasets(entries: list[tuple[str, bytes | None]], fmt: int, mtime: float) -> None:
    data = tar_bytes(entries, fmt, mtime)
    expected = webdataset_members(data)
    assert expected, "the tar must have regular files"
    got = [(name, content) for name, content in members(io.BytesIO(data)) if not name.startswith("__")]
    assert got == expected


class Trickle(io.RawIOBase):
    """A raw stream that returns at most 100 bytes a read, as sockets and pipes may."""

    def __init__(self, data: bytes):
        self.data = memoryview(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        n = min(len(buffer), 100, len(self.data))
        buffer[:n], self.data = self.data[:n], self.data[n:]
        return n


def test_short_reads_are_completed() -> None:
    data = tar_bytes(SAMPLES)
    assert list(members(Trickle(data))) == webdataset_members(data)  # type: ignore[arg-type]


def test_broken_tars_raise() -> None:
    data = tar_bytes(SAMPLES)
    with pytest.raises(tarfile.ReadError, match="unexpected end"):
        list(members(io.BytesIO(data[:700])))  # cut inside the first member's data
    corrupt = bytearray(data)
    second = BLOCK + -(-len(SAMPLES[0][1]) // BLOCK) * BLOCK  # the second member's header
    corrupt[second + 5] ^= 0xFF  # a byte of its name
    with pytest.raises(tarfile.ReadError, match="checksum"):
        list(members(io.BytesIO(bytes(corrupt))))
    with pytest.raises(tarfile.ReadError, match="checksum"):
        list(members(io.BytesIO(b"<html><body>502 Bad Gateway</body></html>".ljust(1024, b" "))))
    assert list(members(io.BytesIO(b""))) == [], "an empty stream is an empty tar"


def test_tar_files_marks_shard_ends_and_hands_failures_to_the_handler() -> None:
    good, bad = tar_bytes(SAMPLES), b"not a tar".ljust(512, b"!")
    failures: list[BaseException] = []

    def go_on(exn: BaseException) -> bool:
        failures.append(exn)
        return True

    sources = [
        {"url": "one", "stream": io.BytesIO(good)},
        {"url": "bad", "stream": io.BytesIO(bad)},
        {"url": "two", "stream": io.BytesIO(good)},
    ]
    out = list(tar_files(sources, go_on))
    assert [m.get("__url__") for m in out] == ["one"] * 5 + [None] + ["two"] * 5 + [None]
    assert out[5] == {} and out[0]["fname"] == "a/000.jpg"
    assert len(failures) == 1 and "bad" in failures[0].args

    sources = [{"url": "bad", "stream": io.BytesIO(bad)}, {"url": "two", "stream": io.BytesIO(good)}]
    assert list(tar_files(sources, lambda exn: False)) == [], "a handler that says stop stops"
    grouped = list(wds.tariterators.group_by_keys(tar_files([{"url": "one", "stream": io.BytesIO(good)}], go_on)))
    assert [s["__key__"] for s in grouped] == ["a/000", "a/001"] and grouped[1]["cls"] == b"x" * 512


def test_keys_split_as_webdatasets() -> None:
    names = ["a/000.jpg", "a/000.seg.png", "n01/x_1.JPEG", "noext", "a/.hidden", "a.b/c.d", "a.b/noext", ".x", "a/b/"]
    assert [key_and_ext(n) for n in names] == [wds.tariterators.base_plus_ext(n) for n in names]


def test_entries_give_each_members_first_header_and_seek_past_what_is_not_wanted() -> None:
    """Offsets are where a member's first header starts (its pax header, where it has one): a
    reader seeking there reads the member; only wanted members are read, the rest seeked past;
    the end-of-archive block's place is known, and a stream that stops early has none."""
    data = tar_bytes(SAMPLES, tarfile.PAX_FORMAT, 1_700_000_000.5)  # a pax header before every member
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        infos = [m for m in tar.getmembers() if m.isreg()]

    class Counting(io.BytesIO):
        read_bytes = 0

        def read(self, size: int | None = -1) -> bytes:
            out = super().read(size)
            Counting.read_bytes += len(out)
            return out

    stream = Counting(data)
    walk = Entries(stream, wanted=lambda name, size: name.endswith(".cls"))
    got = list(walk)
    assert [(n, s) for n, _, s, _ in got] == [(m.name, m.size) for m in infos]
    assert [d for n, _, _, d in got if n.endswith(".cls")] == [b"7", b"x" * 512]
    assert all(d is None for n, _, _, d in got if not n.endswith(".cls"))
    for (name, offset, _, _), info in zip(got, infos):
        assert offset == info.offset and info.offset_data - offset == 3 * BLOCK, name  # pax header, its data, header
        assert next(iter(Entries(io.BytesIO(data[offset:]))))[0] == name, "a reader can start at the offset"
    assert walk.end is not None and not any(data[walk.end : walk.end + BLOCK])
    assert Counting.read_bytes < len(data) // 2, "the jpg members' data was not read"
    cut = list(Entries(io.BytesIO(data[: walk.end])))
    assert len(cut) == len(infos), "a tar cut before its end block reads the same members"
    cut_walk = Entries(io.BytesIO(data[: walk.end]))
    list(cut_walk)
    assert cut_walk.end is None, "but says it never saw its end"
