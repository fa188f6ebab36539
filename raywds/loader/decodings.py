"""`--decode` as objects: each way of decoding, what it does in the loader and what the rest of
raywds asks of it; and the `device` decoder's batches, JPEG bytes whose crops the workers drew
from the header, which the training device decodes (`decode_jpeg(..., device="cuda")` on a GPU)
and crops, resizes and flips (raywds.loader.crops has the CPU decoders). The config holds the
name (text); `decoding(cfg.decode)` is where it is parsed, as the modes are in raywds.plan.modes.

    crop = decoding(cfg.decode).train_crop(224, (0.08, 1.0))   # crop(data, rng=...) in a worker

    >>> decoding("device").in_workers  # the device decodes
    False
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial as bind
from typing import Any, NamedTuple

import torch
from PIL import Image

from raywds.errors import ConfigError
from raywds.loader.crops import (
    Box,
    OutOf,
    cropped,
    draw_crop,
    plain_jpeg,
    reference_train,
    reference_val,
    stack_crops,
    train_crop,
    val_crop,
)


class EncodedImage(NamedTuple):
    """One sample for the `device` decoder: its JPEG bytes and the crop drawn for it."""

    data: torch.Tensor
    box: Box
    flip: bool
    size: int


@dataclass(frozen=True)
class Encoded:
    """A batch for the `device` decoder: every sample's JPEG bytes in one uint8 tensor (one
    shared-memory block between processes, not one per sample), with offsets and crops."""

    data: torch.Tensor
    offsets: torch.Tensor
    """(N + 1,) int64: sample i is data[offsets[i]:offsets[i + 1]]."""
    boxes: torch.Tensor
    """(N, 4) int64: top, left, height, width."""
    flips: torch.Tensor
    size: int

    def __len__(self) -> int:
        return len(self.flips)

    def __getitem__(self, i: int) -> EncodedImage:
        top, left, height, width = (int(v) for v in self.boxes[i])
        return EncodedImage(
            self.data[self.offsets[i] : self.offsets[i + 1]], (top, left, height, width), bool(self.flips[i]), self.size
        )

    def __iter__(self) -> Iterator[EncodedImage]:
        """Every sample, read from plain ints: `self[i]` a sample took 8 ms a batch of 256."""
        offsets = self.offsets.tolist()
        for start, end, (top, left, height, width), flip in zip(
            offsets, offsets[1:], self.boxes.tolist(), self.flips.tolist()
        ):
            yield EncodedImage(self.data[start:end], (top, left, height, width), flip, self.size)

    @classmethod
    def of(cls, images: list[EncodedImage]) -> Encoded:
        lengths = torch.tensor([0] + [len(im.data) for im in images], dtype=torch.long)
        return cls(
            torch.cat([im.data for im in images]),
            torch.cumsum(lengths, 0),
            torch.tensor([im.box for im in images], dtype=torch.long).view(-1, 4),
            torch.tensor([im.flip for im in images], dtype=torch.bool),
            images[0].size,
        )

    def decode(self, device: str) -> torch.Tensor:
        """uint8 NCHW on `device`: one batched decode_jpeg call, then crop, resize and flip there."""
        import torchvision

        samples = list(self)
        images = torchvision.io.decode_jpeg(
            [s.data for s in samples], mode=torchvision.io.ImageReadMode.RGB, device=device
        )
        if torch.device(device).type == "cpu":
            return stack_crops([cropped(img, s.box, s.flip, s.size) for img, s in zip(images, samples)])
        return resized_together(images, self.boxes.tolist(), self.flips.to(device), self.size)


def resized_together(
    images: list[torch.Tensor], boxes: list[list[int]], flips: torch.Tensor, size: int
) -> torch.Tensor:
    """`cropped` for a batch on a GPU, in a third of the kernel launches: each crop is resized
    as floats (CUDA's antialiased resize takes no uint8), then the whole batch is rounded,
    clamped, cast and flipped at once. Per image, `cropped` spent 8 small launches, which on an
    H100 cost more than nvJPEG's decode of the batch (benchmarks/gpu_bench.py, docs/performance.md)."""
    floats = [
        torch.nn.functional.interpolate(
            image[None, :, top : top + height, left : left + width].float(),
            size=(size, size),
            mode="bilinear",
            antialias=True,
            align_corners=False,
        )
        for image, (top, left, height, width) in zip(images, boxes)
    ]
    batch = torch.cat(floats).round_().clamp_(0, 255).to(torch.uint8)
    batch = torch.where(flips.view(-1, 1, 1, 1), batch.flip(-1), batch)
    return batch.contiguous(memory_format=torch.channels_last)


def encoded_crop(
    data: bytes, size: int, scale: tuple[float, float], rng: torch.Generator | None = None
) -> EncodedImage:
    """The `device` decoder's worker side: draw the crop (from `rng`) from the header, keep the
    bytes. Images decode_jpeg cannot read (PNG, CMYK JPEG) are re-encoded as JPEG (quality 95)."""
    with Image.open(io.BytesIO(data)) as img:
        box, flip = draw_crop(img.height, img.width, scale, rng)
        if not plain_jpeg(img):
            out = io.BytesIO()
            img.convert("RGB").save(out, format="JPEG", quality=95)
            data = out.getvalue()
    return EncodedImage(torch.frombuffer(bytearray(data), dtype=torch.uint8), box, flip, size)


def stack(images: list[torch.Tensor] | list[EncodedImage], out_of: OutOf | None = None) -> torch.Tensor | Encoded:
    """A batch's images: crops stacked (`stack_crops`), or encoded samples gathered."""
    if isinstance(images[0], EncodedImage):
        return Encoded.of(images)  # type: ignore[arg-type]
    return stack_crops(images, out_of)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Decoding:
    name: str
    in_workers: bool
    """The loader workers decode; otherwise they send each crop's JPEG bytes and box, and the
    training device decodes them (nvJPEG on a GPU)."""
    region: bool
    """Only the crop's part of each JPEG is decoded, at a reduced scale where the crop allows;
    otherwise every JPEG is decoded whole first."""
    fills: bool
    """The crops take `out=`, the batch slot to write into (raywds.loader.blocks.Slots)."""
    train_crop: Callable[[int, tuple[float, float]], Callable[..., Any]]
    """(size, scale) -> the training crop: crop(data, rng=generator)."""
    val_crop: Callable[[int, int], Callable[[bytes], Any]]
    """(size, resize) -> the validation centre crop of an image resized to `resize` on its short side: crop(data)."""


def _crop(fn: Callable[..., Any]) -> Callable[[int, tuple[float, float]], Callable[..., Any]]:
    return lambda size, scale: bind(fn, size=size, scale=scale)


def _centre(size: int, resize: int) -> Callable[[bytes], Any]:
    return bind(val_crop, size=size, resize=resize)


DECODINGS: dict[str, Decoding] = {
    d.name: d
    for d in (
        Decoding("cpu", in_workers=True, region=True, fills=True, train_crop=_crop(train_crop), val_crop=_centre),
        Decoding(
            "device",
            in_workers=False,
            region=False,
            fills=False,
            train_crop=_crop(encoded_crop),
            val_crop=_centre,
        ),
        Decoding(
            "pil",
            in_workers=True,
            region=False,
            fills=False,
            train_crop=reference_train,
            val_crop=reference_val,
        ),
    )
}


def decoding(name: str) -> Decoding:
    """The decoding `--decode NAME` names."""
    try:
        return DECODINGS[name]
    except KeyError:
        raise ConfigError(f"decode={name!r} is not one of {', '.join(DECODINGS)}") from None
