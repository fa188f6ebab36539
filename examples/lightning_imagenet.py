"""ImageNet the Lightning way, on raywds's shards: a LightningModule around a torchvision ResNet
(or the demo's small net), fed by `raywds.lightning.ShardDataModule`.

    python examples/lightning_imagenet.py --demo                          # the demo data, 1 CPU process
    torchrun --nproc_per_node 2 examples/lightning_imagenet.py --demo --mode split --devices 2
    python examples/lightning_imagenet.py --data /data/imagenet-shards --recipe imagenet-resnet50 --devices 8
    python examples/lightning_imagenet.py --demo --ray 2                  # 2 Ray Train workers
    python examples/lightning_imagenet.py --demo --resume runs/demo/last.ckpt   # on from a checkpoint

Every `raywds train` flag is accepted (`--data`, `--mode`, `--epochs`, `--out`, `--batch-size`,
`--checkpoint-every-steps`, `--audit-dir`, ...: raywds.cli.flags makes them from the TrainConfig),
plus Lightning's `--devices` and `--accelerator`. It ends with `raywds train`'s summary line:
`epochs N  top-1 X  top-5 X  samples seen N  images/s X`. See docs/lightning.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import raywds
from raywds import KeepTrackingIds, ShardDataModule, TrainConfig, tracking_loggers

# val_top1 and the rest are summed over ranks already (torchmetrics, one reduce): Lightning's advice
# to average them again with sync_dist would make them wrong where ranks validate different counts.
warnings.filterwarnings("ignore", message=r".*when logging on epoch level in distributed setting")


class Classifier(L.LightningModule):
    """The model, its loss and optimizer, and exact top-1/top-5 (torchmetrics sums over all ranks
    once, at the end of validation). In split mode nothing here makes a collective per step."""

    def __init__(self, cfg: TrainConfig, data: ShardDataModule):
        super().__init__()
        self.cfg, self.data = cfg, data
        self.net = raywds.build_model(cfg.model, data.num_classes).to(
            memory_format=data.memory_format
        )  # as the batches
        if cfg.compile:
            self.net = torch.compile(self.net)  # type: ignore[assignment]
        self.loss = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self.top1 = MulticlassAccuracy(data.num_classes, top_k=1, average="micro")
        self.top5 = MulticlassAccuracy(data.num_classes, top_k=min(5, data.num_classes), average="micro")
        self.val: dict[str, float] = {}
        self.val_seen = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = self.loss(self.net(images), labels)
        self.log("train_loss", loss, prog_bar=True)  # this rank's: no sync_dist per step in split mode
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The rate where this step ends, a function of epochs done, as `raywds train` sets it."""
        for group in self.optimizers().param_groups:  # type: ignore[union-attr]
            group["lr"] = self.data.lr()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self.net(images)
        self.top1.update(logits, labels)
        self.top5.update(logits, labels)
        self.val_seen += len(labels)

    def on_validation_epoch_end(self) -> None:
        seen = self.trainer.strategy.reduce(torch.tensor(float(self.val_seen)), reduce_op="sum")
        self.val = {
            "val_top1": float(self.top1.compute()),
            "val_top5": float(self.top5.compute()),
            "val_samples": int(seen),
        }
        self.top1.reset()
        self.top5.reset()
        self.val_seen = 0
        self.log_dict(self.val, rank_zero_only=True)  # already over all ranks

    def on_train_epoch_start(self) -> None:
        self.val = {}  # this epoch's, where it validates

    def on_train_epoch_end(self) -> None:
        """After the DataModule has counted the epoch: `raywds train`'s epoch line, on rank 0."""
        m = self.data.metrics
        if self.trainer.is_global_zero and m.get("epoch") == self.current_epoch + 1:
            v = self.val
            val = (
                f"  val top-1 {v['val_top1']:.3f}  top-5 {v['val_top5']:.3f}  val samples {v['val_samples']}"
                if v
                else ""
            )
            print(
                f"epoch {m['epoch']}/{self.cfg.epochs}  samples {m['epoch_samples']}{val}"
                f"  images/s {m['images_per_s']:.1f}",
                flush=True,
            )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return raywds.make_optimizer(self.net, self.cfg, raywds.World(world_size=self.trainer.world_size))


QUIET: dict[str, Any] = dict(
    num_sanity_val_steps=0, enable_progress_bar=False, logger=False, enable_checkpointing=False,
    enable_model_summary=False,
)  # fmt: skip
"""No progress bar, logger or Lightning checkpoints: the DataModule checkpoints inside epochs
(--checkpoint-every-steps); add a ModelCheckpoint for epochs' ends, TensorBoardLogger for charts."""


def summary(data: ShardDataModule, model: Classifier) -> str:
    """`raywds train`'s closing line, from the DataModule's counts and the model's last validation."""
    return raywds.summary_line({**data.metrics, **model.val})


