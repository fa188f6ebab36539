"""The recipes `--recipe NAME` starts from: TrainConfig fields by name, each recipe's source in its
comment (docs/training.md has the table with the accuracy each is published at).

    resolve("shards/", recipe="imagenet-resnet50-v2", epochs=90)   # raywds.train.config.resolve
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
FINETUNE_RESNET50: dict[str, Any] = dict(
    model="resnet50.IMAGENET1K_V2",
    pretrained=True,
    optimizer="sgd",
    lr=0.001,
    weight_decay=0.0,
    warmup_epochs=0.0,
    epochs=25,
    batch_size=32,
    image_size=224,
    crop_scale_min=0.08,
    loader_workers=8,
)
"""PyTorch's "Transfer Learning for Computer Vision" tutorial (torchvision's ResNet on a new set of
classes, the whole network trained): SGD at lr 0.001 with momentum 0.9, 25 epochs, no weight
decay, RandomResizedCrop(224) and a flip. The tutorial steps the rate down 10x every 7 epochs
and uses batches of 4; raywds decays it on a cosine and takes 32 a rank (nesterov momentum)."""
FINETUNE_CONVNEXT: dict[str, Any] = dict(
    model="timm/convnext_tiny.fb_in22k",
    pretrained=True,
    optimizer="adamw",
    lr=5e-5,
    weight_decay=1e-8,
    layer_decay=0.8,
    warmup_epochs=0.0,
    epochs=30,
    global_batch=512,
    batch_size=64,
    label_smoothing=0.1,
    auto_augment="ra",
    ra_magnitude=9,
    random_erase=0.25,
    image_size=224,
    loader_workers=8,
)
"""ConvNeXt (Liu et al., "A ConvNet for the 2020s", appendix A.1), fine-tuning its ImageNet-22K
weights on ImageNet-1K: AdamW at 5e-5, weight decay 1e-8, layer-wise decay 0.8, 30 epochs of
batch 512 without warm-up, label smoothing 0.1, RandAugment (9, 0.5), random erasing 0.25.
Left out: stochastic depth (a model setting timm takes, raywds does not pass) and RandAugment's
magnitude noise (timm's `mstd0.5`; torchvision's RandAugment has a fixed magnitude)."""
FINETUNE_VIT_MAE: dict[str, Any] = dict(
    model="timm/vit_base_patch16_224.mae",
    pretrained=True,
    optimizer="adamw",
    lr=2e-3,
    weight_decay=0.05,
    layer_decay=0.65,
    warmup_epochs=5.0,
    epochs=100,
    global_batch=1024,
    batch_size=32,
    label_smoothing=0.1,
    mixup_alpha=0.8,
    cutmix_alpha=1.0,
    auto_augment="ra",
    ra_magnitude=9,
    random_erase=0.25,
    image_size=224,
    loader_workers=8,
)
"""MAE's fine-tuning of its ViT-B/16 (facebookresearch/mae FINETUNE.md): --blr 5e-4 at an effective
batch of 1024 (lr 5e-4 x 1024 / 256 = 2e-3), --layer_decay 0.65, --weight_decay 0.05, 100 epochs
with 5 of warm-up, --mixup 0.8 --cutmix 1.0, label smoothing 0.1, --reprob 0.25, RandAugment m9.
Left out: --drop_path 0.1 and RandAugment's magnitude noise, as above. MAE reports 83.6 top-1."""
RECIPES: dict[str, dict[str, Any]] = {
    "imagenet-resnet50": {"model": "resnet50", **IMAGENET},
    "imagenet-resnet18": {"model": "resnet18", **IMAGENET},
    "imagenet-resnet34": {"model": "resnet34", **IMAGENET},
    "imagenet-resnet50-v2": {"model": "resnet50", **IMAGENET_V2},
    "imagenet-resnet101-v2": {"model": "resnet101", **IMAGENET_V2},
    "imagenet-resnet152-v2": {"model": "resnet152", **IMAGENET_V2},
    "finetune-resnet50": FINETUNE_RESNET50,
    "finetune-convnext-tiny": FINETUNE_CONVNEXT,
    "finetune-vit-b16-mae": FINETUNE_VIT_MAE,
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
