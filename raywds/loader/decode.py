"""Image bytes -> uint8 training and validation tensors, decoding no more than the crop needs.

Three ways, chosen by `--decode`:

- `cpu` (default): the random crop is drawn from the JPEG header alone (the same draw as
  torchvision's RandomResizedCrop: `get_params`, then a flip with probability 1/2). libjpeg
  then decodes only the region the crop covers (raywds.loader._jpeg, a small C extension over
  libjpeg-turbo's jpeg_crop_scanline and jpeg_skip_scanlines), at 1/2, 1/4 or 1/8 scale
  (DCT scaling) when the crop is at least twice the output size on both sides, and the crop
  is resized as a uint8 tensor. Where the extension was not built (no C compiler or libjpeg
  headers at install time), the whole JPEG is decoded instead: by PIL at the reduced scale
  (`draft`), or else by `torchvision.io.decode_jpeg`.
- `pil`: torchvision's own PIL transform, the reference the others are tested against.
- `device`: workers draw the crop and send the JPEG bytes; the training device decodes the
  batch (`decode_jpeg(..., device="cuda")` on a GPU) and crops, resizes and flips it there.

Every way gives uint8 CHW; normalising happens on the device (raywds.train.compute).

Each training sample's crop and flip come from its own generator, seeded by (seed, epoch, sample
id) (raywds.loader.crops): the same crop whichever worker, rank or Ray Data task decodes it, in
any order.
"""

from __future__ import annotations

import functools
import io
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torchvision
from PIL import Image
from torch.utils.data import get_worker_info
from torchvision import transforms
from torchvision.transforms.v2 import functional as F

from raywds.loader.clock import RESIZING
from raywds.loader.crops import Box, draw_crop, reduction

try:
    from raywds.loader import _jpeg
except ImportError:  # built without a C compiler or libjpeg's headers: decode whole JPEGs
    _jpeg = None  # type: ignore[assignment]
if _jpeg is not None and not hasattr(_jpeg, "decode_box"):  # built from an older _jpeg.c
    logging.getLogger(__name__).warning("raywds.loader._jpeg is an old build; `pip install -e .` rebuilds it")
    _jpeg = None  # type: ignore[assignment]


def _as_rgb_tensor(img: Image.Image) -> torch.Tensor:
    return F.pil_to_tensor(img.convert("RGB"))


def jpeg_tensor(data: bytes) -> torch.Tensor:
    """A whole JPEG decoded to uint8 RGB CHW by torchvision.io.decode_jpeg."""
    return torchvision.io.decode_jpeg(
        torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=torchvision.io.ImageReadMode.RGB
    )


def _plain_jpeg(img: Image.Image) -> bool:
    """JPEGs decode_jpeg turns into RGB as PIL would (CMYK and others go through PIL)."""
    return img.format == "JPEG" and img.mode in ("RGB", "L")


