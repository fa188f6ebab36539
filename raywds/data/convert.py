"""ImageNet tree or ImageFolder -> WebDataset shards plus manifest.json.

    raywds convert ~/imagenet shards/ --maxcount 1000 --workers 8

Every sample keeps the source file's image (`KEY.jpg`, or `.png`/`.webp`), with `KEY.cls`
(class index, ASCII) and `KEY.json` (class, source path, real format, mode, size). A JPEG's
bytes are rewritten losslessly with restart markers (the same DCT
coefficients, so the same pixels) so the loader can decode only a crop's rows and columns; `keep_jpeg_bytes`
keeps them byte for byte.
Samples are shuffled with the seed, then cut into shards by count and size. Unreadable files
(empty, truncated, not an image) are skipped and listed, or with `strict` stop the run.
Keys hold only letters, digits, _ and -, and each shard is read back as webdataset groups it
(one image and one .cls per key, the count the manifest gives) before the manifest lists it.

An interrupted run, rerun with the same arguments, keeps the shards it finished (checked by
size and sha256, see raywds.data.resume) and writes the rest; the manifest is written
atomically, last. The tars are webdataset's bytes, written by raywds.data.tarwriter with
tarfile, so converting never imports webdataset or torch.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import random
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from raywds.data.layout import IMAGE_EXTENSIONS, Found, ImageFile, scan
from raywds.data.listed import Tree
from raywds.data.manifest import FORMAT, TIMM_INFO, ShardInfo, write_json_atomic, write_manifest
from raywds.data.resume import JOURNAL, STATE, Journal, prepare_output, still_good  # noqa: F401 - the names of the files convert writes, for its callers
from raywds.data.shardoptions import ConvertOptions
from raywds.data.sources import DIGESTS, Sources, entry, hashed_again, image_digest
from raywds.data.sources import write as write_sources
from raywds.data.tarwriter import TAR_END_BYTES, TarWriter, tar_cost
from raywds.data.verify import check_members, sha256_file
from raywds.errors import ConfigError, DataError

try:
    from raywds.data import _restarts
except ImportError:  # built without a C compiler or libjpeg's headers (see setup.py)
    _restarts = None  # type: ignore[assignment]


def rewrites_jpegs(options: ConvertOptions) -> bool:
    """Whether JPEGs get restart markers: unless `keep_jpeg_bytes`, where the extension was built."""
    return not options.keep_jpeg_bytes and _restarts is not None


def inspect_image(data: bytes, *, decode_jpeg: bool = True) -> dict[str, Any]:
    """The real format, mode and size of an image; raises ValueError if it cannot be decoded.

    JPEGs are decoded at 1/8 scale (PIL draft mode): that still reads every byte of the
    entropy-coded data, so truncation is caught, at about 60% of a full decode's cost. Without
    `decode_jpeg` a JPEG's header alone is read (the caller checks the rest)."""
    if not data:
        raise ValueError("empty file")
    try:
        with Image.open(io.BytesIO(data)) as img:
            meta = {"format": img.format, "mode": img.mode, "width": img.width, "height": img.height}
            if img.format == "JPEG":
                if not decode_jpeg:
                    return meta
                img.draft(img.mode, (max(1, img.width // 8), max(1, img.height // 8)))
            img.load()
    except Exception as e:  # noqa: BLE001 - PIL raises many types for bad data
        raise ValueError(f"not a readable image ({type(e).__name__}: {e})") from None
    return meta


def with_restarts(data: bytes) -> bytes:
    """The JPEG rewritten losslessly with restart markers (raywds.data._restarts), which the
    loader's region decoder cuts a crop's rows and columns at; the same bytes object without the
    extension or for a JPEG the region decoder does not read (CMYK). Raises ValueError ("not a
    readable image (…)") for data libjpeg finds corrupt or truncated."""
    try:
        return (_restarts.add_restarts(data) if _restarts is not None else None) or data
    except ValueError as e:  # truncated, or damage PIL's draft decode lets through
        raise ValueError(f"not a readable image ({e})") from None


def stored(data: bytes, options: ConvertOptions) -> tuple[bytes, dict[str, Any]]:
    """What a sample keeps of an image file, and the image's meta; raises ValueError for one that
    cannot be read. A JPEG gets restart markers (`with_restarts`): adding them reads every byte
    with libjpeg, which stops at damage, so the draft decode that checks a JPEG is left out then."""
    rewrite = rewrites_jpegs(options)
    limit = options.max_side
    meta = inspect_image(data, decode_jpeg=not rewrite or bool(limit))
    if limit and max(meta["width"], meta["height"]) > limit:
        data = downscale(data, meta, limit)
    if rewrite and meta["format"] == "JPEG":
        rewritten = with_restarts(data)
        if rewritten is data and not limit:  # CMYK or YCCK, kept as it is: checked as any JPEG
            inspect_image(data)
        data = rewritten
    return data, meta


def downscale(data: bytes, meta: dict[str, Any], max_side_px: int) -> bytes:
    """Shrink so the longer side is `max_side_px`, re-encoded in the image's own format."""
    with Image.open(io.BytesIO(data)) as img:
        img.draft(img.mode, (max_side_px, max_side_px))  # JPEG: decode straight at a smaller scale
        small = img.copy()
    small.thumbnail((max_side_px, max_side_px), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    fmt = meta["format"] if meta["format"] in ("JPEG", "PNG", "WEBP") else "PNG"
    small.save(out, format=fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    meta.update(resized_from=[meta["width"], meta["height"]], width=small.width, height=small.height)
    return out.getvalue()


def plan_shards(sources: list[ImageFile], split: str, options: ConvertOptions) -> list[list[ImageFile]]:
    """Shuffle with the seed, then cut into shards by count and size."""
    order = list(sources)
    random.Random(f"{options.seed}-{split}").shuffle(order)
    shards: list[list[ImageFile]] = []
    current: list[ImageFile] = []
    size = 0
    for source in order:
        cost = tar_cost(source.num_bytes)
        if current and (len(current) >= options.maxcount or size + cost + TAR_END_BYTES > options.maxsize):
            shards.append(current)
            current, size = [], 0
        current.append(source)
        size += cost
    if current:
        shards.append(current)
    return shards


@dataclass(frozen=True)
class ShardJob:
    path: Path
    sources: list[ImageFile]
    options: ConvertOptions
    done: dict[str, Any] | None
    """The journal's record of this shard from an earlier run, if any."""


def write_shard(job: ShardJob) -> dict[str, Any]:
    """Write one shard (to a temporary name, renamed into place); returns its journal record."""
    if job.done is not None and still_good(job.path, job.done):
        return kept(job)
    # A name of this writer's own: a task Ray runs again after its node seemed lost may still be writing.
    tmp = job.path.with_name(f".{job.path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    skipped = []
    digests = []  # of the files as read: the same image, whatever restart markers or --max-side make of it
    first_key = ""
    with TarWriter(tmp) as sink:
        for source in job.sources:
            data = source.path.read_bytes()
            digest = image_digest(data)
            try:
                data, meta = stored(data, job.options)
            except ValueError as e:
                if job.options.strict:
                    raise DataError(f"{source.path}: {e} (without --strict it would be skipped and listed)") from None
                skipped.append({"path": source.relpath, "reason": str(e)})
                continue
            meta.update({"class": source.class_name, "index": source.class_index, "source": source.relpath})
            sink.write(
                source.key,
                {
                    IMAGE_EXTENSIONS[source.path.suffix.lower()]: data,
                    "cls": str(source.class_index).encode(),
                    "json": json.dumps(meta, sort_keys=True).encode(),
                },
            )
            digests.append(digest)
            first_key = first_key or source.key
    # Read back as a loader would before the manifest promises it (a key with a dot once split
    # samples in two). Only the member headers: the size and hash come from this same file.
    num_samples = len(digests)
    problems = check_members(tmp, num_samples)
    if problems:
        tmp.unlink()
        raise DataError(
            f"{job.path.name} as written does not match its manifest entry: {'; '.join(problems[:5])}; "
            f"this is a raywds bug, please report it with the names of these files: "
            f"{', '.join(s.relpath for s in job.sources[:5])}"
        )
    info = ShardInfo(job.path.name, num_samples, tmp.stat().st_size, sha256_file(tmp))
    tmp.replace(job.path)
    return {"shard": info._asdict(), "skipped": skipped, "kept": False, "first_key": first_key, DIGESTS: digests}


def kept(job: ShardJob) -> dict[str, Any]:
    """The record of a shard an earlier run finished (`job.done`), with its images' digests: read
    again where a raywds that did not record them wrote it."""
    assert job.done is not None, "only a shard the journal records is kept"
    record = {**job.done, "kept": True}
    if DIGESTS not in record:
        record[DIGESTS] = hashed_again(job, record)
    return record


def fingerprint(found: Found, options: ConvertOptions) -> str:
    """Changes when anything that decides the shards' contents changes."""
    listing = {
        split: [(s.relpath, s.num_bytes, s.class_index, s.key) for s in sources]
        for split, sources in found.splits.items()
    }
    settings = [
        options.prefix,
        options.seed,
        options.maxcount,
        options.maxsize,
        options.max_side,
        *(["restart markers"] if rewrites_jpegs(options) else []),
        found.classes,
        found.layouts,
        listing,
    ]
    return hashlib.sha256(json.dumps(settings).encode()).hexdigest()


def timm_info(manifest: dict[str, Any]) -> dict[str, Any]:
    """timm's `_info.json`, so `timm` (`--dataset wds/NAME --data-dir OUT`) reads the same shards."""
    return {
        "name": manifest["prefix"],
        "num_classes": len(manifest["classes"]),
        "splits": {
            split: {
                "name": split,
                "num_samples": info["num_samples"],
                "filenames": [s["name"] for s in info["shards"]],
                "shard_lengths": [s["num_samples"] for s in info["shards"]],
            }
            for split, info in manifest["splits"].items()
        },
    }


Runner = Callable[[list[ShardJob]], Iterator[tuple[ShardJob, dict[str, Any]]]]
"""Writes the shards of the jobs it is given (`write_shard` each), yielding each job with its
record as it finishes, in any order: processes on this machine (`processes`), or Ray tasks
across a cluster (raywds.launch.ray_convert)."""


def processes(num_workers: int) -> Runner:
    """A Runner of `num_workers` processes on this machine (this one alone for 1)."""

    def run(jobs: list[ShardJob]) -> Iterator[tuple[ShardJob, dict[str, Any]]]:
        if num_workers == 1:
            yield from ((job, write_shard(job)) for job in jobs)
            return
        # fork where the OS has it: workers start at once, without importing PIL and raywds again.
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        # Not multiprocessing.Pool: its terminate() after a worker's error deadlocked about once in
        # 200 runs (task handler stuck on the queue's lock), and a killed worker hangs it forever.
        with ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context(method)) as pool:
            futures = [pool.submit(write_shard, job) for job in jobs]
            try:
                for job, future in zip(jobs, futures):
                    yield job, future.result()
            finally:
                for future in futures:
                    future.cancel()  # after an error, write no more shards than are under way

    return run


def source_of(src: Tree) -> str:
    """Where the images came from, as the manifest says: the folder's absolute path, or the URL."""
    return str(src.resolve()) if isinstance(src, Path) else str(src)


def check_outside(src: Tree, out: Path) -> None:
    """Refuse an output folder inside the source tree: the next scan would read the shards
    folder as a class of its own (or its files as ignored rubbish) and change the classes."""
    if not isinstance(src, Path):
        return  # a tree in a bucket: shards written to a folder cannot land in it
    source, output = src.resolve(), out.resolve()
    if output.is_relative_to(source):
        raise ConfigError(
            f"output folder {out} is inside the source tree {src}; choose an output folder outside SRC, "
            f"e.g. {source.parent / (source.name + '-shards')}"
        )


DEFAULTS = ConvertOptions()


def check_options(options: ConvertOptions) -> None:
    if options.max_side is not None and options.max_side < 8:
        raise DataError(f"--max-side {options.max_side} is too small; use at least 8, e.g. 256")
    if options.maxcount < 1 or options.maxsize < 1 or options.workers < 1:
        raise DataError(f"maxcount, maxsize and workers must be at least 1, got {options}")


@dataclass
class Conversion:
    """What a conversion writes, planned on one machine from the listing: which sample goes to
    which shard, so that any runner writes the same shards."""

    src: Tree
    out: Path
    options: ConvertOptions
    found: Found
    jobs: list[tuple[str, ShardJob]]
    """(split, job) in shard order; the names numbered from `first` per split."""


def plan_jobs(
    found: Found,
    out: Path,
    options: ConvertOptions,
    done: dict[str, dict[str, Any]],
    *,
    first: dict[str, int] | None = None,
    salt: str = "",
) -> list[tuple[str, ShardJob]]:
    """Each split's shards as jobs, numbered from `first[split]` (0), shuffled with the seed (and
    `salt`, which an append adds so its own shuffle is new)."""
    jobs = []
    for split, sources in found.splits.items():
        start = (first or {}).get(split, 0)
        for i, shard in enumerate(plan_shards(sources, split + salt, options), start):
            name = f"{options.prefix}-{split}-{i:06d}.tar"
            jobs.append((split, ShardJob(out / name, shard, options, done.get(name))))
    return jobs


def plan(src: Tree, out: Path, options: ConvertOptions = DEFAULTS) -> Conversion:
    """Scan `src` and plan its shards in `out` (which must be empty or hold this same conversion)."""
    check_outside(src, out)
    check_options(options)
    found = scan(src, val_labels=options.val_labels, val_wnids=options.val_wnids)
    done = prepare_output(out, fingerprint(found, options), prefix=options.prefix, overwrite=options.overwrite)
    return Conversion(src, out, options, found, plan_jobs(found, out, options, done))


def write_all(conversion: Conversion, run: Runner) -> dict[str, dict[str, Any]]:
    """Every planned shard written (or kept from an earlier run), journalled as it finishes; the
    records by shard name. One bar: shards done, files a second, bad files so far."""
    jobs = [job for _, job in conversion.jobs]
    records: dict[str, dict[str, Any]] = {}
    start = time.perf_counter()
    files = bad = 0
    with (
        tqdm(total=len(jobs), unit="shard", desc="convert", disable=None) as bar,
        Journal(conversion.out) as journal,
    ):
        for job, record in run(jobs):
            records[job.path.name] = record
            if not record["kept"]:
                journal.add(record)
            files += len(job.sources)
            bad += len(record["skipped"])
            bar.update(1)
            bar.set_postfix_str(f"{files / max(time.perf_counter() - start, 1e-9):.0f} files/s, {bad} bad")
    for stale in conversion.out.glob(f".{conversion.options.prefix}-*.tmp"):
        stale.unlink(missing_ok=True)  # left by a writer that was killed (a lost node's task)
    return records


def split_entry(jobs: list[tuple[str, ShardJob]], records: dict[str, dict[str, Any]], split: str) -> dict[str, Any]:
    """A split's manifest entry from its jobs' records."""
    shards = [records[job.path.name]["shard"] for s, job in jobs if s == split]
    # Each shard's first key, which the loader checks as it opens the shard (a shard overwritten by
    # another's bytes of the same size is refused before any of its samples is used).
    first = {job.path.name: records[job.path.name].get("first_key", "") for s, job in jobs if s == split}
    return {
        "num_samples": sum(s["num_samples"] for s in shards),
        "shards": shards,
        "first_keys": {name: key for name, key in first.items() if key},
    }


def manifest_of(conversion: Conversion, records: dict[str, dict[str, Any]], table: Sources) -> dict[str, Any]:
    """The manifest of a conversion from its shards' records; `table`: its samples' sources."""
    options, found = conversion.options, conversion.found
    return {
        "format": FORMAT,
        "prefix": options.prefix,
        "classes": found.classes,
        "seed": options.seed,
        "maxcount": options.maxcount,
        "maxsize": options.maxsize,
        "max_side_px": options.max_side,
        "jpeg_restarts": rewrites_jpegs(options),
        "source": source_of(conversion.src),
        "layouts": found.layouts,
        "splits": {split: split_entry(conversion.jobs, records, split) for split in found.splits},
        "skipped": [s for r in records.values() for s in r["skipped"]],
        "ignored": {"count": len(found.ignored), "examples": found.ignored[:20]},
        "empty_classes": found.empty,
        "kept_from_earlier_run": sum(r["kept"] for r in records.values()),
        "sources": entry(table),
        "same_bytes": same_bytes(table),
    }


def same_bytes(table: Sources, since: int = 0) -> dict[str, Any]:
    """The images from row `since` on that are the bytes of an earlier one of those rows, under
    another name: each kept as a sample (ImageNet's own train split holds such pairs), and said."""
    pairs = Sources(table.digests[since:], table.versions[since:], table.paths[since:]).repeats()
    examples = sorted(sorted([table.paths[since + row], table.paths[since + first]]) for row, first in pairs)
    return {"count": len(pairs), "examples": examples[:10]}


def publish(out: Path, manifest: dict[str, Any], table: Sources) -> None:
    """`sources.npz` (`table`), `_info.json`, then the manifest (its columns and manifest.json),
    each atomically, the manifest last."""
    write_sources(out, table)
    write_json_atomic(out / TIMM_INFO, timm_info(manifest))
    write_manifest(out, manifest)


def convert(src: Tree, out: Path, options: ConvertOptions = DEFAULTS, *, run: Runner | None = None) -> dict[str, Any]:
    """Convert the tree at `src` into shards under `out` (with `run`, else `options.workers`
    processes here); returns the manifest it wrote."""
    conversion = plan(src, out, options)
    records = write_all(conversion, run or processes(options.workers))
    table = Sources.of(conversion.jobs, records, version=1)
    manifest = manifest_of(conversion, records, table)
    publish(out, manifest, table)
    return manifest


def summary(manifest: dict[str, Any], where: str) -> list[str]:
    """What `raywds convert` says of the manifest it wrote at `where`."""
    lines = [
        f"{split}: {info['num_samples']} samples in {len(info['shards'])} shards ({manifest['layouts'][split]})"
        for split, info in manifest["splits"].items()
    ]
    if manifest["kept_from_earlier_run"]:
        lines.append(f"kept {manifest['kept_from_earlier_run']} finished shards from an earlier run")
    repeated = manifest.get("same_bytes", {}).get("count", 0)
    if repeated:
        pairs = "; ".join(f"{a} = {b}" for a, b in manifest["same_bytes"]["examples"][:3])
        lines.append(
            f"{repeated} image{' is' if repeated == 1 else 's are'} the bytes of another under a new name "
            f"(each kept as a sample): {pairs}"
        )
    if manifest.get("kept_in_bucket"):
        lines.append(f"the bucket held {manifest['kept_in_bucket']} of these shards already")
    if manifest["ignored"]["count"]:
        examples = ", ".join(manifest["ignored"]["examples"][:3])
        lines.append(f"ignored {manifest['ignored']['count']} files that are not images, e.g. {examples}")
    if manifest["skipped"]:
        lines.append(f"skipped {len(manifest['skipped'])} unreadable images (listed in the manifest):")
        lines += [f"  {bad['path']}: {bad['reason']}" for bad in manifest["skipped"][:50]]
    if manifest.get("written_on"):
        nodes = manifest["written_on"]
        each = ", ".join(f"{ip} ({count})" for ip, count in nodes.items())
        lines.append(f"written by Ray tasks on {len(nodes)} node{'s' if len(nodes) > 1 else ''}: {each}")
    lines.append(f"raywds: wrote {where} ({len(manifest['classes'])} classes)")
    return lines
