"""Fine-tuning: a pretrained start that is really loaded, a classifier grown when the data gains
classes (resume across an append included), frozen epochs, and --layer-decay."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from support.mlflowserver import MlflowServer
from support.runs import small_config

from raywds.data.append import append
from raywds.data.convert import ConvertOptions, convert
from raywds.data.manifest import read_manifest
from raywds.errors import ConfigError
from raywds.launch.local import run_local
from raywds.models.finetune import layer_scales
from raywds.models.sources import parse_model
from raywds.models.start import start_model
from raywds.train.model import DemoNet
from raywds.train.optim import make_optimizer
from raywds.world import World

OPTIONS = ConvertOptions(maxcount=16, seed=3)


def noise_images(out: Path, counts: dict[str, int]) -> Path:
    """`counts[SPLIT/CLASS]` JPEGs of noise in each such folder: images no dataset here holds."""
    rng = np.random.default_rng(5)
    for folder, count in counts.items():
        (out / folder).mkdir(parents=True)
        for k in range(count):
            pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(out / folder / f"noise_{k}.JPEG", format="JPEG", quality=90)
    return out


def rows(run: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"epoch"' in line]


def test_a_pretrained_start_beats_random_weights_after_one_epoch(shards: Path, tmp_path: Path) -> None:
    """Weights trained on this data, as a file: one epoch from them against one from scratch with
    the same seed and rate. Fails where the file's weights are silently not loaded."""
    run_local(small_config(shards, epochs=4, out=str(tmp_path / "teacher")))
    teacher = torch.load(tmp_path / "teacher" / "checkpoint.pt", weights_only=True)["model"]
    save_file(teacher, str(tmp_path / "teacher.safetensors"))
    cfg = small_config(shards, epochs=1, lr=1e-4)
    scratch, _ = run_local(dataclasses.replace(cfg, out=str(tmp_path / "scratch")))
    tuned, _ = run_local(
        dataclasses.replace(cfg, out=str(tmp_path / "tuned"), initial_checkpoint=str(tmp_path / "teacher.safetensors"))
    )
    assert tuned["val_top1"] >= scratch["val_top1"] + 0.3, (tuned["val_top1"], scratch["val_top1"])


def test_a_grown_classifier_keeps_the_old_classes_logits_at_step_0(shards: Path, tmp_path: Path) -> None:
    run_local(small_config(shards, epochs=1, out=str(tmp_path / "run")))
    classes = read_manifest(str(shards)).classes
    before = start_model("demo", classes, initial_checkpoint=str(tmp_path / "run")).model.eval()
    grown = start_model("demo", [*classes, "zzz1", "zzz2"], initial_checkpoint=str(tmp_path / "run"))
    assert (
        grown.fit is not None
        and grown.fit.line() == "the classifier head.2 grown from 10 to 12 classes (the 10 kept, 2 new)"
    )
    x = torch.randn(4, 3, 28, 28)
    with torch.no_grad():
        old, new = before(x), grown.model.eval()(x)
    assert new.shape == (4, 12)
    torch.testing.assert_close(new[:, :10], old, rtol=0, atol=1e-6)  # the same weights; a 12-row matmul may round apart
    other = start_model(
        "demo", [*classes[1:], "zzz1"], initial_checkpoint=str(tmp_path / "run")
    )  # not a prefix: new meaning
    assert other.fit is not None and other.fit.action == "replaced"


