"""The tests' data: the demo tree's size, shards made and re-cut, the sample keys read
straight from the tars (not through raywds), by which audits are checked, and what convert keeps
of a JPEG."""

from __future__ import annotations

import io
import re
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from raywds.data.convert import ConvertOptions, convert
from raywds.data.demo import DemoSpec, write_tree

SMALL = DemoSpec(num_train_per_class=12, num_val_per_class=5, image_side_px=32, seed=7)


def made_shards(factory: pytest.TempPathFactory, name: str, spec: DemoSpec, options: ConvertOptions) -> Path:
    """A demo tree made by `spec`, converted by `options` into a folder of its own."""
    tree = write_tree(factory.mktemp(name), spec)
    out = factory.mktemp(f"{name}-shards")
    convert(tree, out, options)
    return out


UNEVEN_SIZES = [1, 30, 7, 16, 2, 25, 9, 13, 17]  # 120 samples in 9 shards of very different sizes


def recut(shards: Path, out: Path, sizes: list[int]) -> Path:
    """The converter's train samples, re-cut into shards of `sizes` (val shards copied as they are)."""
    import hashlib
    import json
    import shutil

    import webdataset as wds

    manifest = json.loads((shards / "manifest.json").read_text())
    samples = []
    for shard in manifest["splits"]["train"]["shards"]:
        samples += list(wds.WebDataset(str(shards / shard["name"]), shardshuffle=False))
    assert sum(sizes) == len(samples)
    out.mkdir(parents=True)
    written, start = [], 0
    for i, size in enumerate(sizes):
        name = f"uneven-train-{i:06d}.tar"
        with wds.TarWriter(str(out / name), mtime=0) as sink:
            for sample in samples[start : start + size]:
                sink.write({k: v for k, v in sample.items() if k in ("__key__", "jpg", "cls", "json")})
        start += size
        data = (out / name).read_bytes()
        written.append(
            {"name": name, "num_samples": size, "num_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        )
    for shard in manifest["splits"]["val"]["shards"]:
        shutil.copy(shards / shard["name"], out / shard["name"])
    manifest["splits"]["train"] = {"num_samples": sum(sizes), "shards": written}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def tar_keys(shards: Path, split: str = "train") -> list[str]:
    """Every sample key of a split, read straight from the tars (not through raywds)."""
    import json
    import tarfile

    manifest = json.loads((shards / "manifest.json").read_text())
    keys = []
    for shard in manifest["splits"][split]["shards"]:
        with tarfile.open(shards / shard["name"]) as tar:
            keys += list(dict.fromkeys(m.name.split(".", 1)[0] for m in tar.getmembers()))  # tar order
    return keys


def audited(files: Iterable[Path], shards: Path) -> Counter:
    """The keys of the samples in audit files (raywds.train.audit: int64 ids numbered through the
    training split in manifest order), named by the tars' own keys (`tar_keys`)."""
    keys = tar_keys(shards)
    return Counter(keys[i] for f in files for i in np.fromfile(f, dtype="<i8").tolist())


def epoch_keys(audit: Path, epoch: int, data: Path) -> Counter:
    """Keys trained on in `epoch`, over every rank and process that wrote audit files to `audit`."""
    return audited(audit.glob(f"epoch{epoch:04d}-*.ids"), data)


def noise_jpeg(width: int, height: int, mode: str = "RGB", **save: object) -> bytes:
    """A JPEG of colourful noise (so chroma upsampling and any off-by-one show), PIL's `save`
    options as given (`subsampling`, `progressive`, `exif`, …)."""
    rng = np.random.default_rng(width * height)
    small = rng.integers(0, 256, (height // 4 + 1, width // 4 + 1, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC).convert(mode)
    out = io.BytesIO()
    img.save(out, format="JPEG", **{"quality": 92, **save})
    return out.getvalue()


def pixels(data: bytes) -> np.ndarray:
    """An image's RGB pixels as PIL decodes them."""
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def has_restart_markers(jpeg: bytes) -> bool:
    """A DRI marker before the scan: what raywds.data.convert's `with_restarts` writes."""
    return b"\xff\xdd" in jpeg[: jpeg.index(b"\xff\xda")]


def same_jpeg_pixels(stored: bytes, source: bytes) -> bool:
    """What convert keeps of a JPEG: the same pixels, with restart markers added."""
    return has_restart_markers(stored) and np.array_equal(pixels(stored), pixels(source))


def check_a_bucket_holds_its_own_shards_only(
    where: str, tmp_path: Path, put_plain: Callable[[bytes], None], gone_bucket: str
) -> None:
    """What an upload skips, for the bucket store at `where` (s3:// or gs://): an object of the
    shard's size whose metadata holds the shard's sha256; `put_plain` puts the same bytes at
    `where` as another tool would, with no metadata; `gone_bucket` is a prefix in no bucket."""
    from raywds.data.stores import Storage
    from raywds.errors import DataError

    path = tmp_path / "a.tar"
    path.write_bytes(b"x" * 100)
    store = Storage().at(where)
    store.check(where)
    assert not store.holds(where, 100, "ab"), "not there yet"
    store.put_file(path, where, "ab")
    assert store.holds(where, 100, "ab")
    assert not store.holds(where, 100, "cd") and not store.holds(where, 99, "ab")
    put_plain(b"x" * 100)
    assert not store.holds(where, 100, "ab"), "no sha256 kept with it"
    store.delete(where)
    store.delete(where)  # gone already: no error
    assert not store.holds(where, 100, "ab")
    with pytest.raises(DataError, match=rf"bucket '{re.escape(gone_bucket.split('/')[2])}' does not exist"):
        store.check(gone_bucket)
