"""The classifier fitted to the data's classes when weights are loaded.

The classifier's tensors are the ones whose shape changes with the number of classes (found by
building the architecture on the meta device at one class more: the main head and any auxiliary
one, in any source). Every other tensor loads strictly. Where the weights' classes differ from the
data's, the classifier is **replaced** (newly initialised), except where the weights are a raywds
checkpoint whose classes are the first classes of the data's (what `convert --append` makes): then
it **grows**, its old rows kept and new rows initialised, so the old classes' logits are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from raywds.errors import ConfigError

Build = Callable[[int], nn.Module]
"""The architecture with random weights and this many outputs."""


@dataclass(frozen=True)
class Fit:
    """What loading did to the classifier, for the run's first lines and its record."""

    action: str
    """`kept`, `replaced` or `grown`."""
    layer: str
    before: int
    after: int

    def line(self) -> str:
        if self.action == "kept":
            return f"the classifier {self.layer} kept ({self.after} classes)"
        if self.action == "grown":
            return (
                f"the classifier {self.layer} grown from {self.before} to {self.after} classes "
                f"(the {self.before} kept, {self.after - self.before} new)"
            )
        if not self.before:
            return f"the classifier {self.layer} added for the data's {self.after} classes (the weights have none)"
        return (
            f"the classifier {self.layer} replaced: {self.before} classes in the weights, "
            f"{self.after} in the data, newly initialised"
        )


def head_keys(build: Build, model: nn.Module, num_classes: int) -> list[str]:
    """The state-dict keys of `model` whose shape depends on the number of classes."""
    with torch.device("meta"):
        other = build(num_classes + 1).state_dict()
    ours = model.state_dict()
    return [k for k, v in ours.items() if k in other and other[k].shape != v.shape]


def _layer(keys: list[str]) -> str:
    """The module the main classifier's tensors belong to (the last one: auxiliary heads come first)."""
    return keys[-1].rpartition(".")[0] if keys else "?"


def fit_state(
    model: nn.Module,
    build: Build,
    state: Mapping[str, torch.Tensor],
    classes: list[str],
    saved_classes: list[str] | None,
    *,
    named: str,
) -> tuple[dict[str, torch.Tensor], Fit]:
    """`state` made to fit `model` (built for `classes`): the classifier kept, replaced by the
    model's own fresh one, or grown; ConfigError naming the first keys when anything else differs."""
    ours = model.state_dict()
    heads = head_keys(build, model, len(classes))
    if not heads:
        raise ConfigError(
            f"cannot find the classifier of {type(model).__name__}: no tensor's shape follows the class count"
        )
    before = int(state[heads[-1]].shape[0]) if heads[-1] in state else 0  # 0: weights without a classifier
    fitted = dict(state)
    same_outputs = all(k in state and state[k].shape == ours[k].shape for k in heads)
    grows = (
        saved_classes is not None
        and len(saved_classes) < len(classes)
        and classes[: len(saved_classes)] == saved_classes
        and all(
            k in state and state[k].shape[1:] == ours[k].shape[1:] and state[k].shape[0] == len(saved_classes)
            for k in heads
        )
    )
    meaning_differs = saved_classes is not None and saved_classes != classes
    if same_outputs and not meaning_differs:
        fit = Fit("kept", _layer(heads), before, len(classes))
    elif grows:
        for k in heads:
            grown = ours[k].detach().clone()
            grown[: state[k].shape[0]] = state[k].to(grown.dtype)
            fitted[k] = grown
        fit = Fit("grown", _layer(heads), before, len(classes))
    else:
        for k in heads:
            fitted[k] = ours[k].detach().clone()
        fit = Fit("replaced", _layer(heads), before, len(classes))
    _check_fits(ours, fitted, named)
    return fitted, fit


def _check_fits(ours: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], named: str) -> None:
    """Every tensor of the model in `state` with its shape, and nothing more."""

    def first(keys: list[str]) -> str:
        return ", ".join(keys[:3]) + (", …" if len(keys) > 3 else "")

    missing = [k for k in ours if k not in state]
    unexpected = [k for k in state if k not in ours]
    shapes = [
        f"{k} {tuple(state[k].shape)} for {tuple(ours[k].shape)}"
        for k in ours
        if k in state and state[k].shape != ours[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} of the model's tensors missing ({first(missing)})")
    if unexpected:
        problems.append(f"{len(unexpected)} not in the model ({first(unexpected)})")
    if shapes:
        problems.append(f"{len(shapes)} of another shape ({', '.join(shapes[:2])}{', …' if len(shapes) > 2 else ''})")
    if problems:
        raise ConfigError(
            f"the weights {named} do not fit this --model: {'; '.join(problems)}; are they of another architecture?"
        )


def grow_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with zero rows added up to `rows` (an optimizer's state for a grown classifier:
    no momentum yet for the new classes)."""
    grown = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    grown[: tensor.shape[0]] = tensor
    return grown