def cropped(image: torch.Tensor, box: Box, flip: bool, size: int) -> torch.Tensor:
    """Crop `box` of a uint8 CHW tensor on the CPU, resize it to size x size (bilinear,
    antialiased) with torch's uint8 kernel, flip; a batch on a GPU goes to `_resized_together`.
    The crop is made contiguous channels-last first (copied only where it is not: `box_pixels`'
    is), with the strides torch reads as channels-last: its vectorised uint8 resize then runs
    1.7x faster than on a strided view, copy included. (unsqueeze(0) of a channels-last CHW
    tensor gives the batch a stride of 3, which torch takes for another layout: 1.7x slower.)"""
    top, left, height, width = box
    crop = image[:, top : top + height, left : left + width].permute(1, 2, 0).contiguous()[None].permute(0, 3, 1, 2)
    resize = torch.nn.functional.interpolate
    out = RESIZING.timed(resize, crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return out[0].flip(-1) if flip else out[0]


def region(data: bytes, box: Box, r: int = 1) -> tuple[torch.Tensor, int, int]:
    """Decode only the part of a JPEG under `box` (raywds.loader._jpeg), at 1/r scale: uint8 CHW
    (a view of HWC pixels, so channels-last) and where its top-left corner sits in the 1/r image."""
    top, left, height, width = box
    pixels, y0, x0, rows, cols = _jpeg.decode_region(data, top, left, height, width, r)
    return torch.frombuffer(pixels, dtype=torch.uint8).view(rows, cols, 3).permute(2, 0, 1), y0, x0


def box_pixels(data: bytes, box: Box) -> torch.Tensor:
    """Exactly the pixels under `box` at full scale (raywds.loader._jpeg.decode_box): uint8 CHW,
    its HWC memory already the contiguous channels-last crop that `cropped` resizes."""
    top, left, height, width = box
    pixels = _jpeg.decode_box(data, top, left, height, width)
    return torch.frombuffer(pixels, dtype=torch.uint8).view(height, width, 3).permute(2, 0, 1)


def train_crop(data: bytes, size: int, scale: tuple[float, float], rng: torch.Generator | None = None) -> torch.Tensor:
    """The `cpu` decoder: a random crop (drawn from `rng`) of the image in `data`, decoding only what it needs."""
    shape = _jpeg.size(data) if _jpeg is not None else None
    if shape is not None:  # a JPEG the region decoder reads: its header gives the size, no PIL
        box, flip = draw_crop(*shape, scale, rng)
        r = reduction(box, size)
        if r == 1:  # cut to the box as libjpeg decodes it: no copy of the crop before resizing
            return cropped(box_pixels(data, box), (0, 0, box[2], box[3]), flip, size)
        image, y0, x0 = region(data, box, r)
        return _resampled(Image.fromarray(image.permute(1, 2, 0).numpy()), box, r, (y0, x0), flip, size)
    with Image.open(io.BytesIO(data)) as img:  # without the extension, or not a plain JPEG
        box, flip = draw_crop(img.height, img.width, scale, rng)
        r = reduction(box, size) if img.format == "JPEG" else 1
        if r == 1 and _plain_jpeg(img):
            return cropped(jpeg_tensor(data), box, flip, size)
        if r > 1:
            img.draft("RGB", (img.width // r, img.height // r))  # libjpeg decodes the whole image at 1/r scale
        return _resampled(img, box, r, (0, 0), flip, size)


def _resampled(img: Image.Image, box: Box, r: int, origin: tuple[int, int], flip: bool, size: int) -> torch.Tensor:
    """PIL resamples `box` from `img`, the image (or the part from `origin` on) at 1/r scale,
    where the box's corners fall between pixels, as the reference transform does at full scale."""
    (top, left, h, w), (y0, x0) = box, origin
    out = RESIZING.timed(
        img.convert("RGB").resize,
        (size, size),
        Image.Resampling.BILINEAR,
        box=(left / r - x0, top / r - y0, (left + w) / r - x0, (top + h) / r - y0),
    )
    tensor = F.pil_to_tensor(out)
    return tensor.flip(-1) if flip else tensor


def val_crop(data: bytes, size: int) -> torch.Tensor:
    """Resize the short side to size / 0.875, then the centre size x size."""
    resize = round(size / 0.875)
    with Image.open(io.BytesIO(data)) as img:
        image = jpeg_tensor(data) if _plain_jpeg(img) else _as_rgb_tensor(img)
    return F.center_crop(F.resize(image, [resize], antialias=True), [size, size])


def reference_train(size: int, scale: tuple[float, float]) -> Callable[[bytes], torch.Tensor]:
    """The `pil` decoder: torchvision's standard train transform, uint8 out."""
    transform = transforms.Compose(
        [transforms.RandomResizedCrop(size, scale=scale), transforms.RandomHorizontalFlip(), transforms.PILToTensor()]
    )
    return functools.partial(_transformed, transform)


def _transformed(
    transform: Callable[[Any], torch.Tensor], data: bytes, rng: torch.Generator | None = None
) -> torch.Tensor:
    """A torchvision transform of the image in `data` (a partial of this pickles, a lambda would
    not); its random draws come from `rng`'s state, torch's global generator left as it was."""
    image = open_rgb(data)
    if rng is None:
        return transform(image)
    with torch.random.fork_rng(devices=[]):  # torchvision's transforms draw from the global generator
        torch.set_rng_state(rng.get_state())
        return transform(image)


def reference_val(size: int) -> Callable[[bytes], torch.Tensor]:
    transform = transforms.Compose(
        [transforms.Resize(round(size / 0.875)), transforms.CenterCrop(size), transforms.PILToTensor()]
    )
    return functools.partial(_transformed, transform)


def open_rgb(data: bytes) -> Image.Image:
    """PIL sniffs the real format, so grayscale, CMYK and PNG-named-JPEG files all come out RGB."""
    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


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
        samples = list(self)
        images = torchvision.io.decode_jpeg(
            [s.data for s in samples], mode=torchvision.io.ImageReadMode.RGB, device=device
        )
        if torch.device(device).type == "cpu":
            return stack_crops([cropped(img, s.box, s.flip, s.size) for img, s in zip(images, samples)])
        return _resized_together(images, self.boxes.tolist(), self.flips.to(device), self.size)


def _resized_together(
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
        if not _plain_jpeg(img):
            out = io.BytesIO()
            img.convert("RGB").save(out, format="JPEG", quality=95)
            data = out.getvalue()
    return EncodedImage(torch.frombuffer(bytearray(data), dtype=torch.uint8), box, flip, size)


OutOf = Callable[[tuple[int, ...]], torch.Tensor | None]
"""Where a worker stacks a batch of `shape`: a reused shared-memory block, or None for a fresh one."""


def stack_crops(images: list[torch.Tensor], out_of: OutOf | None = None) -> torch.Tensor:
    """uint8 CHW crops -> an NCHW batch stored channels-last (the layout the crops come in and
    CUDA models want). In a DataLoader worker the batch is made in shared memory, so handing
    it over copies nothing more (as torch's default_collate does): in the block `out_of(shape)`
    gives (raywds.loader.blocks), else in a fresh one."""
    hwc = [image.permute(1, 2, 0) for image in images]
    out = None
    if get_worker_info() is not None:
        shape = (len(hwc), *hwc[0].shape)
        out = out_of(shape) if out_of is not None else None
        if out is None:
            out = torch.empty(shape, dtype=torch.uint8).share_memory_()
    return torch.stack(hwc, out=out).permute(0, 3, 1, 2)


def stack(images: list[torch.Tensor] | list[EncodedImage], out_of: OutOf | None = None) -> torch.Tensor | Encoded:
    """A batch's images: crops stacked (`stack_crops`), or encoded samples gathered."""
    if isinstance(images[0], EncodedImage):
        return Encoded.of(images)  # type: ignore[arg-type]
    return stack_crops(images, out_of)  # type: ignore[arg-type]
