"""Re-read every shard and check it against the manifest.

    raywds verify shards/        # exit 1 with a list of problems, 0 if every shard is whole

`convert` runs `check_members` on each shard it writes, before the manifest lists it.
"""

from __future__ import annotations

import hashlib
import tarfile
from collections import defaultdict
from pathlib import Path

from raywds.data.layout import IMAGE_EXTENSIONS
from raywds.data.manifest import read_manifest
from raywds.data.tars import members

IMAGE_KEYS = set(IMAGE_EXTENSIONS.values())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_members(path: Path, num_samples: int) -> list[str]:
    """Problems with the samples of one tar, as webdataset groups them (key = member name up to
    its first dot): a sample without exactly one image and one .cls, or a count other than
    `num_samples`. Read with the loaders' own tar reader, at a quarter of tarfile's cost."""
    samples: dict[str, list[str]] = defaultdict(list)
    try:
        with open(path, "rb") as stream:
            for name, _ in members(stream):
                key, _, ext = name.partition(".")
                samples[key].append(ext)
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        return [f"unreadable tar ({e})"]
    problems = []
    for key, exts in sorted(samples.items()):
        images = sorted(ext for ext in exts if ext in IMAGE_KEYS)
        if len(images) != 1:
            problems.append(
                f"sample {key} has no image"
                if not images
                else f"sample {key} has {len(images)} images ({', '.join(images)})"
            )
        if exts.count("cls") != 1:
            problems.append(
                f"sample {key} has no .cls" if "cls" not in exts else f"sample {key} has {exts.count('cls')} .cls"
            )
    if len(samples) != num_samples:
        problems.append(f"{len(samples)} samples, manifest says {num_samples}")
    return problems


def check_shard(path: Path, num_samples: int, num_bytes: int, sha256: str) -> list[str]:
    """Problems with one shard: missing, size, hash, unreadable tar, samples lacking image or class."""
    if not path.is_file():
        return [f"{path.name}: missing"]
    problems = []
    if path.stat().st_size != num_bytes:
        problems.append(f"{path.name}: {path.stat().st_size} bytes, manifest says {num_bytes}")
    if sha256_file(path) != sha256:
        problems.append(f"{path.name}: sha256 differs from the manifest")
    return problems + [f"{path.name}: {problem}" for problem in check_members(path, num_samples)]


def verify(shards_dir: Path) -> tuple[int, list[str]]:
    """(shards checked, problems) for every shard the manifest in `shards_dir` lists."""
    manifest = read_manifest(str(shards_dir))
    problems: list[str] = []
    count = 0
    for split in manifest.splits:
        for shard in manifest.splits[split]:
            problems += check_shard(shards_dir / shard.name, shard.num_samples, shard.num_bytes, shard.sha256)
            count += 1
    return count, problems
