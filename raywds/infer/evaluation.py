"""`raywds evaluate`: a trained model scored on one split of shards, exactly. Each rank reads its
share as validation does (raywds.loader.loader.val_loader: the split's shards dealt in manifest
order to every rank's loader workers, no shuffle, no padding) and sums what it scored: correct at
1 and at 5, the loss, the samples and the confusion counts. The sums are added once, at the end:
one all_reduce under torchrun, or the driver's sum of its Ray tasks' (raywds.launch.ray_evaluation).
No collective runs per batch, so a rank with fewer batches never waits, and the numbers are those
of one process reading every sample once, at any world size.

    trained = load_trained("runs/local")
    scoring = Scoring.of(trained, reading_config(trained, "shards/", {"batch_size": 128}), split="val")
    scored = evaluate(scoring, world)        # this rank's sums, then one all_reduce: on every rank
    scored.scores["weights"].top1, scored.scores["weights"].confusion
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from raywds.data.dataset import manifest_of
from raywds.data.manifest import Manifest
from raywds.errors import ConfigError, DataError
from raywds.loader.loader import val_loader
from raywds.loader.stages import Batch
from raywds.models.trained import Trained
from raywds.train.compute import Compute
from raywds.train.config import TrainConfig, resolve
from raywds.world import World

log = logging.getLogger(__name__)

WEIGHTS, EMA = "weights", "ema"
"""The models a checkpoint can hold: its weights, and --model-ema's average of them."""
HEAD = 4
"""Each model's sums before its confusion counts: correct at 1, correct at 5, loss, samples."""


