"""A training sample's crop, decoding no more of its JPEG than the crop needs: the crop's draw
(RandomResizedCrop's box and RandomHorizontalFlip's coin, from each sample's own generator,
seeded by (seed, epoch, sample id), so a sample gets the same crop whichever loader worker, rank
or Ray Data task decodes it, in any order), and image bytes -> uint8 training and validation
tensors.

    box, flip = draw_crop(375, 500, (0.08, 1.0), crop_rng(seed, epoch, sample_id))
    crop = train_crop(jpeg_bytes, 224, (0.08, 1.0), rng=crop_rng(seed, epoch, sample_id))

Three ways, chosen by `--decode` (raywds.loader.decodings):

- `cpu` (default): the random crop is drawn from the JPEG header alone (the same draw as
  torchvision's RandomResizedCrop: `get_params`, then a flip with probability 1/2). libjpeg
  then decodes only the region the crop covers (raywds.loader._jpeg, a small C extension over
  libjpeg-turbo's jpeg_crop_scanline and jpeg_skip_scanlines), at 1/2, 1/4 or 1/8 scale
  (DCT scaling) when the crop is at least twice the output size on both sides, and the crop
  is resized as a uint8 tensor (at a reduced scale its corners rounded to the smaller image's
  pixels: `scaled_box`). Where the extension was not built (no C compiler or libjpeg
  headers at install time), the whole JPEG is decoded instead: by PIL at the reduced scale
  (`draft`), or else by `torchvision.io.decode_jpeg`.
- `pil`: torchvision's own PIL transform, the reference the others are tested against.
- `device`: workers draw the crop and send the JPEG bytes; the training device decodes the
  batch (`decode_jpeg(..., device="cuda")` on a GPU) and crops, resizes and flips it there
  (raywds.loader.decodings).

Every way gives uint8 CHW; normalising happens on the device (raywds.train.compute).
"""

from __future__ import annotations

import functools
import io
import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import get_worker_info

from raywds.loader.clock import RESIZING
from raywds.plan import seeds

RATIO = (3 / 4, 4 / 3)

Box = tuple[int, int, int, int]
"""top, left, height, width in the full image."""

_LOG_RATIO = torch.log(torch.tensor(RATIO)).tolist()  # float32-rounded, as get_params has them


def reduction(box: Box, size: int) -> int:
    """The largest libjpeg scale-down (1, 2, 4 or 8) that keeps the crop at least `size` on both sides."""
    _, _, h, w = box
    r = 8
    while r > 1 and min(h, w) < r * size:
        r //= 2
    return r


def crop_rng(seed: int, epoch: int, sample_id: int) -> torch.Generator:
    """The generator a training sample's crop and flip are drawn from, its own (about 3 us to make)."""
    rng = torch.Generator()
    rng.manual_seed(seeds.number(seeds.CROP, seed, epoch, sample_id))
    return rng


def draw_crop(
    height: int, width: int, scale: tuple[float, float], rng: torch.Generator | None = None
) -> tuple[Box, bool]:
    """RandomResizedCrop's box, then RandomHorizontalFlip's coin, drawn from `rng` (torch's
    global generator when None) exactly as torchvision draws them (`RandomResizedCrop.get_params`:
    the same calls, in the same order, on the same values), so a seed gives both the same crops.
    Written out because get_params builds tensors for what is scalar arithmetic, 3.3x slower
    (benchmarks/loader_bench.py). Every draw goes into one of two one-element tensors made
    here: `uniform_` and `random_` are what torch.rand and torch.randint call, without a new
    tensor each (a third of the draw's time)."""
    real, whole = torch.empty(1), torch.empty(1, dtype=torch.long)
    area = height * width
    for _ in range(10):
        target_area = area * real.uniform_(scale[0], scale[1], generator=rng).item()
        aspect_ratio = math.exp(real.uniform_(_LOG_RATIO[0], _LOG_RATIO[1], generator=rng).item())
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = int(whole.random_(0, height - h + 1, generator=rng).item())
            left = int(whole.random_(0, width - w + 1, generator=rng).item())
            return (top, left, h, w), real.uniform_(0, 1, generator=rng).item() < 0.5
    in_ratio = width / height  # ten misses: the centre crop get_params falls back to
    if in_ratio < min(RATIO):
        w, h = width, int(round(width / min(RATIO)))
    elif in_ratio > max(RATIO):
        h, w = height, int(round(height * max(RATIO)))
    else:
        w, h = width, height
    return ((height - h) // 2, (width - w) // 2, h, w), real.uniform_(0, 1, generator=rng).item() < 0.5


try:
    from raywds.loader import _jpeg
except ImportError:  # built without a C compiler or libjpeg's headers: decode whole JPEGs
    _jpeg = None  # type: ignore[assignment]
if _jpeg is not None and not hasattr(_jpeg, "decode_box"):  # built from an older _jpeg.c
    logging.getLogger(__name__).warning("raywds.loader._jpeg is an old build; `pip install -e .` rebuilds it")
    _jpeg = None  # type: ignore[assignment]


def _pil_tensor(img: Image.Image) -> torch.Tensor:
    """A PIL image as uint8 RGB CHW (a view of HWC pixels), as torchvision's pil_to_tensor gives.

    This module imports torchvision only where a decoder needs it (`pil`, `device`, or JPEGs
    without the extension): the import takes 1.5-2.5 s (its ops import torch's compiler), which
    the Ray driver (it never decodes), a rank's fork server (it preloads the loader) and the
    loader workers forked from it (the `cpu` decoder needs torch alone) would each pay."""
    return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)


