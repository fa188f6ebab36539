"""The records of a W&B run's transaction log (`run-ID.wandb`, what `wandb sync` uploads), for tests
that check what an offline run holds. wandb 0.31 writes it from its Go core and no longer ships the
Python reader older versions had (`wandb.sdk.internal.datastore`), so this reads the same format
that one read: a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then LevelDB's log format of
32 KiB blocks, each record a CRC-32 (zlib's, of its type byte and data), its length (2 bytes), its
type (full, first, middle, last) and its data, a protobuf `Record` of wandb's own.

    for record in records(path): ...        # wandb.proto.wandb_internal_pb2.Record
    history(paths)                          # [{key: value}] of every `run.log`
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32768
RECORD_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def chunks(data: bytes) -> Iterator[bytes]:
    """Each whole record's data, its parts joined, CRCs checked."""
    if not data.startswith(HEADER):
        raise ValueError(f"not a W&B transaction log: it starts {data[:7]!r}")
    at, parts = len(HEADER), b""
    while at + RECORD_HEADER <= len(data):
        left = BLOCK - at % BLOCK
        if left < RECORD_HEADER:  # the block's tail is padding
            at += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[at : at + RECORD_HEADER])
        body = data[at + RECORD_HEADER : at + RECORD_HEADER + length]
        if crc == 0 and length == 0 and kind == 0:  # zeros to the block's end
            at += left
            continue
        if zlib.crc32(bytes([kind]) + body) != crc:
            raise ValueError(f"record at byte {at}: CRC mismatch")
        at += RECORD_HEADER + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            parts = body
        elif kind == MIDDLE:
            parts += body
        elif kind == LAST:
            yield parts + body
            parts = b""


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    for data in chunks(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        yield record


def history(folders: list[Path]) -> list[dict[str, Any]]:
    """Every `run.log` row of the offline runs in `folders`, in order."""
    rows = []
    for folder in folders:
        [log] = folder.glob("*.wandb")
        for record in records(log):
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows
