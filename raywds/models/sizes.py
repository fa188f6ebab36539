"""The image sides a model takes, found by running it once on the meta device (shapes only: no
memory, no arithmetic, no weights), so that a crop too small for --model is refused before a run
starts rather than by the model's traceback in the first step. A ResNet takes any side in a batch
of two, but at least 33 px alone in training (its last BatchNorm needs two values a channel);
the demo network, three 2x2 poolings deep, takes 8 px or more.

    >>> smallest_side("demo", 4, batch=2, training=True)  # 4 px is too small, 8 works
    8
    >>> smallest_side("resnet50", 176, batch=2, training=True) is None  # it takes 176 px
    True
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from raywds.models.sources import parse_model

REFERENCE_SIDE = 224
"""A side the classifiers raywds builds take: where the search for the smallest side ends, and a
model that fails at it too is one the probe cannot judge."""
_FAILURES = (RuntimeError, ValueError, IndexError, AssertionError, TypeError, NotImplementedError)
"""What a model raises on an input it does not take (torch's shape checks, BatchNorm's batch check)."""


@functools.cache
def _meta_model(name: str) -> nn.Module | None:
    """Model `name` on the meta device (ConfigError for an unknown name), or None where it
    cannot be built there."""
    parsed = parse_model(name)
    try:
        with torch.device("meta"):
            return parsed.source.build(parsed, 2)
    except _FAILURES:
        return None


def _takes(model: nn.Module, side: int, batch: int, training: bool) -> bool:
    model.train(training)
    try:
        with torch.no_grad():
            model(torch.empty(batch, 3, side, side, device="meta"))
    except _FAILURES:
        return False
    return True


def smallest_side(name: str, side: int, *, batch: int, training: bool) -> int | None:
    """None when model `name` takes a batch of `batch` square images of `side` px (in training
    mode, or in evaluation), or when a probe cannot tell; else the smallest side above `side`
    that it takes, up to REFERENCE_SIDE: sides tried in growing steps from `side` up, then the
    last step halved down to the one (a model that takes a side takes larger ones up to there)."""
    model = _meta_model(name)
    if model is None or side >= REFERENCE_SIDE or _takes(model, side, batch, training):
        return None
    low, step = side, 1  # low fails
    while not _takes(model, high := min(low + step, REFERENCE_SIDE), batch, training):
        if high == REFERENCE_SIDE:
            return None  # it takes neither: the probe cannot judge this model
        low, step = high, 2 * step
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if _takes(model, middle, batch, training) else (middle, high)
    return high