def jpeg_tensor(data: bytes) -> torch.Tensor:
    """A whole JPEG decoded to uint8 RGB CHW by torchvision.io.decode_jpeg."""
    import torchvision  # here, not at the top: see `_pil_tensor`

    return torchvision.io.decode_jpeg(
        torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=torchvision.io.ImageReadMode.RGB
    )


def whole_image(data: bytes) -> torch.Tensor:
    """All of an image as uint8 RGB CHW: a JPEG the region decoder reads by its decode_box of the
    whole image (its header gives the size, no PIL), another plain JPEG by torchvision's
    decode_jpeg, anything else by PIL."""
    shape = _jpeg.size(data) if _jpeg is not None else None
    if shape is not None:
        return box_pixels(data, (0, 0, *shape))
    with Image.open(io.BytesIO(data)) as img:
        return jpeg_tensor(data) if plain_jpeg(img) else _pil_tensor(img)


def plain_jpeg(img: Image.Image) -> bool:
    """JPEGs decode_jpeg turns into RGB as PIL would (CMYK and others go through PIL)."""
    return img.format == "JPEG" and img.mode in ("RGB", "L")


def cropped(image: torch.Tensor, box: Box, flip: bool, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Crop `box` of a uint8 CHW tensor on the CPU, resize it to size x size (bilinear,
    antialiased) with torch's uint8 kernel, flip; a batch on a GPU goes to `raywds.loader.decodings.resized_together`.
    With `out` (a channels-last 3 x size x size view: a batch's slot, raywds.loader.blocks.Slots)
    the resize writes there, so the batch is not stacked from copies later.
    The crop is made contiguous channels-last first (copied only where it is not: `box_pixels`'
    is), with the strides torch reads as channels-last: its vectorised uint8 resize then runs
    1.7x faster than on a strided view, copy included. (unsqueeze(0) of a channels-last CHW
    tensor gives the batch a stride of 3, which torch takes for another layout: 1.7x slower.)"""
    top, left, height, width = box
    resized = RESIZING.timed(_resized, image[:, top : top + height, left : left + width], (size, size), out)
    if not flip:
        return resized
    return resized.flip(-1) if out is None else out.copy_(resized.flip(-1))


def _resized(image: torch.Tensor, size: tuple[int, int], out: torch.Tensor | None = None) -> torch.Tensor:
    """A uint8 CHW image resized to `size` (height, width), bilinear and antialiased, by torch's
    uint8 kernel on a contiguous channels-last copy (see `cropped`), into `out` when given (the
    kernel F.interpolate calls, with its out= form)."""
    batch = image.permute(1, 2, 0).contiguous()[None].permute(0, 3, 1, 2)
    if out is None:
        return F.interpolate(batch, size=size, mode="bilinear", antialias=True, align_corners=False)[0]
    torch.ops.aten._upsample_bilinear2d_aa.out(batch, list(size), False, None, None, out=out[None])
    return out


def _into(image: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`image`, copied into `out` when given."""
    return image if out is None else out.copy_(image)


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


def train_crop(
    data: bytes,
    size: int,
    scale: tuple[float, float],
    rng: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The `cpu` decoder: a random crop (drawn from `rng`) of the image in `data`, decoding only
    what it needs; into `out` when given (see `cropped`)."""
    shape = _jpeg.size(data) if _jpeg is not None else None
    if shape is not None:  # a JPEG the region decoder reads: its header gives the size, no PIL
        box, flip = draw_crop(*shape, scale, rng)
        r = reduction(box, size)
        if r == 1:  # cut to the box as libjpeg decodes it: no copy of the crop before resizing
            return cropped(box_pixels(data, box), (0, 0, box[2], box[3]), flip, size, out)
        image, y0, x0 = region(data, box, r)
        return cropped(image, scaled_box(box, r, (y0, x0), image.shape[1:]), flip, size, out)
    with Image.open(io.BytesIO(data)) as img:  # without the extension, or not a plain JPEG
        box, flip = draw_crop(img.height, img.width, scale, rng)
        r = reduction(box, size) if img.format == "JPEG" else 1
        if r == 1 and plain_jpeg(img):
            return cropped(jpeg_tensor(data), box, flip, size, out)
        if r > 1:
            img.draft("RGB", (img.width // r, img.height // r))  # libjpeg decodes the whole image at 1/r scale
        return _into(_resampled(img, box, r, (0, 0), flip, size), out)


def scaled_box(box: Box, r: int, origin: tuple[int, int], shape: tuple[int, ...]) -> Box:
    """`box` in the 1/r image decoded from `origin` on (of `shape`: rows, columns), its corners
    rounded to that image's pixels: at most half a pixel of it (r/2 of the full image's) from
    where they fall. Resized by torch's uint8 kernel (`cropped`), 0.26 ms less a 128 px crop than
    PIL's resize of the fractional box (benchmarks/size_bench.py)."""
    (top, left, h, w), (y0, x0) = box, origin
    y1, x1 = min(round((top + h) / r) - y0, shape[0]), min(round((left + w) / r) - x0, shape[1])
    y, x = max(round(top / r) - y0, 0), max(round(left / r) - x0, 0)
    return y, x, max(y1 - y, 1), max(x1 - x, 1)


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
    tensor = _pil_tensor(out)
    return tensor.flip(-1) if flip else tensor


def val_crop(data: bytes, size: int, resize: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Resize the short side to `resize` (default size / 0.875; bilinear, antialiased), then the
    centre size x size: torchvision's Resize and CenterCrop on the decoded tensor, the same sizes
    and pixels; into `out` when given."""
    image = whole_image(data)
    _, h, w = image.shape
    short = resize or round(size / 0.875)
    new_h, new_w = (int(short * h / w), short) if w <= h else (short, int(short * w / h))
    if (new_h, new_w) != (h, w):
        image = _resized(image, (new_h, new_w))
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    return _into(image[:, top : top + size, left : left + size], out)


def reference_train(size: int, scale: tuple[float, float]) -> Callable[[bytes], torch.Tensor]:
    """The `pil` decoder: torchvision's standard train transform, uint8 out."""
    from torchvision import transforms

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


def reference_val(size: int, resize: int | None = None) -> Callable[[bytes], torch.Tensor]:
    """The `pil` decoder's validation crop: torchvision's Resize(resize) and CenterCrop(size)."""
    from torchvision import transforms

    transform = transforms.Compose(
        [transforms.Resize(resize or round(size / 0.875)), transforms.CenterCrop(size), transforms.PILToTensor()]
    )
    return functools.partial(_transformed, transform)


def open_rgb(data: bytes) -> Image.Image:
    """PIL sniffs the real format, so grayscale, CMYK and PNG-named-JPEG files all come out RGB."""
    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


OutOf = Callable[[tuple[int, ...]], torch.Tensor | None]
"""Where a worker stacks a batch of `shape`: a reused shared-memory block, or None for a fresh one."""


def stack_crops(images: list[torch.Tensor], out_of: OutOf | None = None) -> torch.Tensor:
    """uint8 CHW crops -> an NCHW batch stored channels-last (the layout the crops come in and
    CUDA models want). In a DataLoader worker the batch is made in shared memory, so handing
    it over copies nothing more (as torch's default_collate does): in the block `out_of(shape)`
    gives (raywds.loader.blocks), else in a fresh one. Crops the worker decoded straight into
    their batch's slots (raywds.loader.blocks.Slots) are that block already: nothing is copied."""
    filled = _filled_block(images)
    if filled is not None:
        return filled
    hwc = [image.permute(1, 2, 0) for image in images]
    out = None
    if get_worker_info() is not None:
        shape = (len(hwc), *hwc[0].shape)
        out = out_of(shape) if out_of is not None else None
        if out is None:
            out = torch.empty(shape, dtype=torch.uint8).share_memory_()
    return torch.stack(hwc, out=out).permute(0, 3, 1, 2)


def _filled_block(images: list[torch.Tensor]) -> torch.Tensor | None:
    """The shared-memory block `images` lie in, one slot after the other from its start, as NCHW
    (a view, not a copy); None when they lie anywhere else."""
    first = images[0]
    hwc = first.permute(1, 2, 0)
    if first.dtype != torch.uint8 or first.storage_offset() != 0 or not hwc.is_contiguous():
        return None
    storage, size = first.untyped_storage(), first.numel()
    if not storage.is_shared():  # not a block: stacked into one, as before
        return None
    for i, image in enumerate(images):
        if image.untyped_storage().data_ptr() != storage.data_ptr() or image.storage_offset() != i * size:
            return None
        if image.shape != first.shape or not image.permute(1, 2, 0).is_contiguous():
            return None
    h, w, c = hwc.shape
    block = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (len(images), h, w, c), (size, w * c, c, 1))
    return block.permute(0, 3, 1, 2)
