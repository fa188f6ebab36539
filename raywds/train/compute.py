"""How a rank computes: device, precision and memory format, chosen once and passed down.

Batches arrive as uint8 images (workers do only the crop and flip), or as JPEG bytes that the
device decodes (`--decode device`, raywds.loader.crops); they are copied to the device (non-blocking,
from pinned memory on CUDA), turned into floats and normalised there.
On CUDA the defaults are bf16 autocast, channels_last and cudnn.benchmark; on the CPU, float32
and the default layout. Every choice can be forced, so the CUDA path's plumbing runs on a CPU.
With `--compile` the batch dimension of every input is marked dynamic, so an epoch's shorter
last batch (split mode) runs the graph compiled for the full ones instead of compiling another;
with `--progressive-resize` its height and width too, so a new epoch's crop size does not compile again.
`auto` picks contiguous instead of channels_last for a compiled model on crops under
COMPILED_CHANNELS_LAST_MIN_PX: torch 2.11's inductor then fails in the first backward pass on an
H100 (a ResNet's last feature maps are 1x1 and cuDNN returns a weight gradient in the other layout).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from raywds.loader.decodings import Encoded
from raywds.train.config import TrainConfig

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MEAN_255 = tuple(m * 255 for m in IMAGENET_MEAN)
STD_255 = tuple(s * 255 for s in IMAGENET_STD)
COMPILED_CHANNELS_LAST_MIN_PX = 64
"""The smallest crop `auto` compiles channels_last: 64 px ran on an H100, 28 and 32 px failed."""


@dataclass(frozen=True)
class Compute:
    device: str
    autocast_dtype: torch.dtype | None
    """bf16 autocast, or None for float32."""
    channels_last: bool
    dynamic_batch: bool = False
    """Mark each input's batch dimension dynamic for torch.compile (set with cfg.compile)."""
    dynamic_size: bool = False
    """Mark its height and width dynamic too (with cfg.compile and --progressive-resize): one graph
    for every epoch's crop size, not a compile at each new size."""
    mean: tuple[float, ...] = IMAGENET_MEAN
    """--mean (the weights' own, else ImageNet's), on a 0-1 scale."""
    std: tuple[float, ...] = IMAGENET_STD

    @classmethod
    def for_run(cls, cfg: TrainConfig, device: str) -> Compute:
        cuda = device.startswith("cuda")
        precision = cfg.precision if cfg.precision != "auto" else ("bf16" if cuda else "fp32")
        layout = cfg.memory_format
        if layout == "auto":
            smallest = min([*cfg.train_sizes, cfg.val_crop])
            small_compiled = cfg.compile and smallest < COMPILED_CHANNELS_LAST_MIN_PX
            layout = "channels_last" if cuda and not small_compiled else "contiguous"
        if cuda:
            torch.backends.cudnn.benchmark = True  # fixed input sizes: let cuDNN pick the fastest kernels
        return cls(
            device,
            torch.bfloat16 if precision == "bf16" else None,
            layout == "channels_last",
            dynamic_batch=cfg.compile,
            dynamic_size=cfg.compile and cfg.progressive_resize is not None,
            mean=cfg.normalisation()[0],
            std=cfg.normalisation()[1],
        )

    def model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        return model.to(memory_format=torch.channels_last) if self.channels_last else model  # type: ignore[call-overload]

    @functools.cached_property
    def _mean_std(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Made on the device once, not per batch."""
        mean = torch.tensor([m * 255 for m in self.mean], device=self.device).view(1, 3, 1, 1)
        return mean, torch.tensor([s * 255 for s in self.std], device=self.device).view(1, 3, 1, 1)

    def inputs(self, images: torch.Tensor | Encoded, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 NCHW on the host, or JPEG bytes and crops (`--decode device`) -> normalised float on the device."""
        x = images.decode(self.device) if isinstance(images, Encoded) else images.to(self.device, non_blocking=True)
        if x.dtype == torch.uint8:
            mean, std = self._mean_std
            # In place: 21 ms for a CPU batch where two new tensors took 58 (benchmarks/finetune_bench.py).
            x = x.float().sub_(mean).div_(std)
        x = x.contiguous(memory_format=torch.channels_last if self.channels_last else torch.contiguous_format)
        if self.dynamic_batch:
            # Traced with a symbolic batch size from the first step: a shorter batch then reuses the
            # graph (torch.compile would otherwise specialise on the first size and recompile for the
            # next). `maybe_`: a model that needs a fixed size still compiles, specialised, not fails.
            torch._dynamo.maybe_mark_dynamic(x, 0)
            if self.dynamic_size:
                torch._dynamo.maybe_mark_dynamic(x, 2)
                torch._dynamo.maybe_mark_dynamic(x, 3)
        return x, labels.to(self.device, non_blocking=True)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.split(":")[0], dtype=self.autocast_dtype):
            yield
