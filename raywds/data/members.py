"""Which member of a sample holds its image and which its label: what a manifest records of it
(`Members`, read by the loader and `raywds verify`), the rules `raywds index` finds them by
(`Rules`, from its options), and the class names the labels map to.

    rules = Rules(IndexOptions(label_field="label"))      # labels in the json member's "label" field
    Members(image=("png",), label="json", label_field="label", label_names=True)
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raywds.data import tars
from raywds.data.shardoptions import IndexOptions
from raywds.data.stores import Storage
from raywds.errors import DataError

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "tif", "tiff")
"""Image members raywds finds by itself (PIL reads them all; JPEGs keep the region decode)."""
LABEL_KEYS = ("cls", "label", "target", "class", "index")
"""Integer label members raywds finds by itself, the first a sample has."""


@dataclass(frozen=True, kw_only=True)
class Members:
    """Where a sample keeps its image and label: raywds's own shards hold `.jpg` and `.cls`;
    `raywds index` records what shards others wrote hold."""

    image: tuple[str, ...] = ("jpg", "png", "webp", "jpeg")
    """The image member's extension, the first of these a sample has."""
    label: str = "cls"
    """The member holding the label: an integer as text, or (with `label_field`) a JSON object."""
    label_field: str | None = None
    """The field of the JSON `label` member that holds the label."""
    label_names: bool = False
    """Labels are class names (the manifest's `classes`), not indices."""
    label_keys: tuple[str, ...] = ()
    """Where `label` is empty: the label member is the first of these a sample has."""
    drop_incomplete: bool = False
    """A sample without an image or a label member is not a sample (`raywds index` counted and
    listed it, and left it out of the shard's count)."""

    def usable(self, sample: dict[str, Any]) -> bool:
        """Whether a sample dict has an image and a label member, as the index counted it."""
        return any(k in sample for k in self.image) and self.label_member(sample) is not None

    def label_member(self, sample: dict[str, Any]) -> str | None:
        if self.label:
            return self.label if self.label in sample else None
        return next((k for k in self.label_keys if k in sample), None)

    @classmethod
    def of(cls, raw: dict[str, Any] | None) -> Members:
        if not raw:
            return cls()
        return cls(
            image=tuple(raw.get("image", cls.image)),
            label=str(raw.get("label", "cls")),
            label_field=raw.get("label_field"),
            label_names=bool(raw.get("label_names", False)),
            label_keys=tuple(raw.get("label_keys", ())),
            drop_incomplete=bool(raw.get("drop_incomplete", False)),
        )


class Strict(DataError):
    """--strict: a sample without an image or a label stops indexing."""


class Rules:
    """Which member of a sample is its image and which its label, as the options say."""

    def __init__(self, options: IndexOptions):
        self.options = options
        if options.label_field and not options.label_key:
            self.label_keys: tuple[str, ...] = ("json",)
        else:
            self.label_keys = (options.label_key,) if options.label_key else LABEL_KEYS

    def image(self, key: str, exts: Sequence[str]) -> str | None:
        """The image member of sample `key`, whose members have `exts`: the one image it holds."""
        if self.options.image_key:
            return self.options.image_key if self.options.image_key in exts else None
        found = [e for e in exts if e in IMAGE_KEYS]
        if len(found) > 1:
            raise DataError(
                f"sample {key} has {len(found)} image members ({', '.join(found)}): choose one with --image-key"
            )
        return found[0] if found else None

    def wanted(self, name: str, size: int) -> bool:
        """Whether a member's data is read: a label member's (any other is passed over)."""
        return size <= 1 << 20 and tars.key_and_ext(name)[1] in self.label_keys

    def label_key(self, exts: Sequence[str]) -> str | None:
        return next((k for k in self.label_keys if k in exts), None)

    def label(self, data: bytes) -> int | str:
        if self.options.label_field:
            value = json.loads(data)[self.options.label_field]
        else:
            value = data.decode().strip()
        if isinstance(value, int) or (isinstance(value, str) and re.fullmatch(r"-?\d+", value)):
            return int(value)
        if isinstance(value, str):
            return value
        raise ValueError(f"label {value!r} is neither an integer nor a class name")


def class_names(
    options: IndexOptions, info: dict[str, Any] | None, labels: list[Any], storage: Storage = Storage()
) -> tuple[list[str], bool]:
    """(class names in label order, whether the labels are names): from --classes (a file wherever
    `storage` reaches), else `_info.json`'s, else the names the labels are, else 0..K-1."""
    names_given: list[str] | None = None
    if options.classes:
        text = storage.read(options.classes).decode()
        names_given = [line.strip() for line in text.splitlines() if line.strip()]
    elif info is not None:
        for key in ("classes", "label_names", "class_names"):
            if isinstance(info.get(key), list):
                names_given = [str(c) for c in info[key]]
                break
    by_name = any(isinstance(label, str) for label in labels)
    if by_name:
        if any(isinstance(label, int) for label in labels):
            raise DataError("labels are class names in some samples and integers in others; give one kind")
        names = names_given or sorted({str(label) for label in labels})
        missing = sorted({label for label in labels if label not in set(names)})
        if missing:
            raise DataError(f"labels {missing[:5]} are not in the class list ({len(names)} classes)")
        return names, True
    top = max((int(label) for label in labels), default=-1)
    low = min((int(label) for label in labels), default=0)
    if low < 0:
        raise DataError(f"label {low} is negative; labels are class indices from 0")
    if names_given is not None:
        if top >= len(names_given):
            raise DataError(f"label {top} is past the {len(names_given)} classes of the class list")
        return names_given, False
    num = int(info.get("num_classes", 0)) if info else 0
    return [str(i) for i in range(max(top + 1, num))], False
