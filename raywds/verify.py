"""Re-read every shard and check it against the manifest.

    raywds verify shards/        # exit 1 with a list of problems, 0 if every shard is whole
"""

from __future__ import annotations

import tarfile
from collections import defaultdict
from pathlib import Path

from raywds.convert import sha256_file
from raywds.layout import IMAGE_EXTENSIONS
from raywds.shards import read_manifest

IMAGE_KEYS = set(IMAGE_EXTENSIONS.values())


def check_shard(path: Path, num_samples: int, num_bytes: int, sha256: str) -> list[str]:
    """Problems with one shard: missing, size, hash, unreadable tar, samples lacking image or class."""
    if not path.is_file():
        return [f"{path.name}: missing"]
    problems = []
    if path.stat().st_size != num_bytes:
        problems.append(f"{path.name}: {path.stat().st_size} bytes, manifest says {num_bytes}")
    if sha256_file(path) != sha256:
        problems.append(f"{path.name}: sha256 differs from the manifest")
    members: dict[str, set[str]] = defaultdict(set)
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                if member.isfile():
                    key, _, ext = member.name.partition(".")
                    members[key].add(ext)
    except (tarfile.TarError, OSError, EOFError) as e:
        return problems + [f"{path.name}: unreadable tar ({e})"]
    for key, exts in sorted(members.items()):
        if not exts & IMAGE_KEYS:
            problems.append(f"{path.name}: sample {key} has no image")
        if "cls" not in exts:
            problems.append(f"{path.name}: sample {key} has no .cls")
    if len(members) != num_samples:
        problems.append(f"{path.name}: {len(members)} samples, manifest says {num_samples}")
    return problems


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
