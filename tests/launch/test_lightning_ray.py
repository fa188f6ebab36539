"""raywds.lightning's DataModule inside Ray Train's Lightning integration (RayDDPStrategy,
RayLightningEnvironment, RayTrainReportCallback), through the example's own `fit_on_ray`."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import epoch_keys, small_config, tar_keys

pytest.importorskip("lightning")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_imagenet.py"


def test_the_datamodule_under_ray_train_trains_split_epochs_exactly(
    shards: Path, tmp_path: Path, local_ray: None
) -> None:
    """2 Ray Train workers, split mode with 8 and 7 batches a rank: every sample once an epoch,
    validation over all 50, and Ray keeps the Lightning checkpoint each epoch reports."""
    from ray import cloudpickle

    spec = importlib.util.spec_from_file_location("lightning_imagenet", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = sys.modules["lightning_imagenet"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    cloudpickle.register_pickle_by_value(example)  # the workers cannot import the example by name
    cfg = small_config(
        shards, mode="split", batch_size_per_rank=8, num_epochs=2, audit_dir=str(tmp_path / "audit"),
        out_dir=str(tmp_path / "run"),
    )  # fmt: skip
    result = example.fit_on_ray(cfg, 2, storage=str(tmp_path / "ray"))
    for e in range(2):
        assert epoch_keys(tmp_path / "audit", e, shards) == Counter(tar_keys(shards)), f"epoch {e + 1}"
    assert result.metrics["val_samples"] == 50 and result.metrics["epoch"] == 1, result.metrics
    assert result.checkpoint is not None
    assert Path(result.checkpoint.path).is_relative_to(tmp_path / "ray")
