"""`--compile`: the compiled model keeps one graph when an epoch ends on a shorter batch."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch._dynamo
from support.runs import small_config

from raywds.train.compute import Compute
from raywds.train.trainer import train
from raywds.world import World


def test_a_short_last_batch_does_not_recompile(shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Split mode gives 3 batches of 32 and then one of 24 (120 samples). The batch dimension is
    marked dynamic from the first step (raywds.train.compute), so the trainer's compiled model
    runs both sizes with the one graph it traced first; left static, the batch of 24 would be
    traced and compiled again (for a ResNet-50 on a GPU, inductor's whole compile once more).
    Dynamo decides on recompiling before any backend runs, so the test traces with the `eager`
    backend: the same guards, without inductor's C++ compile on the CPU. Both sizes are at
    least 16: on the CPU, oneDNN's convolutions are chosen by batch size, which adds a guard
    at 16."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    cfg = small_config(shards, mode="split", compile=True, epochs=1, batch_size=32, loader_workers=0)
    final = train(cfg, World(), run_dir=None)
    torch._dynamo.reset()
    assert final["train_samples"] == 120 and final["step"] == 4, "the epoch ends on a batch of 24"
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_auto_layout_compiles_small_crops_contiguous(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, `auto` is channels_last, except for a compiled model on crops under 64 px: there
    torch's inductor failed on an H100 in the first backward pass of a ResNet-18 (28 and 32 px;
    64 px ran). A layout the user names is kept."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)

    def layout(**overrides: object) -> bool:
        return Compute.for_run(small_config("unused", **overrides), "cuda").channels_last

    assert not layout(compile=True, image_size=32)
    assert layout(compile=True, image_size=64)
    assert layout(image_size=32)
    assert layout(compile=True, image_size=32, memory_format="channels_last")
    assert not Compute.for_run(small_config("unused", compile=True, image_size=224), "cpu").channels_last
