"""Shuffle quality: replay the order in which rank 0 would receive samples, through the
loader's own stages (shard choice, worker shuffle, worker batches, DataLoader round robin,
main-process rebatch), with no images decoded, and measure how well it mixes.

    raywds plan --num-shards 1282 --samples-per-shard 1000 --batch-size 256 --shuffle-report

Measures per batch: distinct classes (against a uniformly random batch: C(1 - (1 - 1/C)^B)),
the share of the batch from its most common shard, and the rank correlation between the
order of training and the samples' order in the source.
"""

from __future__ import annotations

import itertools
import random
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from raywds.data.manifest import ShardInfo, is_url
from raywds.loader.stages import Batch, collate, rebatched, shuffled
from raywds.plan import seeds
from raywds.plan.epoch import EpochPlan

Labels = Callable[[ShardInfo, int], list[int]]

T = TypeVar("T")


def _worker_stream(
    shards: Iterator[ShardInfo],
    offsets: dict[str, int],
    labels: Labels,
    *,
    buffer: int,
    rng: random.Random,
    batch_size: int,
) -> Iterator[Batch]:
    """One DataLoader worker: its shards' samples in order, shuffled, batched (ids and labels only)."""

    no_pixels = torch.empty(0, 0, 0, dtype=torch.uint8)  # one for every sample: only stacked, never written

    def samples() -> Iterator[tuple[torch.Tensor, int, int, str]]:
        for shard in shards:
            first = offsets[shard.name]
            for i, label in enumerate(labels(shard, first)):
                yield no_pixels, label, first + i, shard.name  # the shard stands in for the key

    batch: list[tuple[torch.Tensor, int, int, str]] = []
    for sample in shuffled(samples(), buffer=buffer, rng=rng):
        batch.append(sample)
        if len(batch) == batch_size:
            yield collate(batch)
            batch = []
    if batch:
        yield collate(batch)


def round_robin(streams: list[Iterator[T]]) -> Iterator[T]:
    """The order in which a DataLoader hands over its workers' batches."""
    live = list(streams)
    while live:
        for stream in list(live):
            batch = next(stream, None)
            if batch is None:
                live.remove(stream)
            else:
                yield batch


def replay(
    plan: EpochPlan,
    shards: Sequence[ShardInfo],
    labels: Labels,
    *,
    seed: int,
    epoch: int,
    worker_buffer: int,
    cross_buffer: int,
    num_batches: int | None,
    rank: int = 0,
) -> list[Batch]:
    """A rank's first `num_batches` batches (None: its whole epoch) as the loader delivers them:
    the same shard streams (the plan's mode) and the same seeds (raywds.plan.seeds)."""
    offsets, start = {}, 0
    for s in shards:
        offsets[s.name] = start
        start += s.num_samples
    streams = []
    for worker in range(plan.num_workers):
        source = plan.mode.shards_for(plan, shards, rank=rank, worker=worker, seed=seed, epoch=epoch)
        rng = seeds.rng(seeds.WORKER_SHUFFLE, seed, epoch, rank, worker)
        streams.append(
            _worker_stream(source, offsets, labels, buffer=worker_buffer, rng=rng, batch_size=plan.batch_size)
        )
    batches: Iterator[Batch] = round_robin(streams)
    if plan.mode.exact or cross_buffer:
        rng = seeds.rng(seeds.CROSS_SHUFFLE, seed, epoch, rank)
        batches = rebatched(batches, batch_size=plan.batch_size, buffer=cross_buffer, rng=rng, partial=plan.mode.exact)
    return list(itertools.islice(plan.mode.epoch_batches(batches, plan, rank), num_batches))


def measure(batches: list[Batch], num_classes: int) -> dict[str, float]:
    ids = torch.cat([b.ids for b in batches]).numpy()
    order = np.arange(len(ids))
    ranks = np.argsort(np.argsort(ids))
    corr = float(np.corrcoef(order, ranks)[0, 1]) if len(ids) > 1 else 0.0
    size = int(np.mean([len(b.keys) for b in batches]))
    return {
        "classes_per_batch": float(np.mean([len(set(b.labels.tolist())) for b in batches])),
        "ideal_classes_per_batch": num_classes * (1 - (1 - 1 / num_classes) ** size),
        "top_shard_share": float(np.mean([Counter(b.keys).most_common(1)[0][1] / len(b.keys) for b in batches])),
        "order_correlation": corr,
    }


def sorted_labels(num_samples: int, num_classes: int) -> Labels:
    """Shards written in class order, as a tar of an ImageNet tree without a shuffle would be."""
    return lambda shard, offset: [(offset + i) * num_classes // num_samples for i in range(shard.num_samples)]


def shuffled_labels(num_samples: int, num_classes: int, seed: int) -> Labels:
    """Samples shuffled before sharding, as `raywds convert` writes them."""
    perm = np.random.default_rng(seed).permutation(num_samples)
    return lambda shard, offset: [int(perm[offset + i]) * num_classes // num_samples for i in range(shard.num_samples)]


def tar_labels(base: str) -> Labels:
    """The real `.cls` of each sample, read from local shards (tar headers and the tiny .cls members)."""

    def read(shard: ShardInfo, offset: int) -> list[int]:
        with tarfile.open(Path(base) / shard.name) as tar:
            return [int(tar.extractfile(m).read()) for m in tar.getmembers() if m.name.endswith(".cls")]  # type: ignore[union-attr]

    return read


def report(
    plan: EpochPlan,
    shards: Sequence[ShardInfo],
    *,
    data: str | None,
    num_classes: int,
    seed: int,
    epoch: int,
    worker_buffer: int,
    cross_buffer: int,
    num_batches: int,
) -> str:
    """The table `raywds plan --shuffle-report` prints."""
    n = sum(s.num_samples for s in shards)
    cases: list[tuple[str, Labels, int]]
    if data is not None:
        from raywds.data.manifest import read_manifest

        manifest = read_manifest(data)
        if is_url(manifest.base):
            return "shuffle report: needs local shards (it reads the .cls members); give the shard folder as --data"
        cases = [("these shards", tar_labels(manifest.base), len(manifest.classes))]
    else:
        cases = [
            ("class-sorted shards (worst case)", sorted_labels(n, num_classes), num_classes),
            ("shuffled before sharding (raywds convert)", shuffled_labels(n, num_classes, seed), num_classes),
        ]
    lines = [
        f"shuffle quality: rank 0, first {num_batches} batches of {plan.batch_size}, "
        f"{plan.num_workers} loader workers, worker buffer {worker_buffer}, cross-worker buffer {cross_buffer}",
        f"{'source':<44} {'classes/batch':>13} {'ideal':>7} {'top shard share':>15} {'order corr':>10}",
    ]
    for name, labels, classes in cases:
        m = measure(
            replay(
                plan,
                shards,
                labels,
                seed=seed,
                epoch=epoch,
                worker_buffer=worker_buffer,
                cross_buffer=cross_buffer,
                num_batches=num_batches,
            ),
            classes,
        )
        lines.append(
            f"{name:<44} {m['classes_per_batch']:>13.1f} {m['ideal_classes_per_batch']:>7.1f} "
            f"{m['top_shard_share']:>15.2f} {m['order_correlation']:>10.3f}"
        )
    return "\n".join(lines)
