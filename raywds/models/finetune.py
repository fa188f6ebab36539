"""Fine-tuning controls: --layer-decay (timm's name and meaning) and --freeze-epochs.

Layer decay scales each layer group's learning rate by `decay ** (last - group)`: the classifier's
group trains at the peak rate, each group below it at `decay` times the one above. The groups are
the model's own where its library declares them (timm's `group_matcher`: a ViT's blocks, a
ResNet's stages); otherwise each top-level child that holds parameters is one group, input to
output (a torchvision ResNet: conv1, bn1, layer1..layer4, fc), and the classifier always the last.

A frozen epoch trains only the classifier: every other parameter's gradient is dropped before the
optimizer step (no update, no momentum, no weight decay), and the norm layers outside the
classifier stay in eval mode, so their running statistics do not move either (as Lightning's
`BackboneFinetuning` keeps frozen BatchNorm). The backward pass still runs through the whole model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from raywds.models.head import Build, head_keys
from raywds.models.sources import ModelSource

NORMS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm)


def classifier_params(model: nn.Module, build: Build, num_classes: int) -> list[str]:
    """The names of the classifier's parameters (the tensors whose shape follows the class count)."""
    params = dict(model.named_parameters())
    return [k for k in head_keys(build, model, num_classes) if k in params]


def layer_scales(model: nn.Module, source: ModelSource, classifier: Sequence[str], decay: float) -> dict[str, float]:
    """Each parameter's learning-rate scale under --layer-decay `decay`."""
    head = set(classifier)
    groups = [
        kept
        for names in source.layer_groups(model) or _child_groups(model)
        if (kept := [n for n in names if n not in head])
    ]
    group_of = {name: i for i, names in enumerate(groups) for name in names}
    last = len(groups)  # the classifier's: above every other group
    return {name: decay ** (last - group_of.get(name, last)) for name, _ in model.named_parameters()}


def _child_groups(model: nn.Module) -> list[list[str]]:
    """A group per top-level child that holds parameters, in the order they were declared."""
    groups = []
    for child, module in model.named_children():
        names = [f"{child}.{n}" for n, _ in module.named_parameters()]
        if names:
            groups.append(names)
    own = [n for n, _ in model.named_parameters(recurse=False)]
    return [own, *groups] if own else groups


@dataclass
class Freeze:
    """What a frozen epoch holds still: every parameter but the classifier's, and the norm layers outside it."""

    params: list[nn.Parameter]
    norms: list[nn.Module]

    @classmethod
    def of(cls, model: nn.Module, classifier: Sequence[str]) -> Freeze:
        keep = set(classifier)
        params = [p for n, p in model.named_parameters() if n not in keep]
        prefixes = {n.rpartition(".")[0] for n in classifier}
        norms: list[nn.Module] = [m for n, m in model.named_modules() if isinstance(m, NORMS) and n not in prefixes]
        return cls(params, norms)

    def hold(self) -> None:
        """After `model.train()`: the frozen norm layers back in eval mode."""
        for module in self.norms:
            module.eval()

    def drop_grads(self) -> None:
        """Before the optimizer step: no gradient, so no update, for the frozen parameters."""
        for p in self.params:
            p.grad = None
