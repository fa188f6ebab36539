"""`--data`: the manifest a run trains on. A folder, file or prefix with a manifest is read as it
is; shards named as WebDataset users name them (a brace list, a glob, a `pipe:` template, or a
folder or prefix of shards without a manifest) are indexed once (raywds.data.index) into a cache
keyed by the URLs, and reused while every shard keeps its size and stamp.

    manifest = manifest_for("https://host/imagenet-train-{000000..001281}.tar")
    manifest = manifest_of(cfg)                  # cfg.data and cfg.val_data, cfg.index_cache
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from raywds.data import shardlists, stores
from raywds.data.columns import COLUMNS
from raywds.data.index import index_shards
from raywds.data.manifest import MANIFEST, Manifest, read_manifest, shard_url, split_location, write_manifest
from raywds.data.shardlists import split_by_name
from raywds.data.shardoptions import IndexOptions
from raywds.data.source import Source
from raywds.data.stores import Storage, write_atomic
from raywds.errors import DataError

log = logging.getLogger(__name__)

CACHE = "RAYWDS_INDEX_CACHE"

_SHARDS = re.compile(r"\{[^}]*(\.\.|,)[^}]*\}|[*?\[]")


def names_shards(data: str) -> bool:
    """Whether --data names shards (braces, a glob, a .tar, a pipe: command), not a manifest's place."""
    return stores.scheme(data) == stores.PIPE or bool(_SHARDS.search(data)) or data.endswith(shardlists.SHARD_SUFFIX)


def cache_dir(given: str | None = None) -> Path:
    """Where indexes of --data are kept: --index-cache, RAYWDS_INDEX_CACHE, else ~/.cache/raywds/index."""
    root = (
        given
        or os.environ.get(CACHE)
        or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "raywds", "index")
    )
    return Path(root)


def manifest_of(cfg: Source, *, trusted: bytes | None = None) -> Manifest:
    """The manifest a run trains on (`manifest_for` its --data and --val-data). `trusted`: the
    manifest the run's driver indexed --data into (`raywds ray`, `index_of`), put into this node's
    cache and read as it is: a worker on another node neither indexes the shards again nor asks
    the store about each of them (1,024 requests a rank for ImageNet, at every start)."""
    if trusted is not None:
        folder = _folder(cfg.data, cfg.val_data, cfg.index_cache, IndexOptions())
        if not (folder / MANIFEST).is_file() or (folder / MANIFEST).read_bytes() != trusted:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / COLUMNS).unlink(missing_ok=True)  # another index's columns: the JSON is the manifest
            write_atomic(folder / MANIFEST, trusted)
        return read_manifest(str(folder), storage=cfg.storage)
    return manifest_for(
        cfg.data,
        val_data=cfg.val_data,
        shards_at=cfg.shards_at,
        storage=cfg.storage,
        index_cache=cfg.index_cache,
    )


def manifest_for(
    data: str,
    *,
    val_data: str | None = None,
    shards_at: str | None = None,
    storage: Storage = Storage(),
    index_cache: str | None = None,
    options: IndexOptions | None = None,
) -> Manifest:
    """The manifest for --data: the one at that folder, file or prefix; else (shards named as
    WebDataset users name them, or a folder of shards with no manifest) an index of them, made once
    into the cache and reused while every shard keeps its size and stamp."""
    if not needs_index(data, val_data, storage):
        return read_manifest(data, shards_at=shards_at, storage=storage)
    options = options or IndexOptions()
    specs = _specs(data, val_data, options)
    folder = _folder(data, val_data, index_cache, options)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks on one node index once; the others wait and read it
        if (folder / MANIFEST).is_file():
            changed = _changed(folder / MANIFEST, storage)
            if not changed:
                return read_manifest(str(folder), storage=storage)
            log.warning(
                "%d shards changed since they were indexed (%s): indexing %s again",
                len(changed),
                ", ".join(changed[:5]),
                data,
            )
        started = time.perf_counter()
        if val_data is not None:
            splits = {"train": shardlists.expand([data], storage), "val": shardlists.expand([val_data], storage)}
        else:
            splits = split_by_name(shardlists.expand([data], storage))
        manifest = index_shards(splits, options, policy=storage.read_policy())
        write_manifest(folder, {**manifest, "indexed_from": specs})
        counts = ", ".join(f"{len(v['shards'])} {k} shards" for k, v in manifest["splits"].items())
        log.info(
            "indexed %s (%s, %s samples) in %.1f s into %s; reused while the shards stay as they are",
            data,
            counts,
            sum(v["num_samples"] for v in manifest["splits"].values()),
            time.perf_counter() - started,
            folder,
        )
    return read_manifest(str(folder), storage=storage)


def needs_index(data: str, val_data: str | None, storage: Storage) -> bool:
    """Whether --data names shards to index (else it names a manifest, or a place that lacks one)."""
    if val_data is not None or names_shards(data):
        return True
    _, where = _manifest_place(data)
    if where is None or stores.scheme(data) == stores.HTTP or _exists(where, storage):
        return False
    try:
        shardlists.expand([data], storage)
    except shardlists.NoShards:  # a folder or prefix with neither a manifest nor shards: say what to run
        return False
    return True


