"""`raywds predict`'s output folder: one part per unit (a shard, or a list of a folder's files),
each written whole and atomically (a temp file, fsync, rename, the folder's entry synced) once
its last sample is predicted, named by the unit, so a predict stopped anywhere and run again skips
the parts already there and ends with each key once. `_predictions.json` says which model and
which data the parts are of: a rerun with the same resumes, another model or data is refused.
`pyarrow.dataset.dataset(DIR)` reads the parts as one table (it passes over names starting with
`_` and `.`: the manifest and unfinished temp files).

    folder = Predictions.open(Path("preds"), identity, PART_FORMATS["parquet"])
    if not folder.done(unit): folder.write(unit, rows)
"""

from __future__ import annotations

import dataclasses
import io
import json
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raywds.data.stores import sync_path, write_atomic
from raywds.errors import ConfigError, DataError, StorageError
from raywds.infer.inputs import Unit, unit_of
from raywds.loader.stages import Batch

MANIFEST = "_predictions.json"
FORMAT = "raywds-predictions/1"
COLUMNS = ("key", "shard", "label", "top_classes", "top_names", "top_probs", "error")
"""Each row: the sample's key, its unit (shard), its label (None where the data has none), the
top-k class indices, names and probabilities (softmax; None where it could not be decoded), and
why it could not be (None where it could)."""


@dataclass
class Rows:
    """A unit's rows, column by column (COLUMNS)."""

    key: list[str] = field(default_factory=list)
    shard: list[str] = field(default_factory=list)
    label: list[int | None] = field(default_factory=list)
    top_classes: list[list[int] | None] = field(default_factory=list)
    top_names: list[list[str] | None] = field(default_factory=list)
    top_probs: list[list[float] | None] = field(default_factory=list)
    error: list[str | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.key)

    def add(self, row: dict[str, Any]) -> None:
        for name in COLUMNS:
            getattr(self, name).append(row[name])

    def columns(self) -> dict[str, list[Any]]:
        return {name: getattr(self, name) for name in COLUMNS}


def _jsonl(rows: Rows) -> bytes:
    columns = rows.columns()
    lines = [json.dumps({c: columns[c][i] for c in COLUMNS}) for i in range(len(rows))]
    return "".join(line + "\n" for line in lines).encode()


def _parquet(rows: Rows) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("key", pa.string()),
            ("shard", pa.string()),
            ("label", pa.int64()),
            ("top_classes", pa.list_(pa.int64())),
            ("top_names", pa.list_(pa.string())),
            ("top_probs", pa.list_(pa.float32())),
            ("error", pa.string()),
        ]
    )
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pydict(rows.columns(), schema=schema), sink)
    return sink.getvalue()


@dataclass(frozen=True)
class PartFormat:
    """How a part is written (`--format`)."""

    name: str
    suffix: str
    encoded: Callable[[Rows], bytes]


PART_FORMATS = {f.name: f for f in (PartFormat("parquet", ".parquet", _parquet), PartFormat("jsonl", ".jsonl", _jsonl))}
"""Each --format."""


@dataclass(frozen=True)
class Identity:
    """What a folder's parts are predictions of: the model, the data, and how they are written."""

    model_sha256: str
    """sha256 of the model's weights (its state dict: names, shapes and bytes)."""
    model_source: str
    data: str
    data_fingerprint: str
    split: str
    top_k: int
    part_format: str
    num_parts: int
    num_samples: int

    def differences(self, held: Identity) -> list[str]:
        """What this predict has that differs from the folder's `held`, in words, the model first."""
        said = []
        if self.model_sha256 != held.model_sha256:
            said.append(
                f"another model ({self.model_source}, weights {self.model_sha256[:12]}…, not {held.model_sha256[:12]}…)"
            )
        if self.data_fingerprint != held.data_fingerprint:
            changed = self.data == held.data
            said.append(
                f"--data {self.data} " + ("changed since (names, counts or contents)" if changed else "(other data)")
            )
        for flag, mine, theirs in (
            ("--split", self.split, held.split),
            ("--top-k", self.top_k, held.top_k),
            ("--format", self.part_format, held.part_format),
        ):
            if mine != theirs:
                said.append(f"{flag} {mine} (the folder's: {theirs})")
        return said


def part_name(unit: Unit, part_format: PartFormat) -> str:
    """The part's file name: the unit's name (a shard's without .tar), `/` and odd characters quoted."""
    return urllib.parse.quote(unit.name.removesuffix(".tar"), safe="-_.~+=,@") + part_format.suffix


