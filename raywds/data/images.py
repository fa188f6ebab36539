"""What a sample keeps of an image file: its format, mode and size checked by decoding it, a JPEG
rewritten losslessly with restart markers (raywds.data._restarts, which the loader's region
decoder cuts a crop at), or downscaled for `--max-side`. raywds.data.convert calls `stored`
for each file.
"""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

from raywds.data.shardoptions import ConvertOptions

try:
    from raywds.data import _restarts
except ImportError:  # built without a C compiler or libjpeg's headers (see setup.py)
    _restarts = None  # type: ignore[assignment]


def rewrites_jpegs(options: ConvertOptions) -> bool:
    """Whether JPEGs get restart markers: unless `keep_jpeg_bytes`, where the extension was built."""
    return not options.keep_jpeg_bytes and _restarts is not None


def inspect_image(data: bytes, *, decode_jpeg: bool = True) -> dict[str, Any]:
    """The real format, mode and size of an image; raises ValueError if it cannot be decoded.

    JPEGs are decoded at 1/8 scale (PIL draft mode): that still reads every byte of the
    entropy-coded data, so truncation is caught, at about 60% of a full decode's cost. Without
    `decode_jpeg` a JPEG's header alone is read (the caller checks the rest)."""
    if not data:
        raise ValueError("empty file")
    try:
        with Image.open(io.BytesIO(data)) as img:
            meta = {"format": img.format, "mode": img.mode, "width": img.width, "height": img.height}
            if img.format == "JPEG":
                if not decode_jpeg:
                    return meta
                img.draft(img.mode, (max(1, img.width // 8), max(1, img.height // 8)))
            img.load()
    except Exception as e:  # noqa: BLE001 - PIL raises many types for bad data
        raise ValueError(f"not a readable image ({type(e).__name__}: {e})") from None
    return meta


def with_restarts(data: bytes) -> bytes:
    """The JPEG rewritten losslessly with restart markers (raywds.data._restarts), which the
    loader's region decoder cuts a crop's rows and columns at; the same bytes object without the
    extension or for a JPEG the region decoder does not read (CMYK). Raises ValueError ("not a
    readable image (…)") for data libjpeg finds corrupt or truncated."""
    try:
        return (_restarts.add_restarts(data) if _restarts is not None else None) or data
    except ValueError as e:  # truncated, or damage PIL's draft decode lets through
        raise ValueError(f"not a readable image ({e})") from None


def stored(data: bytes, options: ConvertOptions) -> tuple[bytes, dict[str, Any]]:
    """What a sample keeps of an image file, and the image's meta; raises ValueError for one that
    cannot be read. A JPEG gets restart markers (`with_restarts`): adding them reads every byte
    with libjpeg, which stops at damage, so the draft decode that checks a JPEG is left out then."""
    rewrite = rewrites_jpegs(options)
    limit = options.max_side
    meta = inspect_image(data, decode_jpeg=not rewrite or bool(limit))
    if limit and max(meta["width"], meta["height"]) > limit:
        data = downscale(data, meta, limit)
    if rewrite and meta["format"] == "JPEG":
        rewritten = with_restarts(data)
        if rewritten is data and not limit:  # CMYK or YCCK, kept as it is: checked as any JPEG
            inspect_image(data)
        data = rewritten
    return data, meta


def downscale(data: bytes, meta: dict[str, Any], max_side_px: int) -> bytes:
    """Shrink so the longer side is `max_side_px`, re-encoded in the image's own format."""
    with Image.open(io.BytesIO(data)) as img:
        img.draft(img.mode, (max_side_px, max_side_px))  # JPEG: decode straight at a smaller scale
        small = img.copy()
    small.thumbnail((max_side_px, max_side_px), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    fmt = meta["format"] if meta["format"] in ("JPEG", "PNG", "WEBP") else "PNG"
    small.save(out, format=fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    meta.update(resized_from=[meta["width"], meta["height"]], width=small.width, height=small.height)
    return out.getvalue()
