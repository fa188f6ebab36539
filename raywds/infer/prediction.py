"""`raywds predict`, one rank's share: the units (shards, or lists of a folder's files) dealt in
order to every (rank, loader worker) slot as validation deals its shards (no shuffle, no padding:
each key once at any world size), those whose part is already written left out, every sample
centre-cropped as the model was validated, its top-k classes and softmax probabilities written
with its key, unit by unit, as each unit's last sample is predicted (raywds.infer.parts).

    tally = predict_rank(Prediction(model="runs/local", data="shards/", out="preds"), {"batch_size": 32}, World())
    pyarrow.dataset.dataset("preds").to_table()        # raywds.launch.prediction runs it under torchrun
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial as bind
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raywds.errors import ConfigError
from raywds.infer.evaluation import reading_config, with_workers
from raywds.infer.inputs import Inputs, Unit, dealt, inputs_for
from raywds.infer.parts import PART_FORMATS, Collector, Identity, Predictions
from raywds.infer.predictoptions import Prediction
from raywds.infer.samples import Marked, made
from raywds.loader.decodings import decoding
from raywds.loader.loader import Pass
from raywds.loader.settings import LoaderConfig
from raywds.loader.stages import Batch, val_decoder, worker_urls
from raywds.loader.watch import Whereabouts
from raywds.models.trained import Trained, load_trained
from raywds.train.compute import Compute
from raywds.train.config import TrainConfig
from raywds.world import World


@dataclass(frozen=True)
class Tally:
    """What a predict did (summed over the ranks)."""

    samples: int = 0
    errors: int = 0
    parts: int = 0
    """Parts written by this predict."""
    kept: int = 0
    """Parts already written by an earlier one, left as they were."""

    def plus(self, other: Tally) -> Tally:
        return Tally(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def weights_sha256(model: nn.Module) -> str:
    """sha256 of a model's state dict: each tensor's name, dtype, shape and bytes, in order."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load(job: Prediction) -> Trained:
    """The trained model, refused in one line where --top-k exceeds its classes."""
    trained = load_trained(job.model)
    if job.top_k > len(trained.classes):
        raise ConfigError(
            f"--top-k {job.top_k} is more than the {len(trained.classes)} classes of {trained.source}: "
            f"give --top-k {len(trained.classes)} or less"
        )
    return trained


def identity(job: Prediction, inputs: Inputs, trained: Trained) -> Identity:
    return Identity(
        model_sha256=weights_sha256(trained.model),
        model_source=trained.source,
        data=inputs.location,
        data_fingerprint=inputs.fingerprint,
        split=inputs.split,
        top_k=job.top_k,
        part_format=job.format,
        num_parts=len(inputs.units),
        num_samples=sum(u.num_samples for u in inputs.units),
    )


@dataclass
class Setup:
    """What a predict's ranks (and its Ray Data driver) each work from."""

    trained: Trained
    cfg: TrainConfig
    """How --data is read: the model's validation crop and normalisation, the reading flags."""
    inputs: Inputs
    folder: Predictions


def set_up(job: Prediction, reading: Mapping[str, Any], world: World, trained: Trained | None = None) -> Setup:
    """The model (`trained`, where the caller loaded it), the reading config, the units and the --out
    folder (refused where it holds others')."""
    trained = trained if trained is not None else load(job)
    cfg = with_workers(reading_config(trained, job.data, reading), world)
    inputs = inputs_for(
        job.data, split=job.split, storage=cfg.storage, index_cache=cfg.index_cache, shards_at=cfg.shards_at
    )
    folder = Predictions.open(Path(job.out), identity(job, inputs, trained), PART_FORMATS[job.format])
    return Setup(trained, cfg, inputs, folder)


def rank_units(inputs: Inputs, world: World, slots: int) -> list[list[Unit]]:
    """This rank's slots of the deal of every unit (written or not: every rank deals the same)."""
    dealt_slots = dealt(inputs.units, world.world_size * slots)
    return dealt_slots[world.rank * slots : (world.rank + 1) * slots]


