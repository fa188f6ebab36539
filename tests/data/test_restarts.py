"""raywds.data._restarts: convert's lossless rewrite of a JPEG with restart markers. The pixels
must be exactly the original's, whatever the layout; what is not pixels (EXIF, ICC) kept; what
it cannot rewrite left alone; damage refused."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image
from support.data import has_restart_markers, pixels
from support.data import noise_jpeg as jpeg
from support.runs import need_jpeg_extension

need_jpeg_extension()

from raywds.data._restarts import add_restarts  # noqa: E402


def restart_interval(data: bytes) -> int:
    at = data.index(b"\xff\xdd")
    return struct.unpack(">H", data[at + 4 : at + 6])[0]


def sof_marker(data: bytes) -> int:
    """The frame's marker: 0xC0 baseline, 0xC2 progressive."""
    i = 2
    while data[i + 1] not in (0xC0, 0xC1, 0xC2):
        i += 2 + struct.unpack(">H", data[i + 2 : i + 4])[0]
    return data[i + 1]


@pytest.mark.parametrize(
    "save",
    [
        dict(subsampling=2),
        dict(subsampling=1),
        dict(subsampling=0),
        dict(mode="L"),
        dict(subsampling=2, progressive=True),
        dict(subsampling=2, restart_marker_rows=2),
        dict(subsampling=2, optimize=True),
    ],
    ids=["4:2:0", "4:2:2", "4:4:4", "grayscale", "progressive", "restart markers already", "optimised"],
)
@pytest.mark.parametrize("size", [(333, 251), (368, 200), (1, 1), (17, 9), (512, 64)])
def test_the_pixels_are_the_originals(save: dict, size: tuple[int, int]) -> None:
    original = jpeg(*size, **save)
    rewritten = add_restarts(original)
    assert rewritten is not None and has_restart_markers(rewritten)
    assert sof_marker(rewritten) == 0xC0, "one baseline scan, which the region decoder cuts"
    np.testing.assert_array_equal(pixels(rewritten), pixels(original))


def test_a_row_is_cut_into_about_eight_runs() -> None:
    assert restart_interval(add_restarts(jpeg(512, 64)) or b"") == 4  # 32 MCUs a row (4:2:0): 8 runs of 4
    assert restart_interval(add_restarts(jpeg(333, 64)) or b"") == 3  # 21: 7 runs of 3
    assert restart_interval(add_restarts(jpeg(368, 64)) or b"") == 23  # 23, a prime: one run a row
    assert restart_interval(add_restarts(jpeg(333, 64, subsampling=0)) or b"") == 6  # 42 (8-pixel MCUs): 7 of 6


def test_what_is_not_pixels_is_kept() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation
    exif[0x010F] = "raywds test camera"
    icc = b"\0" * 128 + b"not a real profile, but kept byte for byte"
    original = jpeg(64, 48, exif=exif.tobytes(), icc_profile=icc)
    rewritten = add_restarts(original)
    assert rewritten is not None
    with Image.open(io.BytesIO(rewritten)) as img:
        assert img.getexif()[0x0112] == 6 and img.getexif()[0x010F] == "raywds test camera"
        assert img.info["icc_profile"] == icc


def test_cmyk_is_left_alone_and_damage_is_refused() -> None:
    assert add_restarts(jpeg(64, 48, mode="CMYK")) is None  # the region decoder does not read it either
    data = jpeg(400, 300)
    with pytest.raises(ValueError, match="JPEG"):
        add_restarts(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match="JPEG"):
        add_restarts(b"<html>not found</html>")
    with pytest.raises(ValueError, match="corrupt JPEG data"):  # bytes libjpeg has no use for, which PIL lets through
        scan = data.index(b"\xff\xda")
        add_restarts(data[: scan + 40] + b"\xff\xd3" + data[scan + 40 :])