def precision(cfg: TrainConfig) -> str:
    """`--precision` as Lightning names it: bf16 autocast on a GPU by default, as `raywds train`."""
    chosen = cfg.precision if cfg.precision != "auto" else ("bf16" if torch.cuda.is_available() else "fp32")
    return "bf16-mixed" if chosen == "bf16" else "32-true"


def fit(cfg: TrainConfig, devices: int | str = "auto", accelerator: str = "auto", **trainer: Any) -> str:
    """Train as `cfg` says with Lightning's Trainer; rank 0 prints the summary line, every rank returns it."""
    L.seed_everything(cfg.seed, workers=False, verbose=False)
    data = ShardDataModule(cfg)
    model = Classifier(cfg, data)
    options: dict[str, Any] = dict(
        max_epochs=cfg.epochs,
        max_steps=cfg.max_steps or -1,
        devices=devices,
        accelerator=accelerator,
        strategy=DDPStrategy(timeout=timedelta(seconds=cfg.pg_timeout)),  # split mode needs DDP
        precision=precision(cfg),
        default_root_dir=cfg.out,
        check_val_every_n_epoch=cfg.val_every,
        **QUIET,
    )
    if cfg.trackers():  # --tracking mlflow|wandb|tensorboard (and --tensorboard): one run through resumes
        options.update(logger=tracking_loggers(cfg), callbacks=[KeepTrackingIds()])
    t = L.Trainer(**{**options, **trainer})
    t.fit(model, datamodule=data, ckpt_path=cfg.resume)
    line = summary(data, model)
    if t.is_global_zero:
        print(line, flush=True)
    return line


def fit_on_ray(cfg: TrainConfig, workers: int | tuple[int, int], storage: str | None = None) -> Any:
    """The same fit in `workers` Ray Train workers (MIN..MAX: elastic, as `raywds ray
    --num-workers`), through Ray's Lightning integration (its DDP strategy, environment and
    checkpoint reports); Ray's Result. A restarted or resized worker group resumes from the newest
    checkpoint: Ray's, reported at each epoch's end, or raywds's own inside an epoch
    (`<out>/last.ckpt`), dealt afresh to the workers it has."""
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer

    def fit_in_worker(run: TrainConfig, restored: str | None) -> None:
        newest = [p for p in (Path(run.out) / "last.ckpt",) if p.is_file()]
        if restored is not None:
            newest.append(Path(restored) / RayTrainReportCallback.CHECKPOINT_NAME)
        if newest:
            run = dataclasses.replace(run, resume=str(max(newest, key=_global_step)))
        data = ShardDataModule(run)
        model = Classifier(run, data)
        trainer = L.Trainer(
            max_epochs=run.epochs,
            max_steps=run.max_steps or -1,
            devices="auto",
            accelerator="auto",
            strategy=RayDDPStrategy(timeout=timedelta(seconds=run.pg_timeout)),
            precision=precision(run),
            plugins=[RayLightningEnvironment()],
            callbacks=[RayTrainReportCallback()],
            check_val_every_n_epoch=run.val_every,
            **QUIET,
        )
        trainer = prepare_trainer(trainer)
        trainer.fit(model, datamodule=data, ckpt_path=run.resume)
        if trainer.is_global_zero:
            print(summary(data, model), flush=True)

    return raywds.run_on_ray(fit_in_worker, cfg, workers, storage=storage)


def workers(text: str) -> int | tuple[int, int]:
    """`--ray`: N workers, or MIN..MAX (elastic)."""
    low, _, high = text.partition("..")
    return (int(low), int(high)) if high else int(low)


def _global_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=False).get("global_step", -1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--data", help="a shard folder or URL with its manifest.json")
    parser.add_argument("--demo", action="store_true", help="train on the demo data (made once under --demo-dir)")
    parser.add_argument("--demo-dir", default="runs/demo-data")
    parser.add_argument("--recipe", help="a raywds recipe (demo, imagenet-resnet50, ...)")
    parser.add_argument("--config", help="a raywds config file")
    parser.add_argument("--devices", default="auto", help="Lightning's devices: processes (CPU) or GPUs per node")
    parser.add_argument("--accelerator", default="auto", help="Lightning's accelerator: auto, cpu, gpu")
    parser.add_argument(
        "--ray", type=workers, metavar="N|MIN..MAX", help="train in Ray Train workers: N, or MIN..MAX (elastic)"
    )
    raywds.add_flags(parser, TrainConfig, with_defaults=False)  # every training flag, None unless given
    args = parser.parse_args(argv)
    if not args.data and not args.demo:
        parser.error("give --data SHARDS, or --demo")
    data = args.data
    if args.demo:
        data = str(raywds.prepare_demo(Path(args.demo_dir)))
    recipe = args.recipe or ("demo" if args.demo else None)
    cfg = raywds.resolve(data, recipe=recipe, config_file=args.config, **raywds.given(args, TrainConfig))
    if args.ray:
        fit_on_ray(cfg, args.ray)
    else:
        devices = int(args.devices) if str(args.devices).isdigit() else args.devices
        fit(cfg, devices=devices, accelerator=args.accelerator)


if __name__ == "__main__":
    sys.exit(main())
