"""`raywds index`: a raywds manifest for WebDataset shards anyone wrote, without rewriting a byte.

Each shard is read once. A local one is walked from header to header (tarfile's seeking
reader over an unbuffered file: 512 bytes a member, plus the small label members), so a shard of
photos is indexed from about 2% of its bytes; an http(s), s3://, gs:// or `pipe:` one is
streamed in large sequential reads (a ranged GET per member is a round trip each) and hashed on
the way. Shards are indexed in parallel threads. What it records per shard: samples, bytes,
sha256 (when streamed), a stamp (ETag or mtime) and the first key, which the loader checks when
it opens the shard; where `_info.json` (timm, the Hugging Face Hub) gives counts, they are checked.

Keys are webdataset's: everything after the first dot of a member's basename is its extension.
Labels come from an integer member (`cls`, `label`, `target`, or `--label-key`), a field of the
`json` member (`--label-field`), with class names from `_info.json`, `--classes FILE`, or `0..K-1`.

    manifest = index_shards({"train": expand(["shards/train-{0000..0099}.tar"])}, IndexOptions())
    manifest = manifest_for("https://host/imagenet-train-{000000..001281}.tar")   # --data, cached
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import tarfile
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from raywds.config import TrainConfig
from raywds.data import stores, tars
from raywds.data.http import ReadPolicy
from raywds.data.manifest import FORMAT, MANIFEST, SHARD_NAME, TIMM_INFO, Manifest, read_manifest, write_manifest
from raywds.data.options import IndexOptions
from raywds.errors import DataError

log = logging.getLogger(__name__)

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "tif", "tiff")
"""Image members raywds finds by itself (PIL reads them all; JPEGs keep the region decode)."""
LABEL_KEYS = ("cls", "label", "target", "class", "index")
"""Integer label members raywds finds by itself, the first a sample has."""
SPLIT_NAMES = {"train": ("train",), "val": ("validation", "val", "valid", "test")}
"""Shard names that say their split, when --train and --val are not given."""
CACHE = "RAYWDS_INDEX_CACHE"


@dataclass
class Sample:
    key: str
    offset: int
    exts: list[str] = field(default_factory=list)
    label: bytes | None = None


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


class Strict(DataError):
    """--strict: a sample without an image or a label stops indexing."""


class Rules:
    """Which member of a sample is its image and which its label, as the options say."""

    def __init__(self, options: IndexOptions):
        self.options = options
        if options.label_field and not options.label_key:
            self.label_keys: tuple[str, ...] = ("json",)
        else:
            self.label_keys = (options.label_key,) if options.label_key else LABEL_KEYS

    def image(self, sample: Sample) -> str | None:
        if self.options.image_key:
            return self.options.image_key if self.options.image_key in sample.exts else None
        found = [e for e in sample.exts if e in IMAGE_KEYS]
        if len(found) > 1:
            raise DataError(
                f"sample {sample.key} has {len(found)} image members ({', '.join(found)}): choose one with --image-key"
            )
        return found[0] if found else None

    def wanted(self, name: str, size: int) -> bool:
        """Whether a member's data is read: a label member's (any other is passed over)."""
        return size <= 1 << 20 and tars.key_and_ext(name)[1] in self.label_keys

    def label_key(self, exts: Sequence[str]) -> str | None:
        return next((k for k in self.label_keys if k in exts), None)

    def label(self, data: bytes) -> int | str:
        if self.options.label_field:
            value = json.loads(data)[self.options.label_field]
        else:
            value = data.decode().strip()
        if isinstance(value, int) or (isinstance(value, str) and re.fullmatch(r"-?\d+", value)):
            return int(value)
        if isinstance(value, str):
            return value
        raise ValueError(f"label {value!r} is neither an integer nor a class name")


def _samples(entries: Iterable[tuple[str, int, int, bytes | None]]) -> Iterator[Sample]:
    """The tar's samples, as webdataset groups them (consecutive members of one key), each with its
    first header's offset and the bytes of its label member (the only data read)."""
    current: Sample | None = None
    for name, offset, _, data in entries:
        if tars.SKIP.match(name):
            continue
        key, ext = tars.key_and_ext(name)
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


