"""The manifest's shard lists as columns: `manifest.npz`, written beside `manifest.json`.

At LAION's size (400,000 shards) `manifest.json` is 75 MB that Python parses in seconds into
a few hundred MB of objects, on every rank. `manifest.npz` holds the same manifest: the shard
lists as arrays (names as one UTF-8 block with their ends, samples, bytes, sha256 as raw
bytes), everything else as the JSON text it has in `manifest.json`. numpy loads it without
parsing, and `ShardTable` makes each `ShardInfo` only when it is asked for.

It is a cache of `manifest.json`, which stays the manifest that people, timm and Hugging Face
read: it records the JSON's size, and a reader uses it only while the JSON beside it still
has that size (`raywds verify` checks that the two agree shard by shard).
"""

from __future__ import annotations

import io
import json
import re
import string
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, overload

if TYPE_CHECKING:
    import numpy as np

COLUMNS = "manifest.npz"
COLUMN_NAMES = ("names", "ends", "samples", "bytes", "sha256")
"""Each split's arrays in the file, as `SPLIT/NAME`, in ShardTable's order."""
PLAIN_ASCII = (string.ascii_letters + string.digits + "_.+-").encode()
SEGMENTED = re.compile(r"[\w+-][\w.+-]*(/[\w+-][\w.+-]*)*")
"""Plain names joined by `/` (raywds.data.manifest.SHARD_NAME)."""
CHUNK = 4096
"""Shards made at a time when a table is iterated."""
NO_HASH = "0" * 64
"""The sha256 column's value for a shard listed without one (synthetic manifests)."""


class ShardInfo(NamedTuple):
    """One tar file: its name beside the manifest, samples, bytes and sha256. (A named tuple:
    400,000 of them are made in 0.1 s, where a frozen dataclass took 1 s.)"""

    name: str
    num_samples: int
    num_bytes: int
    sha256: str


class ShardTable(Sequence[ShardInfo]):
    """A split's shards as arrays; indexing or iterating makes each ShardInfo on demand."""

    def __init__(
        self, names: bytes | np.ndarray, ends: np.ndarray, samples: np.ndarray, sizes: np.ndarray, sha256: np.ndarray
    ):
        self.names = names if isinstance(names, bytes) else names.tobytes()
        self.ends, self.samples, self.sizes, self.sha256 = ends, samples, sizes, sha256

    def __len__(self) -> int:
        return len(self.ends)

    def _name(self, i: int) -> str:
        return self.names[int(self.ends[i - 1]) if i else 0 : int(self.ends[i])].decode()

    def _info(self, i: int) -> ShardInfo:
        return ShardInfo(self._name(i), int(self.samples[i]), int(self.sizes[i]), _hex(self.sha256[i].tobytes().hex()))

    @overload
    def __getitem__(self, i: int) -> ShardInfo: ...
    @overload
    def __getitem__(self, i: slice) -> list[ShardInfo]: ...
    def __getitem__(self, i: int | slice) -> ShardInfo | list[ShardInfo]:
        if isinstance(i, slice):
            return [self._info(k) for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"shard {i} of {len(self)}")
        return self._info(i % len(self))

    def name_list(self) -> list[str]:
        """Every shard's name, in order (no records made)."""
        return [
            name for start in range(0, len(self), CHUNK) for name in self._names(start, min(start + CHUNK, len(self)))
        ]

    def plain_names(self) -> bool:
        """Whether every name is a plain file name (raywds.data.manifest.SHARD_NAME): none empty,
        none starting with a dot, only letters, digits and . _ + -, checked over all at once."""
        import numpy as np

        if not len(self):
            return True
        if b"/" in self.names:  # shards in sub-folders of the base (`raywds index`): each name on its own
            return all(SEGMENTED.fullmatch(name) for name in self.name_list())
        starts = np.concatenate([[0], self.ends[:-1]])
        if (self.ends <= starts).any() or (np.frombuffer(self.names, np.uint8)[starts] == ord(".")).any():
            return False
        if not self.names.translate(None, PLAIN_ASCII):  # every byte one of those: no regex over megabytes
            return True
        return re.fullmatch(r"[\w.+-]*", self.names.decode()) is not None

    def __iter__(self) -> Iterator[ShardInfo]:
        for start in range(0, len(self), CHUNK):
            yield from self._chunk(start, min(start + CHUNK, len(self)))

    def _names(self, start: int, stop: int) -> list[str]:
        first = int(self.ends[start - 1]) if start else 0
        ends = (self.ends[start:stop] - first).tolist()
        block = self.names[first : first + ends[-1]]
        text = block.decode()
        if len(text) == len(block):  # ASCII names: byte ends are character ends
            return [text[a:b] for a, b in zip([0, *ends[:-1]], ends)]
        return [self._name(i) for i in range(start, stop)]

    def _chunk(self, start: int, stop: int) -> Iterator[ShardInfo]:
        """Shards start..stop, made a chunk of columns at a time (a tenth of the time of one by one)."""
        names = self._names(start, stop)
        hexes = self.sha256[start:stop].tobytes().hex()
        digests = [_hex(hexes[i : i + 64]) for i in range(0, len(hexes), 64)]
        return map(
            ShardInfo._make, zip(names, self.samples[start:stop].tolist(), self.sizes[start:stop].tolist(), digests)
        )


