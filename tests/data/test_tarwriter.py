"""raywds.data.tarwriter against webdataset's TarWriter: the same bytes for the same samples, so
shards written since convert stopped importing webdataset are the ones it wrote before, and
--workers 2 in a fresh `raywds convert` process still writes what --workers 1 writes."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from raywds.data.convert import ConvertOptions, convert
from raywds.data.manifest import read_manifest
from raywds.data.tarwriter import TAR_END_BYTES, TarWriter, tar_cost

RAYWDS = Path(sys.executable).parent / "raywds"
Samples = list[tuple[str, dict[str, bytes]]]


def webdataset_tar(path: Path, samples: Samples) -> bytes:
    """What convert wrote with webdataset before: TarWriter(path, mtime=0)."""
    with wds.TarWriter(str(path), mtime=0) as sink:
        for key, fields in samples:
            sink.write({"__key__": key, **fields})
    return path.read_bytes()


def our_tar(path: Path, samples: Samples) -> bytes:
    with TarWriter(path) as sink:
        for key, fields in samples:
            sink.write(key, fields)
    return path.read_bytes()


def sample(key: str, image: bytes, ext: str = "jpg") -> tuple[str, dict[str, bytes]]:
    meta = {
        "class": "n01440764",
        "format": "JPEG",
        "height": 375,
        "width": 500,
        "source": f"train/n01440764/{key}.JPEG",
    }
    return key, {ext: image, "cls": b"417", "json": json.dumps(meta, sort_keys=True).encode()}


CASES: dict[str, Samples] = {
    "empty": [],
    "block-edges": [
        sample(f"k{n}", bytes(range(256)) * (n // 256) + b"\xff" * (n % 256))
        for n in (0, 1, 511, 512, 513, 10240, 70001)
    ],
    "png-and-webp": [
        sample("a", b"\x89PNG", "png"),
        sample("b", b"RIFF", "webp"),
        sample("c", b"\xff\xd8"),
    ],  # cls, json, png: sorted
    "long-key": [sample("n" * 150, b"\xff\xd8")],  # over ustar's 100-byte name: a pax header
}


@pytest.mark.parametrize("case", CASES)
def test_writer_writes_webdatasets_bytes(tmp_path: Path, case: str) -> None:
    ours = our_tar(tmp_path / "ours.tar", CASES[case])
    theirs = webdataset_tar(tmp_path / "webdataset.tar", CASES[case])
    assert len(ours) == len(theirs) and hashlib.sha256(ours).hexdigest() == hashlib.sha256(theirs).hexdigest()


def test_tar_cost_bounds_what_each_sample_adds(tmp_path: Path) -> None:
    samples = CASES["block-edges"]
    size = len(our_tar(tmp_path / "ours.tar", samples))
    assert size <= TAR_END_BYTES + sum(tar_cost(len(fields["jpg"])) for _, fields in samples)


def rewritten_by_webdataset(shard: Path, out: Path) -> str:
    """The sha256 of the shard's samples, in its order, written again by webdataset's TarWriter."""
    samples = [
        (s["__key__"], {k: v for k, v in s.items() if not k.startswith("_")})
        for s in wds.WebDataset(str(shard), shardshuffle=False)
    ]
    return hashlib.sha256(webdataset_tar(out, samples)).hexdigest()


def test_converted_shards_are_what_webdataset_writes(shards: Path, tmp_path: Path) -> None:
    manifest = read_manifest(str(shards))
    for split in ("train", "val"):
        for shard in manifest.shards(split):
            assert rewritten_by_webdataset(shards / shard.name, tmp_path / shard.name) == shard.sha256, shard.name


def test_mixed_formats_and_downscaled_images_are_what_webdataset_writes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for name, fmt, size in [
        ("a.jpg", "JPEG", (40, 30)),
        ("b.png", "PNG", (20, 20)),
        ("c.webp", "WEBP", (20, 16)),
        ("big.jpg", "JPEG", (300, 200)),
    ]:
        (src / fmt.lower()).mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(
            np.random.default_rng(len(name)).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        )
        buf = io.BytesIO()
        image.save(buf, format=fmt)
        (src / fmt.lower() / name).write_bytes(buf.getvalue())
    manifest = convert(src, tmp_path / "out", ConvertOptions(maxcount=3, max_side=100))
    shards = manifest["splits"]["train"]["shards"]
    assert sum(s["num_samples"] for s in shards) == 4 and len(shards) == 2
    for shard in shards:
        assert rewritten_by_webdataset(tmp_path / "out" / shard["name"], tmp_path / shard["name"]) == shard["sha256"]


def test_cli_convert_with_two_workers_writes_the_shards_one_worker_writes(
    tree: Path, shards: Path, tmp_path: Path
) -> None:
    """Fresh processes, as users run it: the workers fork from a process that never imported torch."""
    splits = {}
    for workers in (1, 2):
        out = tmp_path / f"workers{workers}"
        run = subprocess.run(
            [str(RAYWDS), "convert", str(tree), str(out), "--maxcount", "16", "--seed", "3", "--workers", str(workers)],
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0, run.stderr
        splits[workers] = json.loads((out / "manifest.json").read_text())["splits"]
    assert splits[1] == splits[2]
    assert splits[1] == json.loads((shards / "manifest.json").read_text())["splits"], (
        "the CLI writes what convert() writes"
    )
    assert len(splits[1]["train"]["shards"]) == 8