def index_shard(url: str, rules: Rules, policy: ReadPolicy) -> Shard:
    """Read one shard's keys and labels; its problems go into `error` (the shard) or `skipped` (samples)."""
    shard = Shard(url)
    local = stores.scheme(url) == stores.LOCAL
    try:
        shard.num_bytes, shard.stamp = stores.stat(url, policy.read_timeout_s, policy.s3_endpoint)
        raw: BinaryIO = (
            open(stores.local_path(url), "rb", buffering=0) if local else stores.open_shard(url, policy)  # type: ignore[assignment]
        )
        with contextlib.closing(raw):
            counting = _Counting(raw, hashing=not local and not rules.options.skip_hash)
            walk = tars.Entries(counting, wanted=rules.wanted)  # type: ignore[arg-type]
            for sample in _samples(walk):
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


def _add(shard: Shard, sample: Sample, rules: Rules) -> None:
    why = ""
    try:
        image = rules.image(sample)
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


def split_by_name(urls: Sequence[str]) -> dict[str, list[str]]:
    """Shards sorted into train and val by their names (`*train*`, `*val*`, `*validation*`)."""
    found: dict[str, list[str]] = {}
    for url in urls:
        name = url.rsplit("/", 1)[-1].lower()
        for split, words in SPLIT_NAMES.items():
            if any(re.search(rf"(^|[^a-z]){w}([^a-z]|$)", name) for w in words):
                found.setdefault(split, []).append(url)
                break
        else:
            found.setdefault("train", []).append(url)
    return found


def common_base(urls: Sequence[str]) -> tuple[str, list[str]]:
    """(base, names) such that each URL is manifest.shard_url(base, name): the folder the shards
    share, or for `pipe:` commands a template with `{}` where their names go."""
    prefix = os.path.commonprefix(list(urls))
    suffix = os.path.commonprefix([u[::-1] for u in urls])[::-1] if stores.scheme(urls[0]) == stores.PIPE else ""
    cut = prefix.rfind("/") + 1
    if cut == 0:
        raise DataError(f"shards {urls[0]} … share no folder: index them in groups, one folder each")
    tail = suffix[suffix.find(SHARD_END) + len(SHARD_END) :] if SHARD_END in suffix else ""
    names = [u[cut : len(u) - len(tail)] for u in urls]
    bad = next((n for n in names if not SHARD_NAME.fullmatch(n)), None)
    if bad is not None:
        raise DataError(f"shard name {bad!r} is not a plain file name (letters, digits, . _ + -, folders with /)")
    base = prefix[:cut]
    if stores.scheme(base) == stores.PIPE:
        return f"{base}{{}}{tail}", names
    return (base.rstrip("/") or "/"), names


SHARD_END = ".tar"


def _info(where: str, s3_endpoint: str | None) -> dict[str, Any] | None:
    """`_info.json` beside the shards (timm's and the Hub's), or None."""
    if stores.scheme(where) == stores.PIPE:
        return None
    try:
        return json.loads(stores.read_bytes(stores.join(where, TIMM_INFO), 30.0, s3_endpoint))  # type: ignore[no-any-return]
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


