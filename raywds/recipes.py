"""The recipes `--recipe NAME` starts from: TrainConfig fields by name, each recipe's source in its
comment (docs/training.md has the table with the accuracy each is published at).

    resolve("shards/", recipe="imagenet-resnet50-v2", epochs=90)   # raywds.config.resolve
"""

from __future__ import annotations

from typing import Any

IMAGENET: dict[str, Any] = dict(
    optimizer="sgd",
    lr=None,
    weight_decay=5e-5,
    warmup_epochs=5.0,
    epochs=90,
    label_smoothing=0.1,
    image_size=224,
    crop_scale_min=0.08,
    batch_size=256,
    loader_workers=8,
)
"""Goyal et al. / torchvision's reference, with label smoothing and a cosine schedule."""
IMAGENET_V2: dict[str, Any] = dict(
    optimizer="sgd",
    lr=0.5,
    global_batch=1024,
    batch_size=128,
    epochs=600,
    warmup_epochs=5.0,
    weight_decay=2e-5,
    norm_weight_decay=0.0,
    bias_weight_decay=2e-5,
    label_smoothing=0.1,
    auto_augment="ta_wide",
    random_erase=0.1,
    mixup_alpha=0.2,
    cutmix_alpha=1.0,
    model_ema=True,
    model_ema_steps=32,
    model_ema_decay=0.99998,
    crop_scale_min=0.08,
    image_size=224,
    train_crop_size=176,
    val_resize_size=232,
    val_crop_size=224,
    loader_workers=8,
)
"""torchvision's "new recipe" for its IMAGENET1K_V2 ResNet weights (pytorch/vision issue #3995, the
blog post "How to Train State-Of-The-Art Models Using TorchVision's Latest Primitives"):
    torchrun --nproc_per_node=8 train.py --model resnet50 --batch-size 128 --lr 0.5 \
      --lr-scheduler cosineannealinglr --lr-warmup-epochs 5 --lr-warmup-method linear \
      --auto-augment ta_wide --epochs 600 --random-erase 0.1 --weight-decay 0.00002 \
      --norm-weight-decay 0.0 --label-smoothing 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0 \
      --train-crop-size 176 --model-ema --val-resize-size 232 --ra-sampler --ra-reps 4
8 GPUs x 128 is the global batch of 1024 (--global-batch keeps it on any number of ranks). The
reference's biases take --weight-decay (its --bias-weight-decay is unset), its EMA keeps its
defaults (32 steps, 0.99998). Left out: --ra-sampler (repeated augmentation shows each image
several times an epoch, against exact epochs). ResNet-50 80.858 top-1, ResNet-101 81.886,
ResNet-152 82.284 at 224 px after resizing to 232 (torchvision's weights tables)."""
RECIPES: dict[str, dict[str, Any]] = {
    "imagenet-resnet50": {"model": "resnet50", **IMAGENET},
    "imagenet-resnet18": {"model": "resnet18", **IMAGENET},
    "imagenet-resnet34": {"model": "resnet34", **IMAGENET},
    "imagenet-resnet50-v2": {"model": "resnet50", **IMAGENET_V2},
    "imagenet-resnet101-v2": {"model": "resnet101", **IMAGENET_V2},
    "imagenet-resnet152-v2": {"model": "resnet152", **IMAGENET_V2},
    # Reaches high accuracy on the generated demo data in a few CPU minutes.
    "demo": dict(
        model="demo",
        optimizer="adamw",
        lr=3e-3,
        weight_decay=5e-5,
        warmup_epochs=0.5,
        epochs=6,
        image_size=56,
        crop_scale_min=0.35,
        batch_size=32,
        loader_workers=1,
        worker_shuffle_buffer=500,
        out="runs/demo",
    ),
}
