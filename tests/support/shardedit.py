"""Breaking shards on purpose: rewrite a shard's members, or damage its bytes, and keep (or not)
its manifest entry in step, as a faulty tool or a faulty disk would leave it."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

Members = list[tuple[str, bytes]]


def copy(shards: Path, out: Path) -> Path:
    shutil.copytree(shards, out)
    return out


def manifest(shards: Path) -> dict:
    return json.loads((shards / "manifest.json").read_text())


def entry(shards: Path, split: str, index: int) -> dict:
    return manifest(shards)["splits"][split]["shards"][index]


def members(path: Path) -> Members:
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isreg()]  # type: ignore[union-attr]


def write_tar(path: Path, files: Members) -> None:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))


def sync_manifest(shards: Path, split: str, index: int) -> None:
    """Make the manifest entry agree with the shard as it now is (count, bytes, sha256)."""
    raw = manifest(shards)
    shard = raw["splits"][split]["shards"][index]
    data = (shards / shard["name"]).read_bytes()
    keys = {name.split(".", 1)[0] for name, _ in members(shards / shard["name"])} if data else set()
    raw["splits"][split]["num_samples"] += len(keys) - shard["num_samples"]
    shard.update(num_samples=len(keys), num_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (shards / "manifest.json").write_text(json.dumps(raw))


def rewrite(shards: Path, split: str, index: int, change: Callable[[Members], Members], *, in_manifest: bool) -> Path:
    """Rewrite shard `index` of `split` with `change(members)`; `in_manifest`: the manifest agrees."""
    path = shards / entry(shards, split, index)["name"]
    write_tar(path, change(members(path)))
    if in_manifest:
        sync_manifest(shards, split, index)
    return path


def replace_member(ext: str, data: bytes, *, nth: int = 0) -> Callable[[Members], Members]:
    """The `nth` sample's `.ext` member gets `data`."""

    def change(files: Members) -> Members:
        keys = list(dict.fromkeys(name.split(".", 1)[0] for name, _ in files))
        target = f"{keys[nth]}.{ext}"
        return [(name, data if name == target else blob) for name, blob in files]

    return change


def jpeg_cut_after_scan_header(jpeg: bytes) -> bytes:
    """A JPEG whose entropy-coded data is gone: the headers parse, every pixel row is missing."""
    sos = jpeg.index(b"\xff\xda")
    length = int.from_bytes(jpeg[sos + 2 : sos + 4], "big")
    return jpeg[: sos + 2 + length + 16]


def keep_samples(count: int) -> Callable[[Members], Members]:
    """Only the first `count` samples (a shard cut short on a member boundary)."""

    def change(files: Members) -> Members:
        keys = list(dict.fromkeys(name.split(".", 1)[0] for name, _ in files))[:count]
        return [(name, blob) for name, blob in files if name.split(".", 1)[0] in keys]

    return change


def extra_sample(files: Members) -> Members:
    """One more sample than the manifest lists: the first one again, under a new key."""
    key = files[0][0].split(".", 1)[0]
    return files + [(f"extra{name[len(key) :]}", blob) for name, blob in files if name.startswith(key + ".")]


def duplicate_key(files: Members) -> Members:
    """The first sample's members again at the end, under the same key."""
    key = files[0][0].split(".", 1)[0]
    return files + [(name, blob) for name, blob in files if name.startswith(key + ".")]


def truncate_bytes(path: Path, size: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:size])


def member_offsets(path: Path) -> list[tuple[str, int, int]]:
    """(name, data offset, size) of each member, from tarfile."""
    with tarfile.open(path) as tar:
        return [(m.name, m.offset_data, m.size) for m in tar.getmembers()]