def sample_counts(shards: Sequence[ShardInfo]) -> np.ndarray:
    """Each shard's samples, as int64, from the column when there is one."""
    import numpy as np

    if isinstance(shards, ShardTable):
        return shards.samples.astype(np.int64, copy=False)
    return np.array([s.num_samples for s in shards], dtype=np.int64)


def table(shards: Sequence[ShardInfo]) -> ShardTable:
    """The columns of a list of shards."""
    import numpy as np

    if isinstance(shards, ShardTable):
        return shards
    encoded = [s.name.encode() for s in shards]
    return ShardTable(
        b"".join(encoded),
        np.cumsum([len(e) for e in encoded], dtype=np.int64),
        np.array([s.num_samples for s in shards], dtype=np.int64),
        np.array([s.num_bytes for s in shards], dtype=np.int64),
        np.frombuffer(bytes.fromhex("".join(s.sha256 or NO_HASH for s in shards)), dtype=np.uint8).reshape(-1, 32),
    )


def to_bytes(raw: dict[str, Any], json_size: int) -> bytes:
    """`manifest.npz` for the manifest `raw` (as `manifest.json` holds it, `json_size` bytes)."""
    import numpy as np

    splits = {name: {k: v for k, v in info.items() if k != "shards"} for name, info in raw["splits"].items()}
    rest = json.dumps({**raw, "splits": splits}).encode()
    arrays: dict[str, np.ndarray] = {
        "json_size": np.array(json_size, dtype=np.int64),
        "rest": np.frombuffer(rest, np.uint8),
    }
    for name, info in raw["splits"].items():
        cols = table([ShardInfo(**s) for s in info["shards"]])
        arrays |= {f"{name}/names": np.frombuffer(cols.names, np.uint8), f"{name}/ends": cols.ends}
        arrays |= {f"{name}/samples": cols.samples, f"{name}/bytes": cols.sizes, f"{name}/sha256": cols.sha256}
    out = io.BytesIO()
    np.savez(out, allow_pickle=False, **arrays)  # not compressed: loading is a copy
    return out.getvalue()


def load(data: bytes | str) -> tuple[dict[str, Any], dict[str, ShardTable], int]:
    """(the manifest without its shard lists, the shard lists, the size of the JSON it was made
    with) from a file's bytes or its local path; ValueError when it is not such a file."""
    import zipfile

    import numpy as np

    try:
        with np.load(io.BytesIO(data) if isinstance(data, bytes) else data, allow_pickle=False) as npz:
            rest = json.loads(npz["rest"].tobytes())
            splits = {
                name: ShardTable(
                    *(npz[f"{name}/{column}"] for column in ("names", "ends", "samples", "bytes", "sha256"))
                )
                for name in rest["splits"]
            }
            return rest, splits, int(npz["json_size"])
    except (KeyError, EOFError, OSError, zipfile.BadZipFile) as e:  # ValueError (json's too) passes as it is
        raise ValueError(f"not a manifest's columns: {e}") from None


def same(data: bytes, other: bytes) -> bool:
    """Whether two `manifest.npz` hold the same manifest, made from a JSON of the same size."""
    if data == other:
        return True
    try:
        (rest, splits, size), (rest2, splits2, size2) = load(data), load(other)
    except ValueError:  # not an npz, or not ours
        return False
    return (rest, size) == (rest2, size2) and {k: list(v) for k, v in splits.items()} == {
        k: list(v) for k, v in splits2.items()
    }


def _hex(digest: str) -> str:
    return "" if digest == NO_HASH else digest
