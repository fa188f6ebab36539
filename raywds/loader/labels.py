"""Which member of a sample is its image and which its label, and the label as a class index,
in the loader's words: raywds's own shards hold `.jpg` (or another image) and `.cls`; shards
others wrote hold what `raywds index` recorded (raywds.data.members.Members).

    labels = Labels(manifest.members, manifest.classes)
    label = labels.label(sample, labels.members.label_member(sample))
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from raywds.data.members import Members

IMAGE_KEYS = ("jpg", "png", "webp", "jpeg")
"""The image members of raywds's own shards, in the order a sample's is looked for."""


class MemberError(ValueError):
    """A sample's image or label member is missing (`member` "*") or unreadable."""

    def __init__(self, member: str, why: str):
        super().__init__(why)
        self.member = member


class Labels:
    """A manifest's image and label members, and its classes (by name, where labels are names)."""

    def __init__(self, members: Members | None = None, classes: Sequence[str] = ()):
        self.members = members or Members()
        self.image_keys = self.members.image if members is not None else IMAGE_KEYS
        self.by_name = {name: i for i, name in enumerate(classes)} if self.members.label_names else None
        self.num_classes = len(classes)

    def read(self, sample: dict[str, Any]) -> tuple[str, int]:
        """(its image member, its class index); MemberError naming the member missing or unreadable."""
        ext, where = self.image(sample), self.members.label_member(sample)
        if ext is None or where is None:
            found = ", ".join(sorted(k for k in sample if not k.startswith("__")))
            missing = "image" if ext is None else "." + (self.members.label or "cls")
            raise MemberError("*", f"has no {missing} member (found {found})")
        try:
            return ext, self.label(sample, where)
        except ValueError as e:
            raise MemberError(where, str(e)) from None

    def image(self, sample: dict[str, Any]) -> str | None:
        return next((k for k in self.image_keys if k in sample), None)

    def label(self, sample: dict[str, Any], member: str) -> int:
        """The class index in `sample[member]`; ValueError naming what it holds otherwise."""
        raw = sample[member]
        field = self.members.label_field
        try:
            value: Any = json.loads(raw)[field] if field else (raw if self.by_name is None else raw.decode().strip())
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise ValueError(
                f"class {bytes(raw[:20])!r} is not a number" + (f" nor JSON with {field!r}" if field else "")
            ) from None
        if self.by_name is not None:
            if str(value) not in self.by_name:
                raise ValueError(f"class {value!r} is not one of the manifest's {len(self.by_name)} classes")
            return self.by_name[str(value)]
        try:
            label = int(value)
        except (TypeError, ValueError):
            shown = bytes(value[:20]) if isinstance(value, bytes | bytearray | memoryview) else str(value)[:20]
            raise ValueError(f"class {shown!r} is not a number") from None
        if self.num_classes and not 0 <= label < self.num_classes:
            raise ValueError(f"class {label} is outside the manifest's {self.num_classes} classes")
        return label
