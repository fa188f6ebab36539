"""Recipes, config files and flags resolve in that order; the CUDA code path runs on the CPU;
torchrun drives the same loop without Ray."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from support.runs import SUMMARY, command

from raywds.errors import ConfigError
from raywds.train.compute import Compute
from raywds.train.config import TrainConfig, resolve
from raywds.train.model import DemoNet
from raywds.train.optim import make_optimizer
from raywds.train.recipes import RECIPES
from raywds.train.trainer import train
from raywds.world import World


def test_imagenet_recipe_is_the_reference_one() -> None:
    cfg = resolve("shards/", recipe="imagenet-resnet50")
    assert (cfg.model, cfg.optimizer, cfg.epochs, cfg.warmup_epochs, cfg.label_smoothing) == (
        "resnet50",
        "sgd",
        90,
        5.0,
        0.1,
    )
    assert (cfg.image_size, cfg.crop_scale_min, cfg.batch_size) == (224, 0.08, 256)
    assert cfg.peak_lr(world_size=8) == pytest.approx(0.1 * 256 * 8 / 256)
    assert cfg.weight_decay == 5e-5  # as docs/training.md's table says: half the reference's 1e-4
    assert resolve("x", recipe="imagenet-resnet18").model == "resnet18"


def test_config_file_overrides_the_recipe_and_flags_override_both(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"train": {"epochs": 30, "lr": 0.4, "label_smoothing": 0.0}}))
    (tmp_path / "run.toml").write_text('[train]\nepochs = 12\n\n[model]\nmodel = "resnet34"\n')
    cfg = resolve("d", recipe="imagenet-resnet50", config_file=str(tmp_path / "run.json"), lr=0.2, epochs=None)
    assert (cfg.epochs, cfg.lr, cfg.label_smoothing, cfg.model) == (30, 0.2, 0.0, "resnet50")
    assert resolve("d", recipe="demo", config_file=str(tmp_path / "run.toml")).model == "resnet34"
    for bad, said in [
        ({"plan": {"batch-size": 3}}, r"batch-size in section \[plan\] is not a setting; \[plan\] holds mode, "),
        ({"plan": {"epochs": 3}}, r"epochs in section \[plan\] belongs in section \[train\]; \[plan\] holds mode, "),
        ({"epochs": 3}, r"epochs belongs in section \[train\] \(the config is by section: data, plan, loader, run, "),
        (
            {"optim": {"lr": 0.1}},
            r"has an unknown section 'optim'; the sections are data, plan, loader, run, model, train$",
        ),
        ({"train": 3}, r"section \[train\] must hold its settings by name, not 3$"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=rf"^config file {re.escape(str(tmp_path))}/bad.json:? {said}"):
            resolve("d", config_file=str(tmp_path / "bad.json"))
    with pytest.raises(
        ConfigError,
        match="unknown recipe 'resnet'; recipes are imagenet-resnet50, imagenet-resnet18, imagenet-resnet34, ",
    ):
        resolve("d", recipe="resnet")
    assert set(RECIPES) == {
        *(f"imagenet-resnet{n}" for n in (18, 34, 50)),
        *(f"imagenet-resnet{n}-v2" for n in (50, 101, 152)),
        "demo",
        "finetune-resnet50",
        "finetune-convnext-tiny",
        "finetune-vit-b16-mae",
    }


TORCHVISION_V2 = {
    # torchvision's new recipe for its IMAGENET1K_V2 ResNets, flag by flag (pytorch/vision #3995):
    # torchrun --nproc_per_node=8 train.py --model resnet50 --batch-size 128 --lr 0.5
    # --lr-scheduler cosineannealinglr --lr-warmup-epochs 5 --lr-warmup-method linear --auto-augment ta_wide
    # --epochs 600 --random-erase 0.1 --weight-decay 0.00002 --norm-weight-decay 0.0 --label-smoothing 0.1
    # --mixup-alpha 0.2 --cutmix-alpha 1.0 --train-crop-size 176 --model-ema --val-resize-size 232
    # --ra-sampler --ra-reps 4
    "batch_size": 128,
    "lr": 0.5,
    "warmup_epochs": 5.0,
    "auto_augment": "ta_wide",
    "epochs": 600,
    "random_erase": 0.1,
    "weight_decay": 2e-5,
    "norm_weight_decay": 0.0,
    "label_smoothing": 0.1,
    "mixup_alpha": 0.2,
    "cutmix_alpha": 1.0,
    "train_crop_size": 176,
    "model_ema": True,
    "val_resize_size": 232,
    # the reference's defaults where the command is silent:
    "val_crop_size": 224,
    "model_ema_steps": 32,
    "model_ema_decay": 0.99998,
    "bias_weight_decay": 2e-5,  # --bias-weight-decay unset: biases take --weight-decay
    "crop_scale_min": 0.08,
    "ra_magnitude": 9,
    "optimizer": "sgd",
}


@pytest.mark.parametrize("model", ["resnet50", "resnet101", "resnet152"])
def test_the_v2_recipes_values_are_torchvisions(model: str) -> None:
    """Every value of the command torchvision published, on 8 GPUs: the global batch of 8 x 128 on
    any number of ranks; the sizes reach the loader (train 176, val 232 then 224)."""

    cfg = resolve("shards/", recipe=f"imagenet-{model}-v2")
    assert cfg.model == model
    assert {k: getattr(cfg, k) for k in TORCHVISION_V2} == TORCHVISION_V2
    assert cfg.global_batch == 8 * 128 and cfg.accumulation(world_size=4) == 2 and cfg.peak_lr(8) == 0.5
    sizes = cfg.loader(0)
    assert (sizes.crop_size, sizes.val_resize_size, sizes.val_crop_size) == (176, 232, 224)


def test_val_sizes_default_to_the_crop_over_0_875_and_are_checked() -> None:
    cfg = TrainConfig(data="x", image_size=160)
    assert (cfg.train_size(0), cfg.val_crop, cfg.val_resize) == (160, 160, 183)
    cfg = TrainConfig(data="x", train_crop_size=176, val_crop_size=224)
    assert (cfg.train_size(0), cfg.val_crop, cfg.val_resize) == (176, 224, 256)
    with pytest.raises(ConfigError, match="val_resize_size=200 is smaller than the val crop"):
        TrainConfig(data="x", val_resize_size=200)


def test_no_weight_decay_on_norms_and_biases_unless_told_as_torchvisions_reference_is_told() -> None:
    from torchvision.models import resnet18

    model = DemoNet(10)
    optimizer = make_optimizer(model, TrainConfig(data="x", weight_decay=1e-4), World())
    decayed, *free = optimizer.param_groups
    assert decayed["weight_decay"] == 1e-4 and all(p.ndim > 1 for p in decayed["params"])
    assert all(g["weight_decay"] == 0.0 for g in free) and any(p.ndim == 1 for g in free for p in g["params"])
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))

    net = resnet18(num_classes=10)  # 20 BatchNorms (40 parameters), one bias (fc's), 21 weights
    cfg = TrainConfig(data="x", weight_decay=1e-4, norm_weight_decay=1e-5, bias_weight_decay=2e-5)
    weights, norms, biases = make_optimizer(net, cfg, World()).param_groups
    assert [(len(g["params"]), g["weight_decay"]) for g in (weights, norms, biases)] == [
        (21, 1e-4),
        (40, 1e-5),
        (1, 2e-5),
    ]
    assert biases["params"][0] is net.fc.bias and norms["params"][0] is net.bn1.weight


def test_the_cuda_path_bf16_and_channels_last_runs_on_the_cpu(shards: Path) -> None:
    cfg = TrainConfig(
        data=str(shards),
        model="demo",
        optimizer="adamw",
        lr=3e-3,
        batch_size=16,
        image_size=28,
        epochs=1,
        loader_workers=1,
        precision="bf16",
        memory_format="channels_last",
        label_smoothing=0.1,
    )
    compute = Compute.for_run(cfg, "cpu")
    assert compute.autocast_dtype == torch.bfloat16 and compute.channels_last
    images, _ = compute.inputs(torch.full((2, 3, 4, 4), 255, dtype=torch.uint8), torch.zeros(2, dtype=torch.long))
    assert images.dtype == torch.float32 and images.is_contiguous(memory_format=torch.channels_last)
    assert images[0, 0, 0, 0].item() == pytest.approx((1 - 0.485) / 0.229, rel=1e-5), "normalised on the device"
    metrics = train(cfg, World())
    assert metrics["val_samples"] == 50 and 0 < metrics["train_loss"] < 10
    assert Compute.for_run(TrainConfig(data="x"), "cpu") == Compute("cpu", None, False), (
        "CPU defaults: float32, contiguous"
    )


@pytest.mark.slow
def test_torchrun_two_processes_without_ray(shards: Path, tmp_path: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    out = command(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "-m",
            "raywds",
            "train",
            "--data",
            str(shards),
            "--model",
            "demo",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--image-size",
            "24",
            "--loader-workers",
            "1",
            "--mode",
            "split",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    match = SUMMARY.search(out.stdout)
    assert match and match.group(4) == "120", out.stdout  # 2 ranks, split mode: the whole epoch once
    assert len(SUMMARY.findall(out.stdout)) == 1, "only rank 0 reports"
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["plan"]["mode"] == "split" and saved["plan"]["batch_size"] == 8


def test_the_fine_tuning_recipes_hold_their_sources_numbers() -> None:
    """Each against the settings its source publishes (raywds/train/recipes.py names them): the rate,
    weight decay, layer decay, epochs, warm-up and batch, and that it starts from the weights."""
    tutorial = resolve("x", recipe="finetune-resnet50")
    assert (tutorial.model, tutorial.pretrained, tutorial.optimizer, tutorial.lr) == (
        "resnet50.IMAGENET1K_V2",
        True,
        "sgd",
        0.001,
    )
    assert (tutorial.epochs, tutorial.weight_decay, tutorial.layer_decay) == (25, 0.0, None)
    convnext = resolve("x", recipe="finetune-convnext-tiny")
    assert (convnext.model, convnext.optimizer, convnext.lr, convnext.weight_decay) == (
        "timm/convnext_tiny.fb_in22k",
        "adamw",
        5e-5,
        1e-8,
    )
    assert (convnext.layer_decay, convnext.epochs, convnext.global_batch, convnext.warmup_epochs) == (0.8, 30, 512, 0.0)
    assert (convnext.label_smoothing, convnext.random_erase, convnext.ra_magnitude) == (0.1, 0.25, 9)
    mae = resolve("x", recipe="finetune-vit-b16-mae")
    assert mae.lr == 5e-4 * mae.global_batch / 256  # MAE's --blr is per 256 samples  # type: ignore[operator]
    assert (mae.layer_decay, mae.weight_decay, mae.epochs, mae.warmup_epochs, mae.global_batch) == (
        0.65,
        0.05,
        100,
        5.0,
        1024,
    )
    assert (mae.mixup_alpha, mae.cutmix_alpha, mae.random_erase, mae.label_smoothing) == (0.8, 1.0, 0.25, 0.1)
    assert all(resolve("x", recipe=r).pretrained for r in ("finetune-convnext-tiny", "finetune-vit-b16-mae"))


def test_a_runs_saved_config_is_a_config_file_by_section(tmp_path: Path) -> None:
    """config.json (TrainConfig.to_dict) holds each part's section; given back as --config it
    makes the same config, the data aside (--data decides), and from_dict reads it whole."""
    cfg = resolve(
        "shards/", recipe="finetune-convnext-tiny", epochs=4, batch_size=32, tracking=["mlflow"], mean="0.5,0.5,0.5"
    )
    saved = cfg.to_dict()
    assert list(saved) == ["data", "plan", "loader", "run", "model", "train"]
    assert (saved["plan"]["batch_size"], saved["train"]["epochs"], saved["run"]["tracking"]) == (32, 4, ["mlflow"])
    assert (saved["loader"]["mean"], saved["model"]["model"], saved["data"]["data"]) == (
        "0.5,0.5,0.5",
        cfg.model,
        "shards/",
    )
    assert sum(len(fields) for fields in saved.values()) == len(dataclasses.fields(TrainConfig)), (
        "each field in one section"
    )
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert resolve("elsewhere/", config_file=str(tmp_path / "config.json")) == dataclasses.replace(
        cfg, data="elsewhere/"
    )
    assert TrainConfig.from_dict(json.loads((tmp_path / "config.json").read_text())) == cfg