def _classes(options: IndexOptions, info: dict[str, Any] | None, labels: list[Any]) -> tuple[list[str], bool]:
    """(class names in label order, whether the labels are names)."""
    names_given: list[str] | None = None
    if options.classes:
        text = stores.read_bytes(options.classes).decode()
        names_given = [line.strip() for line in text.splitlines() if line.strip()]
    elif info is not None:
        for key in ("classes", "label_names", "class_names"):
            if isinstance(info.get(key), list):
                names_given = [str(c) for c in info[key]]
                break
    by_name = any(isinstance(label, str) for label in labels)
    if by_name:
        if any(isinstance(label, int) for label in labels):
            raise DataError("labels are class names in some samples and integers in others; give one kind")
        names = names_given or sorted({str(label) for label in labels})
        missing = sorted({label for label in labels if label not in set(names)})
        if missing:
            raise DataError(f"labels {missing[:5]} are not in the class list ({len(names)} classes)")
        return names, True
    top = max((int(label) for label in labels), default=-1)
    low = min((int(label) for label in labels), default=0)
    if low < 0:
        raise DataError(f"label {low} is negative; labels are class indices from 0")
    if names_given is not None:
        if top >= len(names_given):
            raise DataError(f"label {top} is past the {len(names_given)} classes of the class list")
        return names_given, False
    num = int(info.get("num_classes", 0)) if info else 0
    return [str(i) for i in range(max(top + 1, num))], False


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
    base, names = common_base(urls)
    name_of = dict(zip(urls, names))
    with ThreadPoolExecutor(max(1, min(options.num_workers, len(urls)))) as pool:
        done: dict[str, Shard] = {}
        for shard in pool.map(lambda u: index_shard(u, rules, policy), urls):
            done[shard.url] = shard
            if progress is not None:
                progress(shard)
    bad = [s for s in done.values() if s.error]
    if bad and not options.skip_bad_shards:
        lines = "\n".join(f"  {s.error}" for s in bad[:20])
        raise DataError(
            f"{len(bad)} of {len(urls)} shards cannot be indexed; no manifest written "
            f"(--skip-bad-shards leaves them out):\n{lines}"
        )
    found = {split: [done[u] for u in shards if not done[u].error] for split, shards in splits.items()}
    info = _info(base, policy.s3_endpoint)
    disagree = _check_info(info, found) if info else []
    if disagree:
        raise DataError(f"{len(disagree)} shards disagree with {TIMM_INFO}: {disagree[0]}; is {TIMM_INFO} stale?")
    labels = [label for shards in found.values() for s in shards for label in s.labels]
    classes, by_name = _classes(options, info, labels)
    members = {
        "image": [options.image_key] if options.image_key else list(IMAGE_KEYS),
        "label": rules.label_keys[0] if len(rules.label_keys) == 1 else "",
        "label_keys": list(rules.label_keys),
        "label_field": options.label_field,
        "label_names": by_name,
        "drop_incomplete": True,
    }
    return {
        "format": FORMAT,
        "classes": classes,
        "members": members,
        "shards_at": base,
        "splits": {
            split: {
                "num_samples": sum(s.num_samples for s in shards),
                "shards": [
                    {"name": name_of[s.url], "num_samples": s.num_samples, "num_bytes": s.num_bytes, "sha256": s.sha256}
                    for s in shards
                ],
                "first_keys": {name_of[s.url]: s.first_key for s in shards},
                "stamps": {name_of[s.url]: s.stamp for s in shards},
            }
            for split, shards in found.items()
            if shards
        },
        "made_by": {
            "tool": "raywds index",
            "options": asdict(options),
            "seconds": round(time.perf_counter() - start, 3),
            "bytes_read": sum(s.bytes_read for s in done.values()),
            "bytes_in_shards": sum(max(0, s.num_bytes) for s in done.values()),
        },
        "skipped": [line for s in done.values() for line in s.skipped],
        "bad_shards": [s.error for s in bad],
    }


def _absolute(url: str) -> str:
    return os.path.abspath(stores.local_path(url)) if stores.scheme(url) == stores.LOCAL else url


def write_index(manifest: dict[str, Any], out: str | None, s3_endpoint: str | None = None) -> str:
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
    stores.write_bytes(where, text.encode(), s3_endpoint)
    return where


def _placed(manifest: dict[str, Any], place: str) -> dict[str, Any]:
    """The manifest as written at `place`: `shards_at` only where the shards live elsewhere."""
    base = manifest["shards_at"]
    if stores.scheme(base) == stores.LOCAL:
        base = str(Path(base).resolve())
    if base.rstrip("/") == place.rstrip("/"):
        return {k: v for k, v in manifest.items() if k != "shards_at"}
    return {**manifest, "shards_at": base}


# --data: shards as users write them, indexed once into a cache.

_SHARDS = re.compile(r"\{[^}]*(\.\.|,)[^}]*\}|[*?\[]")


def names_shards(data: str) -> bool:
    """Whether --data names shards (braces, a glob, a .tar, a pipe: command), not a manifest's place."""
    return stores.scheme(data) == stores.PIPE or bool(_SHARDS.search(data)) or data.endswith(SHARD_END)