def index_of(cfg: Source) -> bytes | None:
    """The manifest.json this node indexed the run's --data into (after `manifest_of`), for the
    run's other nodes (`manifest_of(trusted=)`); None where --data names a manifest."""
    if not needs_index(cfg.data, cfg.val_data, cfg.storage):
        return None
    path = _folder(cfg.data, cfg.val_data, cfg.index_cache, IndexOptions()) / MANIFEST
    return path.read_bytes() if path.is_file() else None


def cached_index(data: str, storage: Storage = Storage(), index_cache: str | None = None) -> Path | None:
    """The cache folder holding the index made for `--data data` (the shards as a run names them),
    as it is, not made anew; None where `data` names a manifest's place rather than shards."""
    if not needs_index(data, None, storage):
        return None
    folder = _folder(data, None, index_cache, IndexOptions())
    if not (folder / MANIFEST).is_file():
        raise DataError(
            f"{data} names shards that have no manifest, and {cache_dir(index_cache)} holds no index of them "
            f"(give the run's --data as it was typed, and --index-cache or {CACHE} as the run had them): "
            f"`raywds index {data}` writes a manifest for them"
        )
    return folder


def _folder(data: str, val_data: str | None, index_cache: str | None, options: IndexOptions) -> Path:
    """The cache entry of an index: keyed by the shards as named and the options."""
    key = hashlib.sha256(json.dumps(_specs(data, val_data, options), sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir(index_cache) / key


def _specs(data: str, val_data: str | None, options: IndexOptions) -> dict[str, Any]:
    """What an index was made from (kept in it as `indexed_from`, and its cache key)."""
    return {"data": data, "val_data": val_data, "options": asdict(options)}


def _manifest_place(data: str) -> tuple[str, str | None]:
    try:
        return split_location(data)
    except DataError:
        return data, None


def _exists(where: str, storage: Storage) -> bool:
    try:
        storage.stat(where)
    except FileNotFoundError:
        return False
    return True


def _changed(path: Path, storage: Storage) -> list[str]:
    """The shards of a cached index whose size or stamp is not what was indexed."""
    raw = json.loads(path.read_bytes())
    base = raw.get("shards_at") or str(path.parent)
    entries = [
        (shard_url(base, s["name"]), s, info["stamps"].get(s["name"], ""))
        for info in raw["splits"].values()
        for s in info["shards"]
    ]

    def moved(entry: tuple[str, dict[str, Any], str]) -> str | None:
        url, shard, stamp = entry
        try:
            size, now = storage.stat(url)
        except (FileNotFoundError, DataError, OSError):
            return url
        if size < 0:
            return None  # a pipe: command: nothing to compare without reading it
        return url if size != shard["num_bytes"] or (stamp and now and now != stamp) else None

    with ThreadPoolExecutor(16) as pool:
        return [url for url in pool.map(moved, entries) if url is not None]


def write_index(manifest: dict[str, Any], out: str | None, storage: Storage = Storage()) -> str:
    """Write the manifest beside the shards when that folder or prefix takes it, else to `out`
    (a folder or a bucket prefix); the location written."""
    base = manifest["shards_at"]
    places = [out] if out else []
    if not out and stores.scheme(base) in (stores.LOCAL, stores.S3, stores.GS):
        places.append(base)
    if not places:
        raise DataError(f"shards at {base} cannot have a manifest beside them: give --out DIR (a folder or bucket)")
    place = places[0]
    if stores.scheme(place) == stores.LOCAL:
        folder = Path(stores.local_path(place))
        if not out and not os.access(folder, os.W_OK):
            raise DataError(f"{folder} is read-only: give --out DIR for the manifest (it records where the shards are)")
        folder.mkdir(parents=True, exist_ok=True)
        write_manifest(folder, _placed(manifest, str(folder.resolve())))
        return str(folder / MANIFEST)
    where = stores.join(place, MANIFEST)
    text = json.dumps(_placed(manifest, place), indent=1) + "\n"
    storage.write(where, text.encode())
    return where


def _placed(manifest: dict[str, Any], place: str) -> dict[str, Any]:
    """The manifest as written at `place`: `shards_at` only where the shards live elsewhere."""
    base = manifest["shards_at"]
    if stores.scheme(base) == stores.LOCAL:
        base = str(Path(base).resolve())
    if base.rstrip("/") == place.rstrip("/"):
        return {k: v for k, v in manifest.items() if k != "shards_at"}
    return {**manifest, "shards_at": base}


def summary(manifest: dict[str, Any], where: str) -> list[str]:
    """What `raywds index` says of the manifest it wrote at `where`."""
    made = manifest["made_by"]
    lines = [
        f"{split}: {info['num_samples']} samples in {len(info['shards'])} shards"
        for split, info in manifest["splits"].items()
    ]
    if manifest["skipped"]:
        lines.append(
            f"skipped {len(manifest['skipped'])} samples without an image or a label (listed in the manifest):"
        )
        lines += [f"  {line}" for line in manifest["skipped"][:10]]
    lines += [f"left out: {line}" for line in manifest["bad_shards"]]
    share = made["bytes_read"] / max(1, made["bytes_in_shards"])
    lines.append(
        f"raywds: wrote {where} ({len(manifest['classes'])} classes; read {made['bytes_read']:,} of "
        f"{made['bytes_in_shards']:,} bytes, {share:.1%}, in {made['seconds']:.2f} s)"
    )
    return lines
