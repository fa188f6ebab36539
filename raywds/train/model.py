"""The model a run trains, by --model name: `demo`, a torchvision name or timm/NAME[.TAG], from
random weights (raywds.models.sources). Pretrained and initial weights: raywds.models.start."""

from __future__ import annotations

from torch import nn

from raywds.models.demo import DemoNet
from raywds.models.sources import parse_model

__all__ = ["DemoNet", "build_model"]


def build_model(name: str, num_classes: int) -> nn.Module:
    """The architecture `name` with random weights and `num_classes` outputs (no downloads)."""
    parsed = parse_model(name)
    return parsed.source.build(parsed, num_classes)
