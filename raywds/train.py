"""The training loop. It never imports ray: Ray (raywds.ray_train) and the local launcher
both call `train(cfg, world, report)`.

    raywds train --data shards/ --model resnet18 --epochs 3          # one process
    torchrun --nproc-per-node 4 -m raywds.cli train --data shards/     # DDP without Ray
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from raywds.config import TrainConfig
from raywds.errors import ConfigError
from raywds.loader import Batch, num_resample_batches, train_loader, val_loader
from raywds.shards import read_manifest
from raywds.world import World

Metrics = dict[str, Any]
# report(metrics, checkpoint): called on every rank after every epoch; checkpoint only on rank 0.
Report = Callable[[Metrics, dict[str, Any] | None], None]


class DemoNet(nn.Module):
    """A small CNN that learns the demo data in a few CPU minutes."""

    def __init__(self, num_classes: int, width: int = 32):
        super().__init__()

        def block(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            )

        self.features = nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build_model(name: str, num_classes: int) -> nn.Module:
    """`demo`, or any torchvision classification model name (random init: no downloads)."""
    if name == "demo":
        return DemoNet(num_classes)
    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise ConfigError(f"unknown model {name!r}; use `demo` or a torchvision model such as resnet50 ({len(available)} known)")
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def make_optimizer(model: nn.Module, cfg: TrainConfig, world: World) -> torch.optim.Optimizer:
    lr = cfg.peak_lr(world.world_size)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=cfg.weight_decay)


def lr_at(cfg: TrainConfig, world: World, progress_epochs: float) -> float:
    """Linear warm-up, then cosine decay to zero, as a function of epochs done (fractional).

    A function of progress rather than a stepped scheduler: in split mode ranks take different
    step counts, yet must agree on the rate at every epoch boundary."""
    peak = cfg.peak_lr(world.world_size)
    if progress_epochs < cfg.warmup_epochs:
        return peak * progress_epochs / cfg.warmup_epochs
    span = max(cfg.num_epochs - cfg.warmup_epochs, 1e-9)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress_epochs - cfg.warmup_epochs) / span)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@dataclass
class EpochResult:
    num_samples: int
    loss_sum: float
    seconds: float


def train_epoch(
    model: nn.Module,
    batches: Iterable[Batch],
    optimizer: torch.optim.Optimizer,
    lr: Callable[[float], float],
    world: World,
    *,
    uneven: bool,
) -> EpochResult:
    """One pass; `lr(fraction of the epoch done)` sets the rate before each step. With `uneven`
    (split mode) Join lets ranks that run out early shadow the collectives of the rest."""
    model.train()
    loss_fn = nn.CrossEntropyLoss()
    num_samples, loss_sum = 0, 0.0
    start = time.perf_counter()
    joinable = uneven and isinstance(model, DistributedDataParallel)
    with Join([model]) if joinable else contextlib.nullcontext():  # type: ignore[list-item]
        for step, (images, labels) in enumerate(batches):
            set_lr(optimizer, lr(step))
            images = images.to(world.device, non_blocking=True)
            labels = labels.to(world.device, non_blocking=True)
            loss = loss_fn(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            num_samples += len(labels)
            loss_sum += loss.item() * len(labels)
    return EpochResult(num_samples, loss_sum, time.perf_counter() - start)


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Batch], world: World) -> dict[str, float]:
    """Exact validation: each rank sums its share, then one all_reduce, so uneven ranks never block."""
    model.eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    totals = torch.zeros(4, dtype=torch.float64, device=world.device)  # top1, top5, loss, count
    for images, labels in batches:
        images, labels = images.to(world.device), labels.to(world.device)
        logits = model(images)
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hits = top.eq(labels[:, None])
        totals += torch.tensor(
            [hits[:, 0].sum().item(), hits.any(dim=1).sum().item(), loss_fn(logits, labels).item(), len(labels)],
            dtype=torch.float64,
            device=world.device,
        )
    if world.distributed:
        dist.all_reduce(totals)
    top1, top5, loss, count = totals.tolist()
    count = max(count, 1.0)
    return {"val_top1": top1 / count, "val_top5": top5 / count, "val_loss": loss / count, "val_samples": int(count)}


def _sum_and_max(world: World, total: list[float], longest: float) -> tuple[list[float], float]:
    if not world.distributed:
        return total, longest
    t = torch.tensor(total + [0.0], dtype=torch.float64, device=world.device)
    m = torch.tensor([longest], dtype=torch.float64, device=world.device)
    dist.all_reduce(t)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return t.tolist()[:-1], m.item()


def train(cfg: TrainConfig, world: World, report: Report | None = None) -> Metrics:
    """Train for cfg.num_epochs; returns the last epoch's metrics (the same on every rank)."""
    torch.manual_seed(cfg.seed)
    manifest = read_manifest(cfg.data)
    model = build_model(cfg.model, len(manifest.classes)).to(world.device)
    wrapped: nn.Module = model
    if world.distributed:
        device_ids = [world.local_rank] if world.device.startswith("cuda") else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids)
    optimizer = make_optimizer(model, cfg, world)
    steps_per_epoch = num_resample_batches(manifest, cfg, world)  # nominal in split mode
    samples_seen = 0
    metrics: Metrics = {}
    for epoch in range(cfg.num_epochs):
        batches = train_loader(manifest, cfg, world, epoch=epoch)
        lr = functools.partial(_lr_in_epoch, cfg, world, epoch, steps_per_epoch)
        result = train_epoch(wrapped, batches, optimizer, lr, world, uneven=cfg.mode == "split")
        (num_samples, loss_sum), seconds = _sum_and_max(world, [result.num_samples, result.loss_sum], result.seconds)
        if cfg.mode == "split" and num_samples != manifest.num_samples("train"):
            raise RuntimeError(f"split epoch {epoch} trained on {num_samples:.0f} samples, the manifest has {manifest.num_samples('train')}")
        samples_seen += int(num_samples)
        metrics = {
            "epoch": epoch + 1,
            "train_loss": loss_sum / max(num_samples, 1),
            "train_samples": int(num_samples),
            "samples_seen": samples_seen,
            "images_per_s": num_samples / max(seconds, 1e-9),
            "lr": lr_at(cfg, world, epoch + 1),
            **evaluate(model, val_loader(manifest, cfg, world), world),
        }
        if world.is_main:
            print(epoch_line(metrics, cfg.num_epochs), flush=True)
        if report is not None:
            state = checkpoint_state(model, optimizer, cfg, epoch, manifest.classes) if world.is_main else None
            report(metrics, state)
    return metrics