class Predictions:
    """An output folder of predictions of one model on one data set."""

    def __init__(self, out: Path, identity: Identity, part_format: PartFormat):
        self.out, self.identity, self.part_format = out, identity, part_format

    @classmethod
    def open(cls, out: Path, identity: Identity, part_format: PartFormat) -> Predictions:
        """The folder, refused in one line where it holds another model's or data's predictions,
        or files that are not predictions; its manifest written where it has none."""
        where = out / MANIFEST
        held = {p.name for p in out.iterdir() if not p.name.startswith(".")} if out.is_dir() else set()
        if MANIFEST in held or where.is_file():  # (another rank may have written it since the listing)
            try:
                raw = json.loads(where.read_text())
                kept = Identity(**{f.name: raw[f.name] for f in dataclasses.fields(Identity)})
            except (ValueError, KeyError, TypeError) as e:
                raise StorageError(f"--out {out}: {MANIFEST} is damaged ({e}); give another --out") from None
            different = identity.differences(kept)
            if different:
                raise ConfigError(
                    f"--out {out} holds predictions of {kept.model_source} on {kept.data}; this predict has "
                    f"{', '.join(different)}: give another --out (or remove that one) rather than mix them"
                )
            return cls(out, identity, part_format)
        if held:
            raise ConfigError(f"--out {out} holds files but no {MANIFEST}: give an empty or new folder")
        try:
            out.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"format": FORMAT, **dataclasses.asdict(identity)}, indent=1) + "\n"
            write_atomic(where, text.encode())
        except OSError as e:
            raise StorageError(f"--out {out}: cannot write there ({e})") from None
        return cls(out, identity, part_format)

    def part(self, unit: Unit) -> Path:
        return self.out / part_name(unit, self.part_format)

    def done(self, unit: Unit) -> bool:
        return self.part(unit).is_file()

    def clear_unfinished(self, unit: Unit) -> None:
        """Remove the temp files a stopped predict left of the unit's part (only its rank writes it)."""
        for tmp in self.out.glob(f".{self.part(unit).name}.*.tmp"):
            tmp.unlink(missing_ok=True)

    def write(self, unit: Unit, rows: Rows) -> None:
        """The unit's part, whole and durable: a temp file synced, renamed, the folder synced."""
        try:
            write_atomic(self.part(unit), self.part_format.encoded(rows))
            sync_path(self.out)
        except OSError as e:
            raise StorageError(f"--out {self.out}: cannot write {self.part(unit).name} ({e})") from None


class Collector:
    """A rank's rows, gathered by unit as its batches arrive (a unit's samples may span batches,
    between other workers' units); each unit written as its part once it holds all its rows."""

    def __init__(self, units: Sequence[Unit], folder: Predictions, classes: Sequence[str]):
        self.units, self.firsts = list(units), [u.first_id for u in units]
        self.folder, self.classes = folder, list(classes)
        self.rows: dict[str, Rows] = {}
        self.samples = self.errors = self.written = 0

    def empty(self, unit: Unit) -> None:
        """A unit without samples is written at once (no batch will bring it)."""
        if unit.num_samples == 0:
            self._write(unit, Rows())

    def add(self, batch: Batch, classes: torch.Tensor, probs: torch.Tensor) -> None:
        """A batch's rows: each sample's top classes and probabilities, or why it has none."""
        bad = {(b.shard, b.key): f"{b.member}: {b.reason}" for b in batch.bad_samples}
        ids, labels = batch.ids.tolist(), batch.labels.tolist()
        for i, (key, top, p) in enumerate(zip(batch.keys, classes.tolist(), probs.tolist())):
            unit = unit_of(self.units, self.firsts, ids[i])
            self.row(unit, key, labels[i], top, p, bad.get((unit.url, key)))

    def row(self, unit: Unit, key: str, label: int, top: list[int], probs: list[float], error: str | None) -> None:
        row = {
            "key": key,
            "shard": unit.name,
            "label": label if label >= 0 else None,
            "top_classes": None if error else top,
            "top_names": None if error else [self.classes[c] for c in top],
            "top_probs": None if error else probs,
            "error": error,
        }
        rows = self.rows.setdefault(unit.name, Rows())
        rows.add(row)
        self.samples += 1
        self.errors += error is not None
        if len(rows) == unit.num_samples:
            self._write(unit, self.rows.pop(unit.name))

    def _write(self, unit: Unit, rows: Rows) -> None:
        self.folder.write(unit, rows)
        self.written += 1

    def check_complete(self, units: Sequence[Unit]) -> None:
        """Every unit of `units` written: the loader's end with one short is an error naming it."""
        short = [u for u in units if not self.folder.done(u)]
        if short:
            u = short[0]
            got = len(self.rows.get(u.name, ()))
            raise DataError(
                f"{len(short)} parts were not written: {u.name} gave {got} of its {u.num_samples} samples; "
                "run `raywds verify` on --data, then predict again (the parts written are kept)"
            )
