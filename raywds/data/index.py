"""`raywds index`: a raywds manifest for WebDataset shards anyone wrote, without rewriting a byte.

Each shard is read once, by raywds.data.tars.Entries. A local one is walked from header to
header over an unbuffered file (the headers and the small label members read, the rest seeked
past), so a shard of photos is indexed from 2-3% of its bytes; an http(s), s3://, gs:// or `pipe:`
one is streamed in large sequential reads (a ranged GET per member is a round trip each) and
hashed on the way (not with --skip-hash). Shards are indexed in parallel threads. What it records
per shard: samples, bytes, sha256 (when streamed), a stamp (ETag or mtime) and the first key,
which the loader checks when it opens the shard; where `_info.json` (timm, the Hugging Face Hub)
gives counts, they are checked.

Keys are webdataset's: everything after the first dot of a member's basename is its extension.
Labels come from an integer member (`cls`, `label`, `target`, or `--label-key`), a field of the
`json` member (`--label-field`), with class names from `_info.json`, `--classes FILE`, or `0..K-1`.

    manifest = index_shards({"train": expand(["shards/train-{0000..0099}.tar"])}, IndexOptions())
    write_index(manifest, out=None)     # raywds.data.dataset: beside the shards, or --out
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO

from raywds.data import shardlists, stores, tars
from raywds.data.http import ReadPolicy
from raywds.data.manifest import FORMAT, TIMM_INFO
from raywds.data.members import IMAGE_KEYS, Rules, Strict, class_names
from raywds.data.shardoptions import IndexOptions
from raywds.data.stores import Storage
from raywds.errors import DataError

log = logging.getLogger(__name__)


@dataclass
class Shard:
    """What indexing one shard found."""

    url: str
    num_samples: int = 0
    num_bytes: int = 0
    sha256: str = ""
    stamp: str = ""
    first_key: str = ""
    labels: list[Any] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_read: int = 0
    error: str = ""


class _Counting:
    """A file's reads counted (and hashed, when streamed whole); seeks passed through otherwise."""

    def __init__(self, raw: BinaryIO, hashing: bool):
        self.raw, self.count = raw, 0
        self.hash = hashlib.sha256() if hashing else None

    def seekable(self) -> bool:
        return self.hash is None and self.raw.seekable()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.count += len(data)
        if self.hash is not None:
            self.hash.update(data)
        return data


def index_shard(url: str, rules: Rules, policy: ReadPolicy) -> Shard:
    """Read one shard's keys and labels; its problems go into `error` (the shard) or `skipped` (samples)."""
    shard = Shard(url)
    local = stores.scheme(url) == stores.LOCAL
    try:
        shard.num_bytes, shard.stamp = Storage.of(policy).stat(url, policy.read_timeout_s)
        raw: BinaryIO = (
            open(stores.local_path(url), "rb", buffering=0) if local else stores.open_shard(url, policy)  # type: ignore[assignment]
        )
        with contextlib.closing(raw):
            counting = _Counting(raw, hashing=not local and not rules.options.skip_hash)
            walk = tars.Entries(counting, wanted=rules.wanted)  # type: ignore[arg-type]
            for sample in tars.samples(walk):
                _add(shard, sample, rules)
            if walk.end is None:
                raise tarfile.ReadError("it ends without the end-of-archive block: cut short")
            if counting.hash is not None:
                while counting.read(1 << 20):  # the closing blocks count in the sha256 too
                    pass
                shard.sha256 = counting.hash.hexdigest()
                if shard.num_bytes < 0:  # a pipe: command: its size is what came
                    shard.num_bytes = counting.count
            shard.bytes_read = counting.count
    except Strict:
        raise  # stops the whole index, not only this shard
    except DataError as e:
        shard.error = str(e) if url in str(e) else f"shard {url}: {e}"
    except FileNotFoundError:
        shard.error = f"shard {url}: no such file or object"
    except (OSError, tarfile.TarError, EOFError) as e:
        shard.error = f"shard {url}: cannot read it as a tar ({e}); a truncated or damaged shard"
    if not shard.error and shard.num_samples == 0:
        first = shard.skipped[0].split(": ", 1)[-1] if shard.skipped else "it is empty"
        shard.error = (
            f"shard {url}: holds no sample with an image and a label ({first}); "
            "say which members hold them with --image-key, --label-key or --label-field (then `raywds index`)"
        )
    return shard


def _add(shard: Shard, sample: tars.Sample, rules: Rules) -> None:
    why = ""
    try:
        image = rules.image(sample.key, sample.exts)
    except DataError as e:
        raise DataError(f"shard {shard.url}: {e}") from None
    if image is None:
        why = f"no image member (found {', '.join(sample.exts)})"
    elif rules.label_key(sample.exts) is None or sample.label is None:
        why = f"no label member ({' or '.join(rules.label_keys)}; found {', '.join(sample.exts)})"
    else:
        try:
            shard.labels.append(rules.label(sample.label))
        except (ValueError, KeyError, UnicodeDecodeError) as e:
            why = f"label unreadable ({e})"
    if why:
        line = f"shard {shard.url}: sample {sample.key}: {why}"
        if rules.options.strict:
            raise Strict(f"{line} (--strict)")
        shard.skipped.append(line)
        return
    if not shard.first_key:
        shard.first_key = sample.key
    shard.num_samples += 1