def _lr_in_epoch(cfg: TrainConfig, world: World, epoch: int, steps_per_epoch: int, step: int) -> float:
    return lr_at(cfg, world, epoch + min(step / steps_per_epoch, 1.0))


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig, epoch: int, classes: list[str]) -> dict[str, Any]:
    """Model, optimizer and position; the learning rate is a function of the epoch, so it needs no state."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch + 1,
        "config": cfg.to_dict(),
        "classes": classes,
    }


def epoch_line(m: Metrics, num_epochs: int) -> str:
    return (
        f"epoch {m['epoch']}/{num_epochs}  loss {m['train_loss']:.3f}  val top-1 {m['val_top1']:.3f}"
        f"  top-5 {m['val_top5']:.3f}  images/s {m['images_per_s']:.1f}"
    )


def summary_line(m: Metrics) -> str:
    """The one line a script can parse at the end of a run."""
    return (
        f"epochs {m['epoch']}  top-1 {m['val_top1']:.3f}  top-5 {m['val_top5']:.3f}"
        f"  samples seen {m['samples_seen']}  images/s {m['images_per_s']:.1f}"
    )


class LocalReport:
    """Writes metrics.jsonl and checkpoint.pt (the latest epoch) under `out_dir`."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = out_dir / "metrics.jsonl"
        self.checkpoint_path = out_dir / "checkpoint.pt"
        self.metrics_path.write_text("")

    def __call__(self, metrics: Metrics, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.checkpoint_path)


def run_local(cfg: TrainConfig) -> tuple[Metrics, LocalReport | None]:
    """Train in this process, or as one rank of a torchrun job."""
    world = World.from_env()
    if world.distributed:
        backend = "nccl" if world.device.startswith("cuda") else "gloo"
        if world.device.startswith("cuda"):
            torch.cuda.set_device(world.local_rank)
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.pg_timeout_s))
    report = LocalReport(Path(cfg.out_dir)) if world.is_main else None
    try:
        return train(cfg, world, report), report
    finally:
        if world.distributed:
            dist.destroy_process_group()
