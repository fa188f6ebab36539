"""The models raywds builds: `demo`, a small CNN for the generated demo data, or any
torchvision classification model by name (random init, no downloads)."""

from __future__ import annotations

import torch
from torch import nn

from raywds.errors import ConfigError


class DemoNet(nn.Module):
    """A small CNN that learns the demo data in a few CPU minutes."""

    def __init__(self, num_classes: int, width: int = 32):
        super().__init__()

        def block(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            )

        self.features = nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build_model(name: str, num_classes: int) -> nn.Module:
    """`demo`, or any torchvision classification model name (random init: no downloads)."""
    if name == "demo":
        return DemoNet(num_classes)
    import torchvision  # here: a 1.5-2.5 s import the demo network does not need

    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise ConfigError(
            f"unknown model {name!r}; use `demo` or a torchvision model such as resnet50 ({len(available)} known)"
        )
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