def batches(inputs: Inputs, cfg: LoaderConfig, world: World, slots: list[list[Unit]]) -> Iterable[Batch]:
    """The rank's batches over its slots' units, each sample with its key and id, bad ones kept."""
    skips, where = Marked(cfg.read_policy(skip_unreadable=False)), Whereabouts()
    names = {u.name for slot in slots for u in slot}
    stages = [
        bind(worker_urls, [[u.url for u in slot] for slot in slots], world.rank),
        inputs.reading(names, cfg, skips.shards, where.note),
    ]
    build = bind(
        made,
        stages=stages,
        decode=val_decoder(cfg),
        skips=skips,
        batch_size=cfg.batch_size,
        size=cfg.val_crop_size,
        fills=decoding(cfg.decode).fills,
        labels=inputs.labels,
    )
    return Pass(build, cfg, world, where)


def laid_out(images: Any, compute: Compute) -> Any:
    """A uint8 batch for a model on the CPU, put in the model's memory layout while it is still uint8:
    the loader's batches (and a Ray Data block's HWC pixels) are channels-last, which Compute.inputs
    would otherwise reorder as floats, four times the bytes (on a 2-CPU machine, 28 ms instead of 64
    a batch of 64 224 px crops: half a millisecond an image, a sixth of what predict spends on one
    where the model costs nothing)."""
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or compute.device != "cpu":
        return images
    return images.contiguous(memory_format=torch.channels_last if compute.channels_last else torch.contiguous_format)


@torch.no_grad()
def scored(model: nn.Module, batch: Batch, compute: Compute, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's top-k class indices and their softmax probabilities (float32), on the CPU."""
    images, _ = compute.inputs(laid_out(batch.images, compute), batch.labels)
    with compute.autocast():
        logits = model(images).float()
    top = logits.softmax(dim=1).topk(top_k, dim=1)
    return top.indices.cpu(), top.values.cpu()


@contextlib.contextmanager
def model_threads(world: World, loader_workers: int) -> Iterator[None]:
    """On the CPU, torch's threads for the model while this rank predicts: its cores less those its
    loader workers decode on, at least one (where OMP_NUM_THREADS says how many, as Ray sets it to a
    task's CPUs, that many). torch's default, every core, has the model's threads wait on the cores
    the workers decode on: timm's test_convnext on 2 CPUs with one loader worker took 19 to 21 CPU s
    for 1,000 images where one thread takes 11 to 13, and was no sooner done
    (benchmarks/results/predict_bench-2026-12-06-2.md)."""
    if world.device != "cpu" or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, world.cores - loader_workers))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def predict_rank(job: Prediction, reading: Mapping[str, Any], world: World, trained: Trained | None = None) -> Tally:
    """This rank's share of the units, each written as one part once predicted whole."""
    setup = set_up(job, reading, world, trained)
    folder, cfg = setup.folder, setup.cfg.loader().validating
    slots = rank_units(setup.inputs, world, cfg.slots)
    todo = [[u for u in slot if not folder.done(u)] for slot in slots]
    collector = Collector(setup.inputs.units, folder, setup.trained.classes)
    for unit in (u for slot in todo for u in slot):
        folder.clear_unfinished(unit)
        collector.empty(unit)
    compute = Compute.for_run(setup.cfg, world.device)
    model = compute.model(setup.trained.model).eval()
    try:
        with model_threads(world, setup.cfg.loader_worker_count):
            for batch in batches(setup.inputs, cfg, world, todo) if any(todo) else ():
                classes, probs = scored(model, batch, compute, job.top_k)
                collector.add(batch, classes, probs)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: what is written stays
        e.add_note(f"the {collector.written} parts it wrote stay in {job.out}: the same predict again writes the rest")
        raise
    collector.check_complete([u for slot in todo for u in slot])
    kept = sum(map(len, slots)) - sum(map(len, todo))
    return Tally(collector.samples, collector.errors, collector.written, kept)


def summed(tally: Tally, world: World) -> Tally:
    """Every rank's tally, summed (one all_reduce)."""
    if not world.distributed:
        return tally
    counts = torch.tensor(dataclasses.astuple(tally), dtype=torch.float64, device=world.device)
    dist.all_reduce(counts)
    return Tally(*(int(c) for c in counts.tolist()))


def summary(tally: Tally, seconds: float, out: str) -> str:
    """The line a predict ends with."""
    rate = tally.samples / seconds if seconds > 0 else 0.0
    line = (
        f"predicted {tally.samples} samples ({tally.errors} errors) in {tally.parts} parts into {out} "
        f"({seconds:.1f} s, {rate:.0f} images/s)"
    )
    return line + (f"; {tally.kept} parts were already there" if tally.kept else "")
