"""Predict's side of the loader's stages: every sample becomes a row, one that cannot be read or
decoded too (a black image in its batch, its reason in the batch's `bad_samples`), so that each
unit's rows are complete when its last sample's batch arrives; its label is the shard's where
there is one, -1 where not.

    pipeline = made(blocks, stages=stages, decode=val_decoder(cfg), skips=Marked(policy), ...)
    columns = decoded_columns(samples, decode, size=224)          # a Ray Data read task's block
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from functools import partial as bind
from typing import Any

import numpy as np
import torch
import webdataset as wds

from raywds.infer.inputs import ERROR
from raywds.loader.blocks import Blocks, Slots
from raywds.loader.labels import Labels, MemberError
from raywds.loader.readers import ReadPolicy
from raywds.loader.stages import MAX_LOGGED, BadSample, Batch, Decoder, Sample, SampleError, Skips, collate

log = logging.getLogger(__name__)
NO_LABEL = -1


class Marked(Skips):
    """A loader worker's policy for predict: a bad sample is kept (its reason rides with the batch
    that holds it); an unreadable shard raises, as in any exact pass."""

    def __init__(self, policy: ReadPolicy):
        super().__init__(policy)

    def bad_sample(self, error: SampleError) -> None:
        assert error.bad is not None, "a worker's own SampleError names its sample"
        self.samples.append(error.bad)
        if self.num_logged < MAX_LOGGED:
            self.num_logged += 1
            log.warning("cannot predict a sample: %s", error)


def reason(e: BaseException) -> str:
    """A decoder's complaint in one line."""
    return (str(e).splitlines() or [""])[0] or type(e).__name__


def label_of(sample: dict[str, Any], labels: Labels) -> int:
    """The sample's class index, or NO_LABEL where it has no readable label."""
    where = labels.members.label_member(sample)
    if where is None:
        return NO_LABEL
    try:
        return labels.label(sample, where)
    except ValueError:
        return NO_LABEL


def kept(
    samples: Iterable[dict[str, Any]],
    decode: Decoder,
    skips: Skips,
    size: int,
    slots: Slots | None = None,
    labels: Labels | None = None,
) -> Iterator[Sample]:
    """Sample dicts -> (image, label, id, key), every one: a sample whose image cannot be read or
    decoded gets a black image (in its slot of `slots` where given) and goes to `skips` with why."""
    labels = labels or Labels()
    for sample in samples:
        key, url = sample["__key__"], sample["__url__"]
        slot = slots.next() if slots is not None else None
        out = {} if slot is None else {"out": slot}
        member = f"{key}.*"
        try:
            if ERROR in sample:
                raise MemberError("*", sample[ERROR])
            ext = labels.image(sample)
            if ext is None:
                found = ", ".join(sorted(k for k in sample if not k.startswith("__")))
                raise MemberError("*", f"has no image member (found {found})")
            member = f"{key}.{ext}"
            image = decode(sample[ext], sample["__id__"], **out)
        except Exception as e:  # noqa: BLE001 - PIL, libjpeg and torchvision raise many types for bad bytes
            skips.bad_sample(SampleError(BadSample(url, key, member, reason(e))))
            image = slot.zero_() if slot is not None else torch.zeros((3, size, size), dtype=torch.uint8)
        if slots is not None and slot is not None:
            slots.filled()
        yield image, label_of(sample, labels), sample["__id__"], key


def made(
    blocks: Blocks,
    *,
    stages: list[Any],
    decode: Decoder,
    skips: Skips,
    batch_size: int,
    size: int,
    fills: bool,
    labels: Labels | None,
) -> wds.DataPipeline:
    """Worker side: the stages, every sample decoded (`kept`) and batched in one of the worker's
    reused shared-memory `blocks` (a `fills` decoder resizes straight into its slot), each batch
    carrying the bad samples it holds."""
    slots = Slots(batch_size, (3, size, size), blocks.take) if fills else None
    collation: Callable[[list[Any]], Batch] = bind(collate, out_of=blocks.take)
    return wds.DataPipeline(
        *stages,
        bind(kept, decode=decode, skips=skips, size=size, slots=slots, labels=labels),
        wds.batched(batch_size, collation_fn=collation, partial=True),
        skips.attach,
        blocks.leased,
    )


def decoded_columns(samples: list[dict[str, Any]], decode: Decoder, *, size: int, labels: Labels | None) -> dict:
    """Samples -> columns (a Ray Data block): image (N, size, size, 3) uint8, label, id, key,
    url and error ("" where the sample decoded)."""
    skips = Marked(ReadPolicy())
    rows = list(kept(samples, decode, skips, size, labels=labels))
    bad = {(b.shard, b.key): f"{b.member}: {b.reason}" for b in skips.samples}
    images = np.zeros((len(rows), size, size, 3), dtype=np.uint8)
    for i, (image, *_) in enumerate(rows):
        images[i] = image.permute(1, 2, 0).numpy()
    urls = [s["__url__"] for s in samples]
    return {
        "image": images,
        "label": np.asarray([r[1] for r in rows], dtype=np.int64),
        "id": np.asarray([r[2] for r in rows], dtype=np.int64),
        "key": np.asarray([r[3] for r in rows], dtype=object),
        "url": np.asarray(urls, dtype=object),
        "error": np.asarray([bad.get((u, r[3]), "") for u, r in zip(urls, rows)], dtype=object),
    }
