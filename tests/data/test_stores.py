"""The scheme table (raywds.data.stores.STORES): each kind of location has its class of store, which
the functions every command uses ask; what a store cannot do is one line naming what can."""

from __future__ import annotations

from pathlib import Path

import pytest

from raywds.data.http import ReadPolicy
from raywds.data.stores import (
    GS,
    HTTP,
    LOCAL,
    PIPE,
    S3,
    SCHEMES,
    STORES,
    S3Store,
    Storage,
    open_shard,
    scheme,
)
from raywds.errors import DataError

EXAMPLES = {
    LOCAL: "/data/shards",
    HTTP: "https://host/shards/",
    S3: "s3://bucket/shards/",
    GS: "gs://bucket/shards/",
    PIPE: "pipe:cat x.tar",
}


def test_every_kind_of_location_has_its_store_and_each_store_says_its_kind() -> None:
    assert set(STORES) == {*SCHEMES.values(), PIPE}
    for kind, example in EXAMPLES.items():
        assert scheme(example) == kind
        found = Storage(s3_endpoint="http://127.0.0.1:8333").at(example)
        assert type(found) is STORES[kind] and found.kind == kind, kind
    assert Storage("http://127.0.0.1:8333").at("s3://b/p") == S3Store("http://127.0.0.1:8333"), "the endpoint inside"
    with pytest.raises(DataError, match=r"does not read ftp:// locations; it reads local paths, file://"):
        Storage().at("ftp://host/x")


def test_what_a_store_cannot_do_is_one_line_naming_what_can() -> None:
    with pytest.raises(DataError, match=r"an http location cannot be listed; name its shards in brace notation"):
        Storage().listing("https://host/shards/")
    with pytest.raises(DataError, match=r"raywds cannot write to pipe locations; write to a folder, s3:// or gs://"):
        Storage().write("pipe:cat x", b"{}")
    with pytest.raises(DataError, match=r"raywds cannot write to http locations"):
        Storage().write("http://host/manifest.json", b"{}")
    with pytest.raises(DataError, match=r"a pipe: command is read as a shard, not as a manifest"):
        Storage().read("pipe:cat manifest.json")
    assert Storage().stat("pipe:cat x.tar") == (-1, "")
    for where in ("https://host/shards/a.tar", "pipe:cat a.tar"):  # an upload of shards is a bucket's
        store = Storage().at(where)
        for name, args in (("check", ()), ("holds", (3, "ab")), ("put_file", ("ab",)), ("delete", ())):
            call = (Path("a.tar"), where, *args) if name == "put_file" else (where, *args)
            with pytest.raises(DataError, match=r"raywds cannot write to (http|pipe) locations; write to a folder"):
                getattr(store, name)(*call)


def test_a_local_store_writes_whole_reads_stats_lists_and_opens(tmp_path: Path) -> None:
    where = f"file://{tmp_path}/deep/manifest.json"
    Storage().write(where, b'{"a": 1}')
    assert Storage().read(where) == b'{"a": 1}'
    size, stamp = Storage().stat(str(tmp_path / "deep" / "manifest.json"))
    assert size == 8 and stamp.startswith("mtime:")
    (tmp_path / "deep" / "b.tar").write_bytes(b"x" * 3)
    assert [(Path(p).name, n) for p, n, _ in Storage().listing(str(tmp_path))] == [("b.tar", 3), ("manifest.json", 8)]
    assert [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")] == [], "no partial file left"
    with open_shard(str(tmp_path / "deep" / "b.tar"), ReadPolicy(), size=3) as stream:
        assert stream.read() == b"xxx"
    with pytest.raises(DataError, match=r"is 3 bytes, its manifest entry 4"):
        open_shard(str(tmp_path / "deep" / "b.tar"), ReadPolicy(), size=4)
    with open_shard(f"pipe:cat {tmp_path / 'deep' / 'b.tar'}", ReadPolicy()) as stream:
        assert stream.read() == b"xxx"
