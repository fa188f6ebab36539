"""raywds.loader._jpeg, the region decoder: the pixels of any box, at any DCT scale, must be exactly
those of decoding the whole image, for every JPEG layout a photo collection holds, and for
JPEGs as convert rewrites them (restart markers the decoder cuts a box's rows and columns at).
(The region may be wider than the box; only the box's pixels are promised.)"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from support.data import noise_jpeg
from support.runs import need_jpeg_extension

from raywds.loader import crops

need_jpeg_extension()

from raywds.data._restarts import add_restarts  # noqa: E402
from raywds.loader._jpeg import decode_box, decode_region  # noqa: E402


def jpeg(width: int, height: int, mode: str = "RGB", rewritten: bool = False, **save: object) -> bytes:
    """Colourful noise; `rewritten` as convert stores it, with restart markers the decoder cuts
    the JPEG at."""
    data = noise_jpeg(width, height, mode, **save)
    return add_restarts(data) or b"" if rewritten else data


def whole(data: bytes, scale: int = 1) -> np.ndarray:
    """The whole image at 1/scale, as PIL (libjpeg's DCT scaling) decodes it: HWC RGB."""
    with Image.open(io.BytesIO(data)) as img:
        if scale > 1:
            img.draft("RGB", (img.width // scale, img.height // scale))
        return np.asarray(img.convert("RGB"))


def boxes(width: int, height: int, n: int, seed: int) -> list[tuple[int, int, int, int]]:
    """Random boxes plus the awkward ones: corners, edges, the whole image, one pixel, iMCU-aligned."""
    rng = np.random.default_rng(seed)
    out = [
        (0, 0, height, width),
        (0, 0, 1, 1),
        (height - 1, width - 1, 1, 1),
        (16, 16, 16, 16),
        (0, width - 17, height, 17),
        (height - 9, 0, 9, width),
        (7, 3, 17, 40),  # around the 16 rows libjpeg is asked for at once
        (5, 0, 1, 1),  # a crop of 2 pixels (1 chroma sample) upsamples wrong: widened to 3
        (5, 0, 33, width),
    ]
    for _ in range(n):
        h, w = int(rng.integers(1, height + 1)), int(rng.integers(1, width + 1))
        out.append((int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w))
    return out


LAYOUTS = {
    "4:2:0": dict(subsampling=2),
    "4:2:2": dict(subsampling=1),
    "4:4:4": dict(subsampling=0),
    "progressive": dict(subsampling=2, progressive=True),
    "restart markers": dict(subsampling=2, restart_marker_blocks=3),
    "4:2:0, rewritten": dict(subsampling=2, rewritten=True),
    "4:2:2, rewritten": dict(subsampling=1, rewritten=True),
    "4:4:4, rewritten": dict(subsampling=0, rewritten=True),
    "grayscale, rewritten": dict(mode="L", rewritten=True),
    "progressive, rewritten": dict(subsampling=2, progressive=True, rewritten=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("scale", [1, 2, 4, 8])
def test_region_pixels_equal_the_whole_decode(layout: str, scale: int) -> None:
    width, height = 333, 251  # not multiples of the iMCU size
    data = jpeg(width, height, **LAYOUTS[layout])  # type: ignore[arg-type]
    full = whole(data, scale)
    for top, left, h, w in boxes(width, height, 40, seed=scale):
        pixels, y0, x0, rows, cols = decode_region(data, top, left, h, w, scale)
        region = np.frombuffer(pixels, dtype=np.uint8).reshape(rows, cols, 3)
        assert y0 <= top // scale and x0 <= left // scale, "the region starts at or before the box"
        assert y0 + rows >= -(-(top + h) // scale) and x0 + cols >= -(-(left + w) // scale), "and ends at or after it"
        assert y0 + rows <= full.shape[0] and x0 + cols <= full.shape[1]
        y, x, y1, x1 = (
            top // scale,
            left // scale,
            -(-(top + h) // scale),
            -(-(left + w) // scale),
        )  # the box at 1/scale
        got = region[y - y0 : y1 - y0, x - x0 : x1 - x0]
        np.testing.assert_array_equal(got, full[y:y1, x:x1], err_msg=f"box {(top, left, h, w)}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_box_pixels_are_exactly_the_box(layout: str) -> None:
    """decode_box cuts each row to the box as it decodes: the box's pixels of the whole decode, contiguous."""
    width, height = 333, 251
    data = jpeg(width, height, **LAYOUTS[layout])  # type: ignore[arg-type]
    full = whole(data)
    for top, left, h, w in boxes(width, height, 40, seed=5):
        pixels = decode_box(data, top, left, h, w)
        assert len(pixels) == h * w * 3
        got = np.frombuffer(pixels, dtype=np.uint8).reshape(h, w, 3)
        np.testing.assert_array_equal(got, full[top : top + h, left : left + w], err_msg=f"box {(top, left, h, w)}")


def test_region_crop_equals_decode_jpeg() -> None:
    """At full scale the region is the same pixels torchvision's decode_jpeg gives (both libjpeg-turbo)."""
    data = jpeg(500, 375)
    full = crops.jpeg_tensor(data)
    for box in boxes(500, 375, 20, seed=9):
        image, y0, x0 = crops.region(data, box)
        top, left, h, w = box
        assert torch.equal(
            image[:, top - y0 : top - y0 + h, left - x0 : left - x0 + w], full[:, top : top + h, left : left + w]
        )


def test_grayscale_comes_out_rgb() -> None:
    data = jpeg(120, 80, mode="L")
    pixels, y0, x0, rows, cols = decode_region(data, 10, 10, 50, 50, 1)
    region = np.frombuffer(pixels, dtype=np.uint8).reshape(rows, cols, 3)
    np.testing.assert_array_equal(region, whole(data)[y0 : y0 + rows, x0 : x0 + cols])
    assert (region[..., 0] == region[..., 1]).all()


def test_what_it_refuses() -> None:
    data = jpeg(64, 48)
    with pytest.raises(ValueError, match="scale"):
        decode_region(data, 0, 0, 10, 10, 3)
    with pytest.raises(ValueError, match="outside"):
        decode_region(data, 40, 0, 10, 10, 1)
    with pytest.raises(ValueError, match="bad box"):
        decode_region(data, 0, 0, 0, 10, 1)
    with pytest.raises(ValueError, match="colour space"):
        decode_region(jpeg(64, 48, mode="CMYK"), 0, 0, 10, 10, 1)
    with pytest.raises(ValueError, match="JPEG"):
        decode_region(b"not a jpeg at all", 0, 0, 10, 10, 1)
    with pytest.raises(ValueError, match="JPEG"):
        decode_region(data[:20], 0, 0, 10, 10, 1)
    with pytest.raises(ValueError, match="outside"):
        decode_box(data, 40, 0, 10, 10)
    with pytest.raises(ValueError, match="bad box"):
        decode_box(data, 0, 0, 10, 0)
    with pytest.raises(ValueError, match="corrupt JPEG data"):
        decode_box(data[: len(data) // 2], 40, 0, 8, 64)  # a cut file: libjpeg would fill in grey


def runs_of(data: bytes) -> list[int]:
    """Where each restart marker of a JPEG's scan starts."""
    start = data.index(b"\xff\xda")
    return [i for i in range(start, len(data) - 1) if data[i] == 0xFF and 0xD0 <= data[i + 1] <= 0xD7]


@pytest.mark.parametrize("width", [333, 368])  # 21 MCUs a row (7 runs of 3); 23, a prime (one run a row)
def test_a_rewritten_jpeg_cut_to_the_box_gives_the_original_pixels(width: int) -> None:
    height = 251
    original = jpeg(width, height, subsampling=2)
    rewritten = add_restarts(original)
    runs = {333: 7, 368: 1}[width]  # a row's runs: as near 8 as a divisor of its MCUs allows
    assert rewritten is not None and len(runs_of(rewritten)) == 16 * runs - 1  # 16 MCU rows
    full = whole(original)
    for top, left, h, w in boxes(width, height, 60, seed=width):
        got = np.frombuffer(decode_box(rewritten, top, left, h, w), dtype=np.uint8).reshape(h, w, 3)
        np.testing.assert_array_equal(got, full[top : top + h, left : left + w], err_msg=f"box {(top, left, h, w)}")
        for scale in (2, 4, 8):  # the region, and where it says it starts, as for the original
            assert decode_region(rewritten, top, left, h, w, scale) == decode_region(original, top, left, h, w, scale)


def test_the_cut_never_reads_the_rows_above_the_box() -> None:
    """Damage in the first run (bytes libjpeg finds no use for before the first restart marker)
    fails a box that needs the first MCU row, and not one further down: the decoder read only the
    runs the box needs."""
    data = jpeg(333, 251, subsampling=2, rewritten=True)
    first = runs_of(data)[0]
    damaged = data[:first] + b"\x00" * 8 + data[first:]
    with pytest.raises(ValueError, match="corrupt JPEG data"):
        decode_box(damaged, 0, 0, 16, 16)
    assert decode_box(damaged, 120, 100, 60, 80) == decode_box(data, 120, 100, 60, 80)


def test_a_misnumbered_restart_marker_is_not_cut_at() -> None:
    """Markers out of order are decoded as they stand, so libjpeg's complaint reaches the caller."""
    data = bytearray(jpeg(333, 251, subsampling=2, rewritten=True))
    second = runs_of(bytes(data))[1]
    data[second + 1] = 0xD5
    with pytest.raises(ValueError, match="corrupt JPEG data"):
        decode_box(bytes(data), 200, 200, 40, 40)
