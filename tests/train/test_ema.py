"""--model-ema: the average torchvision's reference keeps (the same update, the same adjusted decay),
validated beside the model, checkpointed and restored, and what best/ is chosen by."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from support.runs import small_config
from torch import nn

from raywds.data.dataset import manifest_of
from raywds.errors import ConfigError
from raywds.loader.loader import val_loader
from raywds.models.start import start_model
from raywds.runs import files
from raywds.runs.checkpoint import load_checkpoint
from raywds.train.compute import Compute
from raywds.train.config import TrainConfig
from raywds.train.ema import ModelEma, adjusted_decay
from raywds.train.loop import evaluate
from raywds.world import World


def test_the_average_is_the_hand_computed_one_and_copies_the_weights_during_warmup() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    ema = ModelEma(model, decay=0.9, every=2, warmup_epochs=1)
    expected = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    averaged_so_far = 0  # as AveragedModel counts: 0 means the next update copies
    for step in range(1, 9):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model[1].running_mean.add_(1.0)  # a buffer, averaged too (use_buffers)
        epoch = 0 if step <= 4 else 1  # epoch 0 is the warm-up
        updated = ema.after_step(model, step, epoch)
        assert updated == (step % 2 == 0)
        if not updated:
            continue
        for name, value in model.state_dict().items():
            if value.dtype.is_floating_point:
                now = value.detach().float().clone()  # (state_dict's tensors are the live ones)
                expected[name] = now if averaged_so_far == 0 else 0.9 * expected[name] + 0.1 * now
        averaged_so_far = 0 if epoch < 1 else averaged_so_far + 1
    averaged = ema.module.state_dict()
    for name, value in expected.items():
        if value.dtype.is_floating_point:
            assert torch.allclose(averaged[name].float(), value, atol=1e-6), name


def test_the_decay_is_adjusted_as_torchvisions_reference_adjusts_it(shards: Path) -> None:
    cfg = small_config(shards, model_ema=True, batch_size=128, epochs=600, model_ema_steps=32, model_ema_decay=0.99998)
    # references/classification/train.py: adjust = world_size * batch_size * steps / epochs,
    # alpha = min(1, (1 - decay) * adjust)
    alpha = min(1.0, (1 - 0.99998) * (8 * 128 * 32 / 600))
    assert adjusted_decay(cfg, World(rank=0, world_size=8)) == pytest.approx(1 - alpha)
    capped = dataclasses.replace(cfg, epochs=1, model_ema_decay=0.99)
    assert adjusted_decay(capped, World(rank=0, world_size=8)) == 0.0  # alpha capped at 1
    with pytest.raises(ConfigError, match=r"model_ema_decay=1.0 must lie in \(0, 1\)"):
        small_config(shards, model_ema=True, model_ema_decay=1.0)


def test_a_run_validates_and_checkpoints_the_average_and_a_resume_restores_it(shards: Path, tmp_path: Path) -> None:
    from raywds.launch.local import run_local

    run = tmp_path / "run"
    # 0.99 is adjusted to 0.84 for this run (0.9 would be to 0: an average that is the weights)
    cfg = small_config(
        shards, epochs=2, max_steps=12, model_ema=True, model_ema_steps=2, model_ema_decay=0.99, out=str(run),
        warmup_epochs=0.0,
    )  # fmt: skip
    run_local(cfg)  # 8 steps an epoch: stopped at step 12, inside epoch 2
    stopped = load_checkpoint(run / files.CHECKPOINT)
    assert int(stopped["model_ema"]["n_averaged"]) == 12 // 2
    rows = [json.loads(line) for line in (run / files.METRICS).read_text().splitlines()]
    first = next(r for r in rows if r["kind"] == "epoch")
    assert {"val_top1_ema", "val_top5_ema", "val_loss_ema"} <= set(first)
    run_local(dataclasses.replace(cfg, max_steps=None, resume=str(run)))
    final = load_checkpoint(run / files.CHECKPOINT)
    assert int(final["model_ema"]["n_averaged"]) == 16 // 2, "the average went on from the checkpoint's"
    best = json.loads((run / files.BEST_ROW).read_text())
    epochs = [json.loads(line) for line in (run / files.METRICS).read_text().splitlines() if '"epoch"' in line]
    score = max(max(r.get("val_top1", -1), r.get("val_top1_ema", -1)) for r in epochs if "val_top1" in r)
    assert max(best["val_top1"], best["val_top1_ema"]) == score, "best/ by the better of the model and its average"
    last = [r for r in epochs if r["kind"] == "epoch"][-1]
    assert last["val_loss_ema"] != last["val_loss"], "the average validated, not the weights twice"
    again = validated(cfg, final["model_ema"])
    assert again["val_loss"] == pytest.approx(last["val_loss_ema"], rel=1e-6), (again, last)
    assert (again["val_top1"], again["val_top5"]) == (last["val_top1_ema"], last["val_top5_ema"]), (again, last)


def validated(cfg: TrainConfig, average: dict) -> dict[str, float]:
    """The validation split scored here, apart from the run, by the average a checkpoint holds."""
    plain = dataclasses.replace(cfg, loader_workers=0)
    manifest = manifest_of(plain)
    model = start_model(plain.model, manifest.classes).model
    model.load_state_dict({k.removeprefix("module."): v for k, v in average.items() if k != "n_averaged"})
    batches = val_loader(manifest, plain.loader(), World())
    return evaluate(model, batches, World(), Compute.for_run(plain, "cpu"))
