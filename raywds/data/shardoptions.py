"""`raywds convert`'s and `raywds index`'s options (raywds.data.convert and raywds.data.index
take them; the commands' flags are made from them, raywds.cli.flags). Apart from the converter and
the indexer, so that building the command line imports no PIL, numpy or tqdm."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from raywds.fields import MAX_SEED, NAME, PATH, TEXT, flag


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """How to read the source and cut the shards."""

    maxcount: int = field(default=1000, metadata=flag(minimum=1, maximum=10**7))
    """Most samples per shard."""
    maxsize: int = field(default=1 << 30, metadata=flag(minimum=1, maximum=1 << 40))
    """Most bytes per shard (a lone sample larger than this still gets its own shard)."""
    workers: int = field(default=1, metadata=flag(minimum=1, maximum=1024))
    """Processes writing shards at once."""
    seed: int = field(default=0, metadata=flag(minimum=0, maximum=MAX_SEED))
    """Seeds the sample shuffle before sharding."""
    prefix: str = field(default="imagenet", metadata=flag(form=NAME))
    """Shard names are PREFIX-SPLIT-NNNNNN.tar."""
    strict: bool = False
    """Stop at the first unreadable image instead of skipping it."""
    overwrite: bool = False
    """Replace shards in OUT that were made with other settings."""
    val_labels: Path | None = field(default=None, metadata=flag(form=PATH))
    """Labels for a flat val/ folder: LOC_val_solution.csv or ILSVRC2012_validation_ground_truth.txt."""
    val_wnids: Path | None = field(default=None, metadata=flag(form=PATH))
    """wnid of each ILSVRC2012_ID for the devkit ground truth: meta.mat or a text file in ID order."""
    max_side: int | None = field(default=None, metadata=flag(minimum=1, maximum=65_535))
    """Downscale images whose longer side exceeds this (re-encoded, for fast experiments); None keeps every byte."""
    keep_jpeg_bytes: bool = False
    """Keep JPEGs byte for byte (else restart markers are added losslessly: a training crop then decodes faster)."""


@dataclass(frozen=True, kw_only=True)
class IndexOptions:
    """Which members hold what, and how hard to be about bad input."""

    image_key: str | None = field(default=None, metadata=flag(form=NAME))
    """The image member's extension (jpg, png, webp, ...); without it, the one image member a sample has."""
    label_key: str | None = field(default=None, metadata=flag(form=NAME))
    """The member holding the label (an integer, or a JSON object with --label-field); default: cls, label, target."""
    label_field: str | None = field(default=None, metadata=flag(form=TEXT))
    """The field of the JSON member (--label-key, default json) that holds the label: an integer or a class name."""
    classes: str | None = field(default=None, metadata=flag(form=PATH))
    """A text file of class names, one a line, in label order (default: _info.json's, else 0..K-1)."""
    strict: bool = False
    """Stop at the first sample without an image or a label, naming its shard and key (default: skip and count)."""
    skip_hash: bool = False
    """Record no sha256 for shards streamed whole (http, s3, gs, pipe:): hashing costs a core per ~1.8 GB/s,
    which a fast link on few cores notices; --verify-hashes and `raywds verify` then check sizes and keys only."""
    skip_bad_shards: bool = False
    """Leave out shards that cannot be read, listed in the manifest (default: write no manifest)."""
    workers: int = field(default=16, metadata=flag(minimum=1, maximum=1024))
    """Shards indexed at once (threads: reading is I/O)."""
