"""`--decode` as objects: each way of decoding, what it does in the loader and what the rest of
raywds asks of it. The config holds the name (text); `decoding(cfg.decode)` is where it is
parsed, as the modes are in raywds.plan.modes.

    crop = decoding(cfg.decode).train_crop(224, (0.08, 1.0))   # crop(data, rng=...) in a worker
    decoding("device").in_workers                               # False: the device decodes
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial as bind
from typing import Any

from raywds.errors import ConfigError
from raywds.loader import decode, encoded


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
    val_crop: Callable[[int], Callable[[bytes], Any]]
    """size -> the validation centre crop: crop(data)."""


def _crop(fn: Callable[..., Any]) -> Callable[[int, tuple[float, float]], Callable[..., Any]]:
    return lambda size, scale: bind(fn, size=size, scale=scale)


def _centre(size: int) -> Callable[[bytes], Any]:
    return bind(decode.val_crop, size=size)


DECODINGS: dict[str, Decoding] = {
    d.name: d
    for d in (
        Decoding(
            "cpu", in_workers=True, region=True, fills=True, train_crop=_crop(decode.train_crop), val_crop=_centre
        ),
        Decoding(
            "device",
            in_workers=False,
            region=False,
            fills=False,
            train_crop=_crop(encoded.encoded_crop),
            val_crop=_centre,
        ),
        Decoding(
            "pil",
            in_workers=True,
            region=False,
            fills=False,
            train_crop=decode.reference_train,
            val_crop=decode.reference_val,
        ),
    )
}


def decoding(name: str) -> Decoding:
    """The decoding `--decode NAME` names."""
    try:
        return DECODINGS[name]
    except KeyError:
        raise ConfigError(f"decode={name!r} is not one of {', '.join(DECODINGS)}") from None
