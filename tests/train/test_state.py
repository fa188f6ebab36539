"""What a resume puts back, in process: a checkpoint of a few steps with --model-ema, saved and
loaded as the run folder saves and loads it, restored by the trainer into freshly built objects,
holds the same weights, optimizer state, average and progress tensor for tensor. (raywds keeps no
grad scaler: bf16 autocast needs none, and the CPU trains in float32.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.runs import small_config

from raywds.runs.checkpoint import load_checkpoint, save_checkpoint
from raywds.train.trainer import Trainer
from raywds.world import World


def same(a: Any, b: Any) -> bool:
    """Equal all the way down: tensors by value, dtype and shape; dicts, lists and numbers as they are."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_resume_restores_the_weights_the_optimizer_and_the_average(
    shards: Path, tmp_path: Path, optimizer: str
) -> None:
    # The cosine schedule: the rate at the checkpoint is none a fresh optimizer starts at.
    cfg = small_config(
        shards, optimizer=optimizer, lr=0.05, epochs=2, max_steps=3,
        loader_workers=0, model_ema=True, model_ema_steps=1, model_ema_decay=0.5,
    )  # fmt: skip
    saved: list[dict[str, Any]] = []
    trained = Trainer(cfg, World(), lambda metrics, state: saved.append(state) if state else None, resume=None)
    trained.fit()  # 3 steps, then a checkpoint inside epoch 1
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(saved[-1], path)
    state = load_checkpoint(str(path))

    fresh = Trainer(cfg, World(), None, resume=None)  # what the resumed one would hold without its checkpoint
    resumed = Trainer(cfg, World(), None, resume=state)
    assert resumed.ema is not None and trained.ema is not None and fresh.ema is not None

    kept = {
        "the weights": (trained.model.state_dict(), resumed.model.state_dict(), fresh.model.state_dict()),
        "the optimizer's state": (
            trained.optimizer.state_dict(),
            resumed.optimizer.state_dict(),
            fresh.optimizer.state_dict(),
        ),
        "the average's weights and count": (trained.ema.state_dict(), resumed.ema.state_dict(), fresh.ema.state_dict()),
    }
    for what, (before, after, unrestored) in kept.items():
        assert not same(before, unrestored), f"{what}: three steps changed nothing, so this test could not fail"
        assert same(before, after), f"{what}: not the checkpoint's after a resume"

    moments = {"sgd": {"momentum_buffer"}, "adamw": {"step", "exp_avg", "exp_avg_sq"}}[optimizer]
    restored = resumed.optimizer.state_dict()
    assert all(moments <= set(each) for each in restored["state"].values()) and restored["state"]
    if optimizer == "adamw":
        assert {int(each["step"]) for each in restored["state"].values()} == {3}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in restored["param_groups"]]
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in trained.optimizer.param_groups]
    assert all(g["lr"] != fresh.optimizer.param_groups[0]["lr"] for g in restored["param_groups"])
    assert int(resumed.ema.n_averaged) == int(trained.ema.n_averaged) == 3
    assert resumed.keeper.progress == trained.keeper.progress and resumed.keeper.progress.steps == 3