@dataclass
class Sums:
    """What ranks scored, in one float64 tensor that one all_reduce adds up: for each model, correct
    at 1, correct at 5, the summed loss, the samples and the K x K confusion counts (rows the true
    class, columns the predicted; whole numbers are exact in float64 up to 2**53), then the samples
    each rank scored."""

    values: torch.Tensor
    num_models: int
    num_classes: int
    world_size: int

    @classmethod
    def zeros(cls, num_models: int, num_classes: int, world_size: int, device: str = "cpu") -> Sums:
        size = num_models * (HEAD + num_classes**2) + world_size
        return cls(torch.zeros(size, dtype=torch.float64, device=device), num_models, num_classes, world_size)

    def part(self, model: int) -> torch.Tensor:
        """The model's sums: a view into `values`."""
        width = HEAD + self.num_classes**2
        return self.values[model * width : (model + 1) * width]

    def confusion(self, model: int) -> torch.Tensor:
        return self.part(model)[HEAD:].view(self.num_classes, self.num_classes)

    @property
    def per_rank(self) -> torch.Tensor:
        return self.values[self.num_models * (HEAD + self.num_classes**2) :]

    def add(self, model: int, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """A batch's logits (float32) against its labels, summed on the device: no wait for it."""
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hits = top.eq(labels[:, None])
        part = self.part(model)
        part[0] += hits[:, 0].sum()
        part[1] += hits.any(dim=1).sum()
        part[2] += nn.functional.cross_entropy(logits, labels, reduction="sum").double()
        part[3] += len(labels)
        ones = torch.ones(len(labels), dtype=torch.float64, device=logits.device)
        self.confusion(model).index_put_((labels, top[:, 0]), ones, accumulate=True)

    def plus(self, other: Sums) -> Sums:
        """These sums and `other`'s (another rank's), added: what an all_reduce of both gives."""
        return dataclasses.replace(self, values=self.values + other.values.to(self.values.device))

    def to(self, device: str) -> Sums:
        return dataclasses.replace(self, values=self.values.to(device))


def reduced(sums: Sums, world: World) -> Sums:
    """Every rank's sums added, on every rank: the evaluation's one collective."""
    if world.distributed:
        dist.all_reduce(sums.values)
    return sums


@dataclass(frozen=True)
class Score:
    """One model's numbers over the whole split."""

    top1: float
    top5: float
    loss: float
    """The mean cross-entropy."""
    samples: int
    correct_top1: int
    correct_top5: int
    confusion: np.ndarray = field(repr=False)
    """int64 counts, rows the true class, columns the predicted."""

    def numbers(self) -> dict[str, Any]:
        """All but the matrix, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "confusion"}


@dataclass(frozen=True)
class Scored:
    """What an evaluation found, and of what: the numbers of each model scored (`weights`, `ema`;
    the first is the one its files describe), the samples each rank scored, and what was read."""

    scores: dict[str, Score]
    per_rank: list[int]
    classes: list[str]
    split: str
    splits: dict[str, int]
    """Samples in each split of the manifest."""
    model_source: str
    model_name: str
    data: str
    val_data: str | None
    batch_size: int
    loader_workers: int | str
    """Each rank's (`auto`: as many as its cores, less one, up to AUTO_WORKERS)."""
    seconds: float


def validation_numbers(scored: Scored) -> dict[str, float | int]:
    """The numbers in-training validation gives an epoch's row (raywds.train.loop.evaluate): val_top1,
    val_top5, val_loss and val_samples of the weights, and the EMA's with an _ema suffix."""
    numbers: dict[str, float | int] = {}
    for name, suffix in ((WEIGHTS, ""), (EMA, "_ema")):
        if name in scored.scores:
            each = scored.scores[name]
            numbers.update({f"val_top1{suffix}": each.top1, f"val_top5{suffix}": each.top5})
            numbers[f"val_loss{suffix}"] = each.loss
    numbers["val_samples"] = sum(scored.per_rank)
    return numbers


def reading_config(trained: Trained, data: str, given: Mapping[str, Any]) -> TrainConfig:
    """The config that reads --data for `trained`: the centre crop, resize, mean and std it was
    validated with, and the reading flags `given` (batch size, loader workers, --val-data, ...)."""
    inputs = trained.inputs
    if inputs.interpolation != "bilinear":
        log.warning(f"the model was validated with {inputs.interpolation} resizing; raywds's loader resizes bilinear")
    return resolve(
        data,
        model=trained.name,
        image_size=inputs.crop,
        val_crop_size=inputs.crop,
        val_resize_size=inputs.resize,
        mean=",".join(map(str, inputs.mean)),
        std=",".join(map(str, inputs.std)),
        **given,
    )


AUTO_WORKERS = 8
"""The most loader workers `--loader-workers auto` gives a rank."""


def with_workers(cfg: TrainConfig, world: World) -> TrainConfig:
    """`cfg` with `--loader-workers auto` made a number: the rank's cores less one (for the rank
    itself), at least one, at most AUTO_WORKERS. A pass has no epoch before it to tune them by."""
    if cfg.loader_workers != "auto":
        return cfg
    return dataclasses.replace(cfg, loader_workers=max(1, min(world.cores - 1, AUTO_WORKERS)))


def check_classes(model: list[str], manifest: Manifest, data: str) -> None:
    """Refuse data whose labels do not mean the model's classes: another class list (by name), or,
    where the shards carry bare integer labels, labels past the model's last class."""
    have = manifest.classes
    if have == model:
        return
    if have == [str(i) for i in range(len(have))]:  # bare integer labels (raywds.data.members): their range
        if len(have) <= len(model):
            return
        raise DataError(
            f"--data {data} has labels 0 to {len(have) - 1}, but the model has {len(model)} classes "
            f"(0 to {len(model) - 1}): score it on data labelled as it was trained"
        )
    first = next((i for i, (a, b) in enumerate(zip(model, have)) if a != b), min(len(model), len(have)))
    said = [repr(names[first]) if first < len(names) else "nothing" for names in (model, have)]
    raise DataError(
        f"the model's {len(model)} classes differ from the {len(have)} of --data {data}: class {first} is "
        f"{said[0]} in the model and {said[1]} in the data; score it on data labelled as it was trained "
        "(the same classes in the same order)"
    )


def samples_in(manifest: Manifest, split: str) -> int:
    """The samples in the manifest's `split` (0 where it has none)."""
    return manifest.num_samples(split) if manifest.splits.get(split) else 0


def check_split(manifest: Manifest, split: str, data: str) -> None:
    """Refuse a split with no samples, saying which the data has."""
    if samples_in(manifest, split):
        return
    has = [f"{name} ({samples_in(manifest, name)} samples)" for name in manifest.splits]
    raise DataError(
        f"--data {data} has no {split} samples (it has {', '.join(has) or 'no split'}): give --split with one "
        "of those, or the shards to score as --val-data"
    )


@dataclass
class Scoring:
    """One evaluation: the model(s) to score, the manifest, and how the split is read. Sent whole
    to each Ray task (raywds.launch.ray_evaluation); under torchrun each rank makes its own."""

    trained: Trained
    cfg: TrainConfig
    manifest: Manifest
    split: str
    names: tuple[str, ...]
    """The models scored, the one the files describe first."""
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def of(cls, trained: Trained, cfg: TrainConfig, *, split: str = "val", ema: bool = False) -> Scoring:
        """Refuses, in one line, --ema without an EMA, data of other classes and an empty split."""
        if ema and trained.ema is None:
            raise ConfigError(f"--ema: {trained.source} holds no EMA weights (train with --model-ema); leave out --ema")
        manifest = manifest_of(cfg)
        check_classes(trained.classes, manifest, cfg.data)
        check_split(manifest, split, cfg.data)
        names = (EMA,) if ema else (WEIGHTS, EMA) if trained.ema is not None else (WEIGHTS,)
        return cls(trained, cfg, manifest, split, names)

    def models(self) -> list[nn.Module]:
        return [self.trained.model if name == WEIGHTS else self.trained.ema for name in self.names]  # type: ignore[misc]

    def rank_sums(self, world: World) -> Sums:
        """This rank's sums over its share of the split (not yet added to the other ranks')."""
        compute = Compute.for_run(self.cfg, world.device)
        models = [compute.model(m).eval() for m in self.models()]
        sums = Sums.zeros(len(models), len(self.trained.classes), world.world_size, world.device)
        loader = with_workers(self.cfg, world).loader()
        samples = score(models, val_loader(self.manifest, loader, world, split=self.split), compute, sums)
        sums.per_rank[world.rank] = samples
        return sums

    def scored(self, sums: Sums) -> Scored:
        """The numbers of all ranks' sums; DataError where they did not score each sample of the split once."""
        values = sums.to("cpu")
        expected = self.manifest.num_samples(self.split)
        per_rank = [round(v) for v in values.per_rank.tolist()]
        if sum(per_rank) != expected:
            raise DataError(
                f"scored {sum(per_rank)} samples ({per_rank} by rank) but the {self.split} split of --data "
                f"{self.cfg.data} has {expected}: not every sample once; nothing written"
            )
        scores = {name: _score(values, i) for i, name in enumerate(self.names)}
        return Scored(
            scores,
            per_rank,
            list(self.trained.classes),
            self.split,
            {name: samples_in(self.manifest, name) for name in self.manifest.splits},
            self.trained.source,
            self.trained.name,
            self.cfg.data,
            self.cfg.val_data,
            self.cfg.batch_size,
            self.cfg.loader_workers,
            time.perf_counter() - self.started,
        )


def _score(sums: Sums, model: int) -> Score:
    top1, top5, loss, samples = sums.part(model)[:HEAD].tolist()
    count = max(samples, 1.0)
    confusion = sums.confusion(model).round().to(torch.int64).numpy()
    return Score(top1 / count, top5 / count, loss / count, round(samples), round(top1), round(top5), confusion)


@torch.no_grad()
def score(models: list[nn.Module], batches: Iterable[Batch], compute: Compute, sums: Sums) -> int:
    """Each batch through each model into `sums` (model i into part i); the samples scored."""
    samples = 0
    for batch in batches:
        images, labels = compute.inputs(batch.images, batch.labels)
        for i, model in enumerate(models):
            with compute.autocast():
                logits = model(images).float()
            sums.add(i, logits, labels)
        samples += len(batch.labels)
    return samples


def evaluate(scoring: Scoring, world: World) -> Scored:
    """Score this rank's share and add every rank's (one all_reduce under torchrun): the same on every rank."""
    return scoring.scored(reduced(scoring.rank_sums(world), world))
