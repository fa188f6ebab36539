"""Where `--model` names come from: a table of model sources, each one class (timm's
`register_model` is the pattern). A name is parsed once, here, into a `ModelName`:

    demo                            the small CPU network for the demo data
    resnet50, resnet50.IMAGENET1K_V2   torchvision: a `torchvision.models` name, optionally a weights tag
    timm/convnext_tiny.fb_in22k     timm, spelled as the Hugging Face Hub spells it (timm/NAME[.TAG])

A third source is one subclass of `ModelSource` and one entry in `SOURCES`; the tests list the
table. Building is always from random weights; `raywds.models.weights` loads pretrained ones.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from raywds.errors import ConfigError

TIMM_PREFIX = "timm/"
TIMM_INSTALL = "pip install 'raywds[timm]'"


@dataclass(frozen=True)
class ModelName:
    """A parsed --model: its source, architecture and weights tag (None: the source's default)."""

    source: ModelSource
    arch: str
    tag: str | None = None

    def __str__(self) -> str:
        return self.source.spell(self.arch, self.tag)


class ModelSource:
    """One library of models behind --model."""

    name: ClassVar[str]

    def claims(self, text: str) -> bool:
        """Whether `text` is spelled as this source spells its names (not whether it exists)."""
        raise NotImplementedError

    def parse(self, text: str) -> ModelName:
        """`text` as a name of this source; ConfigError, suggesting close names, when unknown."""
        raise NotImplementedError

    def names(self) -> list[str]:
        """Every name this source knows, spelled for --model (for suggestions)."""
        raise NotImplementedError

    def spell(self, arch: str, tag: str | None) -> str:
        return f"{arch}.{tag}" if tag else arch

    def build(self, name: ModelName, num_classes: int) -> nn.Module:
        """The architecture with random weights and `num_classes` outputs (no downloads)."""
        raise NotImplementedError

    def has_weights(self, name: ModelName) -> bool:
        """Whether the library publishes pretrained weights for `name` (its tag, or a default)."""
        raise NotImplementedError

    def layer_groups(self, model: nn.Module) -> list[list[str]] | None:
        """The model's own layer groups, input to output, as lists of parameter names (for
        --layer-decay); None: raywds groups the top-level children (raywds.models.finetune)."""
        return None


class Demo(ModelSource):
    name = "demo"

    def claims(self, text: str) -> bool:
        return text == "demo"

    def parse(self, text: str) -> ModelName:
        return ModelName(self, "demo")

    def names(self) -> list[str]:
        return ["demo"]

    def build(self, name: ModelName, num_classes: int) -> nn.Module:
        from raywds.models.demo import DemoNet

        return DemoNet(num_classes)

    def has_weights(self, name: ModelName) -> bool:
        return False


class TorchVision(ModelSource):
    """`torchvision.models`' classification models; tags are members of each model's weights enum."""

    name = "torchvision"

    def claims(self, text: str) -> bool:
        return "/" not in text

    @functools.cached_property
    def _models(self) -> list[str]:
        import torchvision  # here: a 1.5-2.5 s import the demo network does not need

        return sorted(torchvision.models.list_models(module=torchvision.models))

    def names(self) -> list[str]:
        return self._models

    def parse(self, text: str) -> ModelName:
        arch, _, tag = text.partition(".")
        if arch not in self._models:
            raise ConfigError(f"unknown model {text!r}{suggest(text)}")
        if tag:
            enum = self.weights_enum(arch)
            known = [w.name for w in enum] if enum is not None else []
            if tag not in known:
                have = ", ".join(known) or "none"
                raise ConfigError(f"torchvision has no weights {tag!r} for {arch} (it has: {have})")
        return ModelName(self, arch, tag or None)

    def weights_enum(self, arch: str) -> Any:
        import torchvision

        try:
            return torchvision.models.get_model_weights(arch)
        except (ValueError, KeyError):
            return None

    def weights(self, name: ModelName) -> Any:
        """The weights enum member `name` names (its tag, else the enum's DEFAULT)."""
        enum = self.weights_enum(name.arch)
        if enum is None:
            raise ConfigError(f"torchvision publishes no pretrained weights for {name.arch}")
        return enum[name.tag] if name.tag else enum.DEFAULT

    def build(self, name: ModelName, num_classes: int) -> nn.Module:
        import torchvision

        return torchvision.models.get_model(name.arch, weights=None, num_classes=num_classes)

    def has_weights(self, name: ModelName) -> bool:
        return self.weights_enum(name.arch) is not None


class Timm(ModelSource):
    """timm's models (`timm.list_models()`), named timm/NAME or timm/NAME.TAG as on the Hub."""

    name = "timm"

    def claims(self, text: str) -> bool:
        return text.startswith(TIMM_PREFIX)

    @staticmethod
    def module() -> Any:
        try:
            import timm
        except ImportError:
            raise ConfigError(f"timm models need timm, which is not installed: {TIMM_INSTALL}") from None
        return timm

    def names(self) -> list[str]:
        try:
            timm = self.module()
        except ConfigError:
            return []
        return [TIMM_PREFIX + n for n in timm.list_models()]

    def spell(self, arch: str, tag: str | None) -> str:
        return TIMM_PREFIX + super().spell(arch, tag)

    def parse(self, text: str) -> ModelName:
        timm = self.module()
        arch, _, tag = text[len(TIMM_PREFIX) :].partition(".")
        if not timm.is_model(arch):
            raise ConfigError(f"unknown model {text!r}{suggest(text)}")
        if tag and f"{arch}.{tag}" not in timm.list_pretrained(f"{arch}.*"):
            have = ", ".join(t.partition(".")[2] for t in timm.list_pretrained(f"{arch}.*")) or "none"
            raise ConfigError(f"timm has no weights {tag!r} for {arch} (it has: {have})")
        return ModelName(self, arch, tag or None)

    def build(self, name: ModelName, num_classes: int) -> nn.Module:
        timm = self.module()
        return timm.create_model(
            self.spell(name.arch, name.tag)[len(TIMM_PREFIX) :], pretrained=False, num_classes=num_classes
        )

    def has_weights(self, name: ModelName) -> bool:
        timm = self.module()
        return bool(
            timm.list_pretrained(self.spell(name.arch, name.tag)[len(TIMM_PREFIX) :] + ("" if name.tag else ".*"))
        )

    def pretrained_cfg(self, name: ModelName) -> dict[str, Any]:
        """timm's data config of the weights `name` names (mean, std, crop_pct, hf_hub_id, ...): no download."""
        from timm.models import get_pretrained_cfg

        cfg = get_pretrained_cfg(self.spell(name.arch, name.tag)[len(TIMM_PREFIX) :])
        if cfg is None:
            raise ConfigError(f"timm publishes no pretrained weights for {name}")
        return cfg.to_dict()

    def layer_groups(self, model: nn.Module) -> list[list[str]] | None:
        if not hasattr(model, "group_matcher"):
            return None
        from timm.models import group_parameters

        matcher: Any = model.group_matcher
        groups = group_parameters(model, matcher(coarse=False), reverse=False)
        return [list(params) for _, params in sorted(groups.items())]


SOURCES: dict[str, ModelSource] = {source.name: source for source in (Demo(), Timm(), TorchVision())}
"""Every model source, in the order a name is offered to them (the first that claims it parses it)."""


def suggest(text: str) -> str:
    """'; did you mean …?' with the closest known names of every source, or how many there are."""
    known = [n for source in SOURCES.values() for n in source.names()]
    close = difflib.get_close_matches(text, known, n=3, cutoff=0.6)
    if close:
        return f"; did you mean {' or '.join(close)}?"
    return f"; use demo, a torchvision model such as resnet50, or timm/NAME[.TAG] ({len(known)} known)"


def parse_model(text: str) -> ModelName:
    """--model as the source that claims it reads it."""
    for source in SOURCES.values():
        if source.claims(text):
            return source.parse(text)
    raise ConfigError(f"unknown model {text!r}{suggest(text)}")