def cache_dir(given: str | None = None) -> Path:
    """Where indexes of --data are kept: --index-cache, RAYWDS_INDEX_CACHE, else ~/.cache/raywds/index."""
    root = (
        given
        or os.environ.get(CACHE)
        or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "raywds", "index")
    )
    return Path(root)


def manifest_of(cfg: TrainConfig) -> Manifest:
    """The manifest a run trains on (`manifest_for` its --data and --val-data)."""
    return manifest_for(
        cfg.data,
        val_data=cfg.val_data,
        shards_at=cfg.shards_at,
        s3_endpoint=cfg.s3_endpoint,
        index_cache=cfg.index_cache,
    )


def manifest_for(
    data: str,
    *,
    val_data: str | None = None,
    shards_at: str | None = None,
    s3_endpoint: str | None = None,
    index_cache: str | None = None,
    options: IndexOptions | None = None,
) -> Manifest:
    """The manifest for --data: the one at that folder, file or prefix; else (shards named as
    WebDataset users name them, or a folder of shards with no manifest) an index of them, made once
    into the cache and reused while every shard keeps its size and stamp."""
    if val_data is None and not names_shards(data):
        _, where = _manifest_place(data)
        if where is None or stores.scheme(data) == stores.HTTP or _exists(where, s3_endpoint):
            return read_manifest(data, shards_at=shards_at, s3_endpoint=s3_endpoint)
        try:
            stores.expand([data], s3_endpoint)
        except stores.NoShards:  # a folder or prefix with neither a manifest nor shards: say what to run
            return read_manifest(data, shards_at=shards_at, s3_endpoint=s3_endpoint)
    options = options or IndexOptions()
    specs = {"data": data, "val_data": val_data, "options": asdict(options)}
    key = hashlib.sha256(json.dumps(specs, sort_keys=True).encode()).hexdigest()[:20]
    folder = cache_dir(index_cache) / key
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks on one node index once; the others wait and read it
        if (folder / MANIFEST).is_file():
            changed = _changed(folder / MANIFEST, s3_endpoint)
            if not changed:
                return read_manifest(str(folder), s3_endpoint=s3_endpoint)
            log.warning(
                "%d shards changed since they were indexed (%s): indexing %s again",
                len(changed),
                ", ".join(changed[:5]),
                data,
            )
        started = time.perf_counter()
        policy = ReadPolicy(s3_endpoint=s3_endpoint)
        if val_data is not None:
            splits = {"train": stores.expand([data], s3_endpoint), "val": stores.expand([val_data], s3_endpoint)}
        else:
            splits = split_by_name(stores.expand([data], s3_endpoint))
        manifest = index_shards(splits, options, policy=policy)
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
    return read_manifest(str(folder), s3_endpoint=s3_endpoint)


def _manifest_place(data: str) -> tuple[str, str | None]:
    from raywds.data.manifest import split_location

    try:
        return split_location(data)
    except DataError:
        return data, None


def _exists(where: str, s3_endpoint: str | None) -> bool:
    try:
        stores.stat(where, 30.0, s3_endpoint)
    except FileNotFoundError:
        return False
    return True


def _changed(path: Path, s3_endpoint: str | None) -> list[str]:
    """The shards of a cached index whose size or stamp is not what was indexed."""
    raw = json.loads(path.read_bytes())
    base = raw.get("shards_at") or str(path.parent)
    entries = [
        (
            stores.join(base, s["name"]) if "{}" not in base else base.replace("{}", s["name"]),
            s,
            info["stamps"].get(s["name"], ""),
        )
        for info in raw["splits"].values()
        for s in info["shards"]
    ]

    def moved(entry: tuple[str, dict[str, Any], str]) -> str | None:
        url, shard, stamp = entry
        try:
            size, now = stores.stat(url, 30.0, s3_endpoint)
        except (FileNotFoundError, DataError, OSError):
            return url
        if size < 0:
            return None  # a pipe: command: nothing to compare without reading it
        return url if size != shard["num_bytes"] or (stamp and now and now != stamp) else None

    with ThreadPoolExecutor(16) as pool:
        return [url for url in pool.map(moved, entries) if url is not None]