def test_a_run_resumes_across_an_append_that_added_a_class(tree: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "shards"
    convert(tree, dataset, OPTIONS)
    run = tmp_path / "run"
    cfg = small_config(dataset, mode="split", epochs=1, out=str(run), model_ema=True, model_ema_steps=1)
    run_local(cfg)
    before = torch.load(run / "checkpoint.pt", weights_only=True)
    append(noise_images(tmp_path / "more", {"train/zzz": 16, "val/zzz": 4}), dataset, OPTIONS)
    metrics, _ = run_local(dataclasses.replace(cfg, epochs=2, resume=str(run)))
    after = torch.load(run / "checkpoint.pt", weights_only=True)
    assert after["classes"] == [*before["classes"], "zzz"] and after["model"]["head.2.weight"].shape[0] == 11
    assert after["model_ema"]["module.head.2.weight"].shape[0] == 11
    assert [r["epoch"] for r in rows(run)] == [1, 2] and metrics["train_samples"] == 136


def test_a_frozen_epoch_changes_no_backbone_tensor_and_no_batchnorm_statistic(shards: Path, tmp_path: Path) -> None:
    run_local(small_config(shards, epochs=1, out=str(tmp_path / "start")))
    start = torch.load(tmp_path / "start" / "checkpoint.pt", weights_only=True)["model"]
    cfg = small_config(
        shards, epochs=2, freeze_epochs=1, initial_checkpoint=str(tmp_path / "start"), out=str(tmp_path / "run")
    )
    run_local(dataclasses.replace(cfg, max_steps=8))  # the frozen first epoch: 8 steps of 16
    frozen = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["model"]
    moved = [k for k in start if not torch.equal(start[k], frozen[k])]
    assert sorted(moved) == ["head.2.bias", "head.2.weight"]  # running means, variances and counts included
    run_local(dataclasses.replace(cfg, resume=str(tmp_path / "run")))  # epoch 2: everything trains
    thawed = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["model"]
    assert not torch.equal(thawed["features.0.0.weight"], frozen["features.0.0.weight"])
    assert not torch.equal(thawed["features.0.1.running_mean"], frozen["features.0.1.running_mean"])


def test_layer_decay_scales_each_group_below_the_classifier() -> None:
    name = parse_model("timm/test_vit")
    model = name.source.build(name, 5)
    scales = layer_scales(model, name.source, ["head.weight", "head.bias"], 0.5)
    assert scales["head.weight"] == 1.0 and scales["blocks.5.attn.qkv.weight"] == 0.5
    assert scales["blocks.0.attn.qkv.weight"] == 0.5**6 and scales["patch_embed.proj.weight"] == 0.5**7
    tv = parse_model("resnet18")
    resnet = tv.source.build(tv, 5)
    by_child = layer_scales(resnet, tv.source, ["fc.weight", "fc.bias"], 0.5)
    assert (by_child["fc.weight"], by_child["layer4.0.conv1.weight"], by_child["conv1.weight"]) == (1.0, 0.5, 0.5**6)
    cfg = small_config("x", lr=0.1, layer_decay=0.5)
    optimizer = make_optimizer(resnet, cfg, World(), by_child)
    rates = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert rates[id(resnet.fc.weight)] == pytest.approx(0.1) and rates[id(resnet.conv1.weight)] == pytest.approx(
        0.1 * 0.5**6
    )


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ({"layer_decay": 0.0}, r"layer_decay=0.0 must lie in \(0, 1\]"),
        ({"layer_decay": 1.5}, r"layer_decay=1.5 must lie in \(0, 1\]"),
        ({"freeze_epochs": 3, "epochs": 3}, "freeze_epochs=3 leaves no epoch of the 3 to train the whole model"),
        ({"pretrained": True, "initial_checkpoint": "w.pt"}, "--pretrained and --initial-checkpoint both give"),
        ({"mean": "0.5,0.5"}, r"mean='0.5,0.5' must be three numbers R,G,B"),
        ({"crop_pct": 1.2}, r"crop_pct=1.2 must lie in \(0, 1\]"),
    ],
)
def test_fine_tuning_settings_out_of_range_are_one_line(flags: dict[str, object], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        small_config("x", **flags)


def test_the_weights_preprocessing_is_the_runs(shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run from weights recorded with other preprocessing normalises and crops as they were."""
    run_local(
        small_config(shards, epochs=1, mean="0.5,0.5,0.5", std="0.25,0.25,0.25", crop_pct=0.95, out=str(tmp_path / "a"))
    )
    cfg = small_config(shards, epochs=1, initial_checkpoint=str(tmp_path / "a"), out=str(tmp_path / "b"))
    run_local(cfg)
    used = json.loads((tmp_path / "b" / "config.json").read_text())["loader"]
    assert (used["mean"], used["std"], used["crop_pct"]) == ("0.5,0.5,0.5", "0.25,0.25,0.25", 0.95)
    mine = small_config(
        shards, epochs=1, initial_checkpoint=str(tmp_path / "a"), mean="0.4,0.4,0.4", out=str(tmp_path / "c")
    )
    run_local(mine)
    used = json.loads((tmp_path / "c" / "config.json").read_text())["loader"]
    assert used["mean"] == "0.4,0.4,0.4"  # the user's wins


@pytest.mark.slow  # a real MLflow server: its start is 15-20 s of the inner loop
def test_the_tracking_run_records_the_weights_source_and_sha256(
    shards: Path, tmp_path: Path, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(3)
    save_file(DemoNet(10).state_dict(), str(tmp_path / "start.safetensors"))
    experiment = f"weights-{uuid.uuid4().hex[:8]}"
    for name, value in mlflow_server.env(experiment).items():
        monkeypatch.setenv(name, value)
    cfg = small_config(shards, epochs=1, tracking=["mlflow"], initial_checkpoint=str(tmp_path / "start.safetensors"))
    run_local(dataclasses.replace(cfg, out=str(tmp_path / "run")))
    [tracked] = mlflow_server.runs(experiment)
    record = json.loads(tracked.data.tags["weights"])
    digest = hashlib.sha256((tmp_path / "start.safetensors").read_bytes()).hexdigest()
    assert (record["source"], record["sha256"], record["classifier"]["action"]) == (
        f"file {tmp_path / 'start.safetensors'}",
        digest,
        "kept",
    )