def _info(where: str, storage: Storage) -> dict[str, Any] | None:
    """`_info.json` beside the shards (timm's and the Hub's), or None."""
    if stores.scheme(where) == stores.PIPE:
        return None
    try:
        return json.loads(storage.read(stores.join(where, TIMM_INFO)))  # type: ignore[no-any-return]
    except (FileNotFoundError, DataError, ValueError, OSError):
        return None


def _check_info(info: dict[str, Any], found: dict[str, list[Shard]]) -> list[str]:
    """Where `_info.json`'s counts disagree with the shards, one line each."""
    lines = []
    by_name = {s.url.rsplit("/", 1)[-1]: s for shards in found.values() for s in shards}
    for split in (info.get("splits") or {}).values():
        for name, count in zip(split.get("filenames", []), split.get("shard_lengths", [])):
            shard = by_name.get(name)
            if shard is not None and shard.num_samples + len(shard.skipped) != count:
                lines.append(f"{TIMM_INFO} says {name} holds {count} samples; it holds {shard.num_samples}")
    return lines


def index_shards(
    splits: dict[str, list[str]],
    options: IndexOptions,
    *,
    policy: ReadPolicy | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    """The manifest (as `manifest.json` holds it) for shards by split; DataError naming every
    unreadable shard unless `options.skip_bad_shards`. `progress(shard)` hears of each shard."""
    policy = policy or ReadPolicy()
    rules = Rules(options)
    splits = {split: [_absolute(u) for u in shards] for split, shards in splits.items()}
    start = time.perf_counter()
    urls = [u for shards in splits.values() for u in shards]
    if not urls:
        raise DataError("no shards to index")
    base, names = shardlists.common_base(urls)
    done = _read_all(urls, rules, policy, progress)
    bad = [s for s in done.values() if s.error]
    if bad and not options.skip_bad_shards:
        lines = "\n".join(f"  {s.error}" for s in bad[:20])
        raise DataError(
            f"{len(bad)} of {len(urls)} shards cannot be indexed; no manifest written "
            f"(--skip-bad-shards leaves them out):\n{lines}"
        )
    found = {split: [done[u] for u in shards if not done[u].error] for split, shards in splits.items()}
    storage = Storage.of(policy)
    info = _info(base, storage)
    disagree = _check_info(info, found) if info else []
    if disagree:
        raise DataError(f"{len(disagree)} shards disagree with {TIMM_INFO}: {disagree[0]}; is {TIMM_INFO} stale?")
    labels = [label for shards in found.values() for s in shards for label in s.labels]
    classes, by_name = class_names(options, info, labels, storage)
    members = {
        "image": [options.image_key] if options.image_key else list(IMAGE_KEYS),
        "label": rules.label_keys[0] if len(rules.label_keys) == 1 else "",
        "label_keys": list(rules.label_keys),
        "label_field": options.label_field,
        "label_names": by_name,
        "drop_incomplete": True,
    }
    made_by = {
        "tool": "raywds index",
        "options": asdict(options),
        "seconds": round(time.perf_counter() - start, 3),
        "bytes_read": sum(s.bytes_read for s in done.values()),
        "bytes_in_shards": sum(max(0, s.num_bytes) for s in done.values()),
    }
    return {
        "format": FORMAT,
        "classes": classes,
        "members": members,
        "shards_at": base,
        "splits": {split: _split(shards, dict(zip(urls, names))) for split, shards in found.items() if shards},
        "made_by": made_by,
        "skipped": [line for s in done.values() for line in s.skipped],
        "bad_shards": [s.error for s in bad],
    }


def _read_all(urls: list[str], rules: Rules, policy: ReadPolicy, progress: Any) -> dict[str, Shard]:
    """Each shard indexed, by URL, in threads (reading is I/O; the local walk seeks)."""
    done: dict[str, Shard] = {}
    with ThreadPoolExecutor(max(1, min(rules.options.workers, len(urls)))) as pool:
        for shard in pool.map(lambda u: index_shard(u, rules, policy), urls):
            done[shard.url] = shard
            if progress is not None:
                progress(shard)
    return done


def _split(shards: list[Shard], name_of: dict[str, str]) -> dict[str, Any]:
    """A split's entry in the manifest: its shards, and what the loader checks them by."""
    return {
        "num_samples": sum(s.num_samples for s in shards),
        "shards": [
            {"name": name_of[s.url], "num_samples": s.num_samples, "num_bytes": s.num_bytes, "sha256": s.sha256}
            for s in shards
        ],
        "first_keys": {name_of[s.url]: s.first_key for s in shards},
        "stamps": {name_of[s.url]: s.stamp for s in shards},
    }


def _absolute(url: str) -> str:
    return os.path.abspath(stores.local_path(url)) if stores.scheme(url) == stores.LOCAL else url
