"""manifest.npz, the manifest's shard lists as columns beside manifest.json (raywds.data.columns):
read instead of the JSON only while made from that JSON, the same manifest either way, and kept
in step by `raywds verify`."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from raywds.data.columns import COLUMNS, ShardInfo, ShardTable, load, table, to_bytes
from raywds.data.manifest import FORMAT, MANIFEST, Manifest, read_manifest, write_manifest
from raywds.data.verify import verify
from raywds.errors import DataError
from raywds.serve.server import ShardServer


def same_manifest(a: Manifest, b: Manifest) -> None:
    assert a.classes == b.classes and sorted(a.splits) == sorted(b.splits)
    for split in a.splits:
        assert list(a.shards(split)) == list(b.shards(split))
        assert a.num_samples(split) == b.num_samples(split) and a.fingerprint(split) == b.fingerprint(split)


@pytest.fixture
def folder(shards: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    return copy


def test_convert_writes_columns_that_read_as_the_json_does(folder: Path) -> None:
    assert (folder / COLUMNS).is_file()
    fast, plain = read_manifest(str(folder)), read_manifest(str(folder), use_columns=False)
    assert isinstance(fast.splits["train"], ShardTable) and isinstance(plain.splits["train"], list)
    same_manifest(fast, plain)
    assert len(fast.shards("train")) == 8 and fast.num_samples("train") == 120


def test_columns_made_from_another_json_are_not_read_and_verify_writes_them_anew(folder: Path) -> None:
    raw = json.loads((folder / MANIFEST).read_text())
    dropped = raw["splits"]["train"]["shards"].pop()
    raw["splits"]["train"]["num_samples"] -= dropped["num_samples"]
    (folder / MANIFEST).write_text(json.dumps(raw, indent=1))  # edited by hand; the columns still list it
    edited = read_manifest(str(folder))
    assert isinstance(edited.splits["train"], list) and dropped["name"] not in [s.name for s in edited.shards("train")]
    assert verify(folder) == (11, [])
    again = read_manifest(str(folder))
    assert isinstance(again.splits["train"], ShardTable)
    same_manifest(again, edited)


def test_unreadable_columns_fall_back_to_the_json_and_verify_mends_them(folder: Path) -> None:
    (folder / COLUMNS).write_bytes(b"not a zip at all")
    assert isinstance(read_manifest(str(folder)).splits["train"], list)
    assert verify(folder) == (12, [])
    assert isinstance(read_manifest(str(folder)).splits["train"], ShardTable)


def test_a_manifest_served_over_http_is_read_from_its_columns(folder: Path) -> None:
    with ShardServer(folder, backend="embedded") as server:
        served = read_manifest(server.url)
        assert isinstance(served.splits["train"], ShardTable)
        same_manifest(served, read_manifest(str(folder), use_columns=False))


def test_a_table_indexes_slices_and_iterates_as_a_list_does() -> None:
    shards = [
        ShardInfo("ü-000.tar", 3, 100, ""),  # non-ASCII: byte ends are not character ends
        ShardInfo("a+b-001.tar", 0, 0, "ab" * 32),
        *(ShardInfo(f"s-{i:05d}.tar", i, 10 * i, f"{i + 1:064x}") for i in range(9000)),  # more than one chunk
    ]
    cols = table(shards)
    assert list(cols) == shards and len(cols) == len(shards)
    assert (
        cols[0] == shards[0] and cols[-1] == shards[-1] and cols[1:4] == shards[1:4] and cols[::3000] == shards[::3000]
    )
    with pytest.raises(IndexError):
        cols[len(shards)]
    assert cols.plain_names()


@pytest.mark.parametrize("name", [".hidden.tar", "../b.tar", "a//b.tar", "a/.b.tar", "x;rm -rf .tar", ""])
def test_columns_with_a_name_that_is_no_plain_file_name_are_refused_as_the_json_is(tmp_path: Path, name: str) -> None:
    shards = [{"name": "fine-0.tar", "num_samples": 1, "num_bytes": 1, "sha256": ""}]
    shards.append({"name": name, "num_samples": 1, "num_bytes": 1, "sha256": ""})
    raw = {"format": FORMAT, "classes": ["a"], "splits": {"train": {"num_samples": 2, "shards": shards}}}
    write_manifest(tmp_path, raw)
    assert not table([ShardInfo(**s) for s in shards]).plain_names()
    for use_columns in (True, False):
        with pytest.raises(DataError, match="names a shard"):
            read_manifest(str(tmp_path), use_columns=use_columns)


@contextmanager
def counted() -> Iterator[Counter[str]]:
    """What reading a manifest does inside the block, counted as it happens (the real functions
    run): the characters `json.loads` is given (`parsed`) and the ShardInfo records made (`records`)."""
    work: Counter[str] = Counter()
    loads, new, make = json.loads, ShardInfo.__new__, ShardInfo._make

    def counted_loads(text: str | bytes, *args: Any, **kwargs: Any) -> Any:
        work["parsed"] += len(text)
        return loads(text, *args, **kwargs)

    def counted_new(cls: type, *args: Any, **kwargs: Any) -> ShardInfo:
        work["records"] += 1
        return new(cls, *args, **kwargs)

    def counted_make(cls: type, iterable: Any) -> ShardInfo:
        work["records"] += 1
        return make(iterable)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(json, "loads", counted_loads)
        patch.setattr(ShardInfo, "__new__", counted_new)
        patch.setattr(ShardInfo, "_make", classmethod(counted_make))
        yield work


def test_at_100k_shards_the_columns_load_without_parsing_the_json_or_making_a_record(tmp_path: Path) -> None:
    """100,000 shards (a quarter of LAION-400M's): read from its columns the manifest parses only
    its few bytes outside the shard lists, makes no shard's record until one is asked for, and
    holds at most 12.5 MB at its peak (50 MB at 400,000: benchmarks/state_scale.py); the JSON
    parses every byte and makes every record. How much faster that is: benchmarks/manifest_bench.py."""
    shards = [
        {"name": f"laion-{i:06d}.tar", "num_samples": 950 + i % 100, "num_bytes": 10**8 + i, "sha256": f"{i:064x}"}
        for i in range(100_000)
    ]
    total = sum(s["num_samples"] for s in shards)
    write_manifest(
        tmp_path, {"format": FORMAT, "classes": ["a"], "splits": {"train": {"num_samples": total, "shards": shards}}}
    )
    json_size = (tmp_path / MANIFEST).stat().st_size
    assert (tmp_path / COLUMNS).stat().st_size < json_size / 2
    work: dict[bool, Counter[str]] = {}
    peak: dict[bool, int] = {}
    for use_columns in (True, False):
        with counted() as work[use_columns]:
            tracemalloc.start()
            manifest = read_manifest(str(tmp_path), use_columns=use_columns)
            peak[use_columns] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert manifest.num_samples("train") == total
        del manifest
    assert work[False]["parsed"] >= json_size and work[False]["records"] == len(shards), work
    assert work[True]["parsed"] < 1000 and work[True]["records"] == 0, work
    assert peak[True] <= 12.5e6 and peak[True] * 5 <= peak[False], peak


def test_columns_hold_the_manifest_without_its_shard_lists_and_the_size_of_the_json() -> None:
    raw = {"format": FORMAT, "classes": ["a"], "seed": 3, "splits": {"train": {"num_samples": 0, "shards": []}}}
    rest, splits, json_size = load(to_bytes(raw, 123))
    assert rest == raw | {"splits": {"train": {"num_samples": 0}}} and json_size == 123 and list(splits["train"]) == []
