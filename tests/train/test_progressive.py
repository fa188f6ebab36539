"""--progressive-resize: FFCV's schedule, each epoch trained at its planned size with every sample
once (split mode), one compiled graph for every size, and crops decoded at a reduced DCT scale
more often the smaller they are."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo
from support.runs import small_config

from raywds.errors import ConfigError
from raywds.loader.crops import crop_rng, draw_crop, reduction
from raywds.runs.folder import RunDir
from raywds.train.config import TrainConfig
from raywds.train.trainer import train
from raywds.world import World


def ffcv_resolution(epoch: int, min_res: int, max_res: int, end_ramp: int, start_ramp: int) -> int:
    """FFCV's ImageNet example (train_imagenet.py, get_resolution), epochs from 0."""
    assert min_res <= max_res
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interp = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])
    return int(np.round(interp[0] / 32)) * 32


SCHEDULES = [(88, 160, 192, 65, 76), (40, 160, 192, 29, 34), (16, 128, 224, 2, 13), (30, 96, 256, 0, 29)]


@pytest.mark.parametrize(("epochs", "low", "high", "start", "end"), SCHEDULES)
def test_the_schedule_is_ffcvs(epochs: int, low: int, high: int, start: int, end: int) -> None:
    """raywds counts epochs from 1 where FFCV's flags count from 0: --progressive-epochs START+1:END+1."""
    cfg = TrainConfig(
        data="x", epochs=epochs, progressive_resize=f"{low}:{high}", progressive_epochs=f"{start + 1}:{end + 1}"
    )
    assert cfg.train_sizes == [ffcv_resolution(e, low, high, end, start) for e in range(epochs)]
    assert all(size % 32 == 0 for size in cfg.train_sizes) and cfg.train_sizes[-1] == high
    assert [cfg.loader(e).crop_size for e in range(epochs)] == cfg.train_sizes
    assert {cfg.loader(e).val_crop_size for e in range(epochs)} == {224}, "validation keeps its size"


def test_the_schedule_is_checked_in_one_line() -> None:
    for flags, said in [
        ({"progressive_resize": "192:160"}, "MIN:MAX with 32 <= MIN <= MAX"),
        ({"progressive_resize": "160"}, "two numbers as A:B"),
        ({"progressive_resize": "128:192", "progressive_epochs": "5:2"}, "START:END with 1 <= START <= END"),
        ({"progressive_epochs": "1:3"}, "applies with progressive_resize"),
        ({"progressive_resize": "128:192", "train_crop_size": 176}, "give one"),
    ]:
        with pytest.raises(ConfigError, match=said):
            TrainConfig(data="x", **flags)
    default = TrainConfig(data="x", epochs=5, progressive_resize="128:256")
    assert default.train_sizes == [128, 160, 192, 224, 256], "default: the whole run"


def test_the_schedule_is_parsed_once_into_numbers() -> None:
    from raywds.train.config import Progression

    cfg = TrainConfig(data="x", epochs=10, progressive_resize="160:192", progressive_epochs="2:6")
    assert cfg.progression == Progression(160, 192, 2.0, 6.0)
    assert cfg.progression is cfg.progression, "parsed once, not at every epoch's read"
    assert TrainConfig(data="x").progression is None


@pytest.mark.slow
def test_each_epoch_trains_at_its_planned_size_on_every_sample_once(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Split mode, 32 -> 64 -> 96 px over three epochs, compiled: each epoch row's image_size_px is
    the side of the images the model was given, every sample once per epoch, validation at its
    own crop; torch.compile traces one graph for the three sizes (the height and width are
    marked dynamic; left static, dynamo compiles again at the second size). As in
    test_compile.py, the `eager` backend: dynamo's guards without inductor's C++ compile."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    cfg = small_config(
        shards, mode="split", epochs=3, batch_size=32, loader_workers=1, progressive_resize="32:96",
        val_crop_size=40, compile=True, out=str(tmp_path),
    )  # fmt: skip
    final = train(cfg, World(), run_dir=RunDir(tmp_path))
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r.get("kind") == "epoch"]
    assert [r["image_size_px"] for r in epochs] == [32, 64, 96]
    assert all((r["epoch_samples"], r["epoch_distinct"], r["epoch_duplicates"]) == (120, 120, 0) for r in epochs)
    assert final["val_samples"] == 50
    assert re.search(
        r"^epoch 2/3  loss [\d.]+  val top-1 [\d.]+  top-5 [\d.]+  at 64 px  images/s", "\n".join(caplog.messages), re.M
    )
    assert graphs == 1, dict(counters["stats"])


def test_smaller_crops_decode_at_reduced_scale_more_often() -> None:
    """The decoder picks the largest DCT scale-down that keeps the crop at least its output size:
    of a 1024 x 768 photo, most crops decode at 1/2 or less for 128 px, a fifth for 224 px. (A
    500 x 375 photo's crops are never twice 192 px on both sides: there only 128 and 160 px gain.)"""
    boxes = [draw_crop(768, 1024, (0.08, 1.0), crop_rng(0, 0, i))[0] for i in range(2000)]
    share = {size: np.mean([reduction(box, size) > 1 for box in boxes]) for size in (128, 160, 192, 224)}
    assert share[128] > share[160] > share[192] > share[224] > 0.1, share
    assert share[128] > 0.5, share
    for size in (128, 224):
        scaled = [b for b in boxes if reduction(b, size) > 1]
        assert all(min(b[2], b[3]) >= size * reduction(b, size) for b in scaled), "never below the output size"
    small = [draw_crop(375, 500, (0.08, 1.0), crop_rng(0, 0, i))[0] for i in range(2000)]
    assert np.mean([reduction(b, 128) > 1 for b in small]) > np.mean([reduction(b, 192) > 1 for b in small]) == 0
