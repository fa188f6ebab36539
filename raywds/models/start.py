"""A run's model at step 0: built by its source, from random weights, --pretrained weights or
--initial-checkpoint, with the classifier fitted to the data's classes (raywds.models.head).

    start = start_model("resnet50", classes, pretrained=True)
    start.model, start.lines()
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from raywds.data.stores import Storage
from raywds.errors import ConfigError
from raywds.loader.settings import Loading
from raywds.models import weights as weights_
from raywds.models.finetune import Freeze, classifier_params, layer_scales
from raywds.models.head import Fit, fit_state, grow_rows
from raywds.models.sources import ModelName, parse_model
from raywds.models.spec import ModelSpec
from raywds.models.weights import Preprocessing, Weights


@dataclass
class Start:
    name: ModelName
    model: nn.Module
    num_classes: int
    weights: Weights | None = None
    fit: Fit | None = None
    ema: dict[str, torch.Tensor] | None = None
    """The --model-ema average of a raywds checkpoint started from, fitted as the weights are."""

    def lines(self) -> list[str]:
        """What rank 0 says of the start."""
        if self.weights is None:
            return []
        said = f"model {self.name} from {self.weights.source} (sha256 {self.weights.sha256[:12]})"
        return [f"{said}; {self.fit.line()}" if self.fit is not None else said]

    def record(self) -> dict[str, Any]:
        """What the checkpoint and the tracking run keep of the start."""
        record: dict[str, Any] = {"model": str(self.name)}
        if self.weights is not None:
            record.update(self.weights.record())
        if self.fit is not None:
            record["classifier"] = {
                "action": self.fit.action,
                "layer": self.fit.layer,
                "before": self.fit.before,
                "after": self.fit.after,
            }
        return record

    @property
    def preprocessing(self) -> Preprocessing | None:
        return self.weights.preprocessing if self.weights is not None else None

    def build(self, num_classes: int) -> nn.Module:
        """The architecture again, random, with `num_classes` outputs."""
        return self.name.source.build(self.name, num_classes)

    def classifier(self) -> list[str]:
        """The classifier's parameter names."""
        return classifier_params(self.model, self.build, self.num_classes)

    def layer_scales(self, decay: float | None) -> dict[str, float] | None:
        """--layer-decay's learning-rate scale of each parameter (None: off)."""
        if decay is None:
            return None
        return layer_scales(self.model, self.name.source, self.classifier(), decay)

    def freeze(self) -> Freeze:
        """What --freeze-epochs holds still."""
        return Freeze.of(self.model, self.classifier())


def start_model(
    model: str,
    classes: list[str],
    *,
    pretrained: bool = False,
    initial_checkpoint: str | None = None,
    storage: Storage = Storage(),
) -> Start:
    """The model named `model` for `classes`, with the weights asked for loaded into it."""
    ModelSpec(model=model, pretrained=pretrained, initial_checkpoint=initial_checkpoint)  # its refusals, as a run's
    name = parse_model(model)
    build = functools.partial(name.source.build, name)
    net = build(len(classes))
    if pretrained:
        loaded = weights_.pretrained(name)
    elif initial_checkpoint:
        loaded = weights_.initial(initial_checkpoint, storage)
    else:
        return Start(name, net, len(classes))
    state, fit = fit_state(net, build, loaded.state, classes, loaded.classes, named=loaded.source)
    net.load_state_dict(state)
    ema = _fit_ema(loaded, net, build, classes) if loaded.ema is not None else None
    return Start(name, net, len(classes), loaded, fit, ema)


def _fit_ema(loaded: Weights, net: nn.Module, build: Any, classes: list[str]) -> dict[str, torch.Tensor]:
    """A checkpoint's --model-ema state (torch's AveragedModel: the weights under `module.`, beside
    its counter `n_averaged`) with its weights fitted to `classes` as the model's are."""
    assert loaded.ema is not None
    inner = {k[len("module.") :]: v for k, v in loaded.ema.items() if k.startswith("module.")}
    fitted, _ = fit_state(net, build, inner, classes, loaded.classes, named=f"{loaded.source} (its EMA)")
    rest = {k: v for k, v in loaded.ema.items() if not k.startswith("module.")}
    return {**{f"module.{k}": v for k, v in fitted.items()}, **rest}


L = TypeVar("L", bound=Loading)


def with_preprocessing(cfg: L, preprocessing: Preprocessing | None) -> L:
    """`cfg` with --mean, --std and --crop-pct the weights' own, where the user set none of them."""
    if preprocessing is None:
        return cfg
    fill: dict[str, Any] = {}
    if cfg.mean is None:
        fill["mean"] = ",".join(f"{v:g}" for v in preprocessing.mean)
    if cfg.std is None:
        fill["std"] = ",".join(f"{v:g}" for v in preprocessing.std)
    if cfg.crop_pct is None:
        fill["crop_pct"] = preprocessing.crop_pct
    return dataclasses.replace(cfg, **fill) if fill else cfg


def weights_preprocessing(spec: ModelSpec, *, resume: str | None, storage: Storage) -> Preprocessing | None:
    """The preprocessing of the weights `spec` starts from, known before any rank starts (the Ray
    Data plane's driver needs it): --pretrained's from the library's tables; --initial-checkpoint's
    as recorded in a raywds checkpoint (read once, into the node's cache for a remote one); none
    for a run that resumes."""
    if resume is not None:
        return None
    if spec.pretrained:
        return weights_.preprocessing_of(parse_model(spec.model))
    if spec.initial_checkpoint:
        return weights_.initial(spec.initial_checkpoint, storage).preprocessing
    return None


def grow_checkpoint(state: dict[str, Any], started: Start, optimizer: torch.optim.Optimizer, classes: list[str]) -> Fit:
    """A checkpoint taken before an append added classes, made to fit the grown model in place: the
    classifier's rows (model, EMA) kept and new ones as the fresh model has them; the optimizer's
    state for the classifier padded with zeros (no momentum yet for the new classes)."""
    saved = list(state["classes"])
    model = started.model
    state["model"], fit = fit_state(model, started.build, state["model"], classes, saved, named="the checkpoint")
    if fit.action != "grown":
        raise ConfigError(f"the checkpoint's classifier cannot grow to the data's {len(classes)} classes")
    if "model_ema" in state:
        inner = {k[len("module.") :]: v for k, v in state["model_ema"].items() if k.startswith("module.")}
        grown, _ = fit_state(model, started.build, inner, classes, saved, named="the checkpoint's EMA")
        rest = {k: v for k, v in state["model_ema"].items() if not k.startswith("module.")}
        state["model_ema"] = {**{f"module.{k}": v for k, v in grown.items()}, **rest}
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    heads = set(started.classifier())
    for index, per_param in state["optimizer"].get("state", {}).items():
        if 0 <= int(index) < len(order) and order[int(index)] in heads:
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == len(saved):
                    per_param[key] = grow_rows(value, len(classes))
    return fit
