"""The model section of a run's config: which model a run trains and the weights it starts from,
with how it is fine-tuned (layer decay, frozen epochs). The models part declares and checks it;
the training config (raywds.train.config.TrainConfig) is composed of it.

    spec = ModelSpec(model="timm/convnext_tiny.fb_in22k", pretrained=True, freeze_epochs=1)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raywds.errors import ConfigError
from raywds.fields import MAX_EPOCHS, PLACE, TEXT, check_fields, flag


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The model and where its weights start: random, --pretrained or --initial-checkpoint."""

    model: str = field(default="resnet50", metadata=flag(form=TEXT))
    """A torchvision model (resnet50; with a weights tag: resnet50.IMAGENET1K_V2), a timm model as the
    Hugging Face Hub names it (timm/convnext_tiny.fb_in22k; needs raywds[timm]), or `demo` for the small CPU network."""
    pretrained: bool = False
    """Start from the weights --model's library publishes for it (torchvision's default or the tag's;
    timm's tag), read through that library's cache (TORCH_HOME, HF_HOME; HF_HUB_OFFLINE=1 works offline)."""
    initial_checkpoint: str | None = field(default=None, metadata=flag(form=PLACE))
    """Start from these weights: a .safetensors or .pth/.pt state dict, or a raywds run or checkpoint
    (its weights and EMA only), at a path or an s3://, gs:// or http(s):// URL; --resume continues a run instead."""
    layer_decay: float | None = field(default=None, metadata=flag(above=0, maximum=1))
    """Scale each layer group's learning rate by this to the power of its depth below the classifier
    (timm's --layer-decay, e.g. 0.75 for ViT fine-tuning); None leaves every group at the peak lr."""
    freeze_epochs: int = field(default=0, metadata=flag(minimum=0, maximum=MAX_EPOCHS))
    """Train only the classifier for the first this many epochs (every other tensor frozen, BatchNorm
    statistics too), then the whole model."""

    def __post_init__(self) -> None:
        check_fields(self, ModelSpec)  # each field's type, range and form, as declared above
        if self.pretrained and self.initial_checkpoint:
            raise ConfigError("--pretrained and --initial-checkpoint both give starting weights: give one")


__all__ = ["ModelSpec"]
