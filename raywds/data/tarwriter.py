"""Shard tars written with the standard library's tarfile, byte for byte as webdataset writes them.

    with TarWriter(path) as sink:
        sink.write("n01440764_10026", {"jpg": data, "cls": b"0", "json": b"{...}"})

What `webdataset.TarWriter(path, mtime=0)` writes for samples of bytes: one member KEY.EXT per
field, in sorted EXT order; mode 0444, owner and group "bigdata" (uid and gid 0), mtime 0;
tarfile's default pax format (webdataset works out a ustar format but never hands it to
tarfile), which adds no header unless a name needs one; the end padded to a 10240-byte record.
`import webdataset` imports torch (about 2 s and 400 MB in every process), which convert does
not need; tests/data/test_tarwriter.py checks that both writers give the same bytes.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

MODE = 0o444
OWNER = "bigdata"
"""webdataset's default user and group names."""
MTIME = 0
"""Makes shards reproducible; an int, since a float adds a pax header to every member."""
BLOCK = 512
TAR_END_BYTES = 10240
"""Each archive ends with zero blocks, padded to tarfile's 10240-byte record."""


def tar_cost(num_bytes: int) -> int:
    """Upper bound of the bytes one sample adds to a shard: a 512-byte header per member, data
    padded to 512; .cls takes one block and .json at most two."""
    return 3 * BLOCK + -(-num_bytes // BLOCK) * BLOCK + BLOCK + 2 * BLOCK


class TarWriter:
    """A new tar at `path`, closed (its end written) when the `with` block ends, as webdataset's is."""

    def __init__(self, path: Path) -> None:
        self._tar = tarfile.open(path, "w", format=tarfile.PAX_FORMAT)

    def __enter__(self) -> TarWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._tar.close()

    def write(self, key: str, fields: Mapping[str, bytes]) -> None:
        """One sample: a member `key.ext` for each field, in sorted `ext` order."""
        for ext in sorted(fields):
            data = fields[ext]
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(data), MTIME, MODE
            info.uname = info.gname = OWNER
            self._tar.addfile(info, io.BytesIO(data))
