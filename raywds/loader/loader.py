"""Train and validation loaders over WebDataset shards, one per rank. Which shards each
(rank, worker) reads, and where the epoch ends, is the plan's (raywds.plan); this module
builds the DataLoader over the stages (raywds.loader.stages) that read them.

validation: shards dealt in manifest order, no shuffle, no padding, partial last batches.

    from raywds.plan.modes import epoch_plan
    plan = epoch_plan(manifest, cfg, world.world_size, epoch=0)
    for batch in train_loader(manifest, cfg, world, plan, epoch=0): ...
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial as bind
from typing import Any, Protocol

import webdataset as wds

from raywds.data.columns import sample_counts
from raywds.data.manifest import Manifest, ShardInfo, deal, shard_url
from raywds.loader.blocks import Blocks, Slots
from raywds.loader.clock import Clock
from raywds.loader.decodings import decoding
from raywds.loader.labels import Labels
from raywds.loader.pool import Build, Pool
from raywds.loader.readers import Expected, tar_samples
from raywds.loader.settings import LoaderConfig
from raywds.loader.stages import (
    Batch,
    Decoder,
    Skips,
    collate,
    decoded,
    rebatched,
    train_decoder,
    unconsumed,
    val_decoder,
    worker_shuffled,
    worker_urls,
)
from raywds.loader.watch import Whereabouts
from raywds.plan import seeds
from raywds.plan.epoch import EpochPlan
from raywds.plan.position import Position, already_done
from raywds.plan.resample import PREFETCH
from raywds.world import World


def expected(manifest: Manifest, split: str, names: set[str] | None = None) -> dict[str, Expected]:
    """Each shard's URL -> what the manifest says reading it must give (only the shards in `names`, when given)."""
    shards, first = manifest.shards(split), manifest.first_ids(split)
    index = manifest.index(split)
    places = range(len(shards)) if names is None else sorted(index[name] for name in names)
    return {
        url: Expected(
            num_samples=s.num_samples,
            num_bytes=s.num_bytes,
            sha256=s.sha256,
            first_id=first[i],
            first_key=manifest.first_keys.get(s.name, ""),
            members=manifest.members if manifest.members.drop_incomplete else None,
        )
        for i in places
        for s in (shards[i],)
        for url in (manifest.url(s),)
    }


def labels_of(manifest: Manifest) -> Labels | None:
    """Where the manifest's samples keep image and label, for shards raywds indexed (None: .jpg and .cls)."""
    return Labels(manifest.members, manifest.classes) if manifest.members.drop_incomplete else None


def _read_stages(
    source: Any,
    manifest: Manifest,
    split: str,
    cfg: LoaderConfig,
    skips: Skips,
    where: Whereabouts,
    names: set[str] | None = None,
    clock: Clock | None = None,
) -> list[Any]:
    """Shard URLs -> samples with ids, each shard checked against the manifest (`names`: the only
    shards the source gives, when known), its URL noted in `where`; `clock` times the reading,
    each shard's bytes from the same manifest entries."""
    wanted = expected(manifest, split, names)
    stages = [
        source,
        bind(
            tar_samples,
            policy=skips.shards.policy,
            expected=wanted,
            verify_hashes=cfg.verify_hashes,
            failures=skips.shards,
            opening=where.note,
        ),
    ]
    if clock is not None:
        stages.append(bind(clock.reading, sizes={u: e.num_bytes for u, e in wanted.items() if e.num_bytes}))
    return stages


def made(
    blocks: Blocks,
    *,
    stages: list[Any],
    decode: Decoder,
    batch_size: int,
    slot_shape: tuple[int, int, int] | None,
    partial: bool,
    skips: Skips,
    clock: Clock | None = None,
    labels: Labels | None = None,
) -> wds.DataPipeline:
    """Worker side: the stages, decoding (bad samples to `skips`) and batching (`partial`: keep a
    short last batch), each batch in one of the worker's reused shared-memory `blocks`
    (raywds.loader.blocks; a `cpu` crop is resized straight into its slot of `slot_shape`),
    carrying what `skips` skipped before it and what its worker spent (`clock`)."""
    slots = Slots(batch_size, slot_shape, blocks.take) if slot_shape is not None else None
    collation: Callable[[list[Any]], Batch] = bind(collate, out_of=blocks.take)
    if clock is not None:
        decode, collation = bind(clock.decoding, decode), bind(clock.collating, collation)
    batched = wds.batched(batch_size, collation_fn=collation, partial=partial)
    after = [skips.attach, *([clock.attach] if clock is not None else [])]
    return wds.DataPipeline(
        *stages,
        bind(decoded, decode=decode, skips=skips, slots=slots, labels=labels),
        batched,
        *after,
        blocks.leased,
    )


class Pass:
    """One pass of a pipeline's batches, made by `pool`'s workers, handed the pipeline as the
    pass is made (they start at once), or, with no pool, by workers of its own started when it
    is iterated and stopped at its end. Iterable again: each further pass sends it again. A
    worker silent for cfg.loader_timeout is an error naming the rank, the worker and the shard
    it reads (`where`)."""

    def __init__(self, build: Build, cfg: LoaderConfig, world: World, where: Whereabouts, pool: Pool | None = None):
        self.build, self.count, self.world, self.pool = build, cfg.loader_workers, world, pool
        self.timeout = cfg.loader_timeout
        self.on_timeout = bind(where.stalled, world.rank, timeout_s=cfg.loader_timeout)
        self._begun = pool.begin(build, self.count, self.on_timeout) if pool is not None else None

    def __iter__(self) -> Iterator[Batch]:
        begun, self._begun = self._begun, None
        if self.pool is not None:
            yield from begun if begun is not None else self.pool.begin(self.build, self.count, self.on_timeout)
            return
        pool = Pool(self.world, timeout=self.timeout)
        try:
            yield from pool.begin(self.build, self.count, self.on_timeout)
        finally:
            pool.close()


def _loader(
    stages: list[Any],
    decode: Decoder,
    cfg: LoaderConfig,
    world: World,
    where: Whereabouts,
    *,
    partial: bool,
    skips: Skips,
    clock: Clock | None = None,
    labels: Labels | None = None,
    pool: Pool | None = None,
) -> Pass:
    """The pass of `made`'s pipeline over the stages, by `pool`'s workers (or a pool of its own)."""
    size = cfg.crop_size
    build = bind(
        made,
        stages=stages,
        decode=decode,
        batch_size=cfg.batch_size,
        slot_shape=(3, size, size) if decoding(cfg.decode).fills else None,
        partial=partial,
        skips=skips,
        clock=clock,
        labels=labels,
    )
    return Pass(build, cfg, world, where, pool)


class EpochLoader:
    """One epoch of batches for one rank; its length is the plan's batch count for the rank."""

    def __init__(self, batches: Callable[[], Iterator[Batch]], plan: EpochPlan, rank: int):
        self.batches = batches
        self.plan = plan
        self.rank = rank

    def __iter__(self) -> Iterator[Batch]:
        batches = self.batches()
        try:
            yield from self.plan.mode.epoch_batches(batches, self.plan, self.rank)
        finally:  # the epoch may end before the loader's stream does (resample): stop its workers now
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def __len__(self) -> int:
        return self.plan.batches_per_rank[self.rank]


def drawn(
    plan: EpochPlan, shards: Sequence[ShardInfo], cfg: LoaderConfig, rank: int, *, epoch: int, reseed: int = 0
) -> list[list[ShardInfo]]:
    """resample: each of `rank`'s workers' shard draws for the epoch, made here: what a worker can
    read (its share of the rank's batches, PREFETCH batches ahead, its shuffle buffer and the
    cross-worker one), three times over for samples skipped, in shards of the fewest samples any
    has. The same draws, in the same order, as the worker would make itself."""
    per_worker = (math.ceil(plan.max_batches / plan.num_workers) + PREFETCH + 1) * plan.batch_size
    samples = per_worker + cfg.worker_shuffle_buffer + cfg.cross_worker_shuffle_buffer
    count = 3 * math.ceil(samples / max(1, int(sample_counts(shards).min()))) + 8
    draws = bind(plan.mode.shards_for, plan, shards, rank=rank, seed=cfg.seed, epoch=epoch, reseed=reseed)
    return [list(itertools.islice(draws(worker=w), count)) for w in range(plan.num_workers)]


def train_stages(
    manifest: Manifest,
    cfg: LoaderConfig,
    rank: int,
    plan: EpochPlan,
    *,
    epoch: int,
    position: Position | None = None,
    clock: Clock | None = None,
) -> tuple[list[Any], Skips, Whereabouts]:
    """The stages every loader worker of `rank` runs before decoding (each worker gets a copy): only the rank's
    slots (split) or draws (resample), the manifest's entries for those shards and the flags of
    those partly trained on; never the plan, the manifest or the position. `clock` times the
    reading, decoding and collating (raywds.loader.clock)."""
    shards = manifest.shards("train")
    flags, reseed = already_done(position, epoch, shards)
    if plan.slots:
        mine = [plan.slot(rank, w) for w in range(plan.num_workers)]
    else:
        mine = drawn(plan, shards, cfg, rank, epoch=epoch, reseed=reseed)
    names = {s.name for slot in mine for s in slot}
    source = bind(worker_urls, [[manifest.url(s) for s in slot] for slot in mine], rank)
    index, first = manifest.index("train"), manifest.first_ids("train")
    left_out = {shard_url(manifest.base, n): (first[index[n]], f) for n, f in flags.items() if n in names}
    skips, where = Skips(cfg.read_policy(skip_unreadable=not plan.mode.exact)), Whereabouts()
    stages = [
        *_read_stages(source, manifest, "train", cfg, skips, where, names, clock),
        bind(unconsumed, left_out=left_out),
        bind(worker_shuffled, buffer=cfg.worker_shuffle_buffer, seed=cfg.seed, epoch=epoch, rank=rank),
    ]
    return stages, skips, where


def train_loader(
    manifest: Manifest,
    cfg: LoaderConfig,
    world: World,
    plan: EpochPlan,
    *,
    epoch: int,
    position: Position | None = None,
    pool: Pool | None = None,
) -> EpochLoader:
    """This rank's training batches for `epoch` as `plan` deals them; after `position`, only
    what the epoch has not yet delivered (exact mode) or a reseeded stream (resample). `pool`:
    the run's loader workers, handed the epoch now (else workers of the epoch's own, started
    when it is iterated)."""
    rank, exact = world.rank, plan.mode.exact
    clock = Clock()
    stages, skips, where = train_stages(manifest, cfg, rank, plan, epoch=epoch, position=position, clock=clock)
    decode, labels = train_decoder(cfg, epoch), labels_of(manifest)
    loader = _loader(
        stages, decode, cfg, world, where, partial=exact, skips=skips, clock=clock, labels=labels, pool=pool
    )
    if not exact and cfg.cross_worker_shuffle_buffer == 0:
        return EpochLoader(lambda: iter(loader), plan, rank)

    def batches() -> Iterator[Batch]:
        rng = seeds.rng(seeds.CROSS_SHUFFLE, cfg.seed, epoch, rank)
        return rebatched(
            loader, batch_size=cfg.batch_size, buffer=cfg.cross_worker_shuffle_buffer, rng=rng, partial=exact
        )

    return EpochLoader(batches, plan, rank)


def split_slots(manifest: Manifest, split: str, num_slots: int) -> list[list[ShardInfo]]:
    """Deal `split`'s shards, in manifest order, to `num_slots` slots."""
    return deal(list(manifest.shards(split)), num_slots)


def val_loader(
    manifest: Manifest, cfg: LoaderConfig, world: World, pool: Pool | None = None, *, split: str = "val"
) -> Iterable[Batch]:
    """This rank's share of the validation split (or of `split`, read as validation reads: `raywds
    evaluate --split train`): every sample once across ranks, no padding (`pool`: as train_loader's)."""
    workers = cfg.slots
    slots = split_slots(manifest, split, world.world_size * workers)
    mine = slots[world.rank * workers : (world.rank + 1) * workers]
    urls = [[manifest.url(s) for s in slot] for slot in mine]
    skips, where = Skips(cfg.read_policy(skip_unreadable=False)), Whereabouts()
    names = {s.name for slot in mine for s in slot}
    stages = _read_stages(bind(worker_urls, urls, world.rank), manifest, split, cfg, skips, where, names)
    decode = val_decoder(cfg)
    return _loader(
        stages, decode, cfg.validating, world, where, partial=True, skips=skips, labels=labels_of(manifest), pool=pool
    )


class Loaders(Protocol):
    """Where a run's batches come from: each rank's own loader workers (`PerRank`), or the Ray
    Data plane (raywds.launch.raydata), which decodes on any node of the cluster. `train` hands
    the epoch over as it is called (its batches may start then); `close` ends the run's loaders."""

    def train(
        self,
        manifest: Manifest,
        cfg: LoaderConfig,
        world: World,
        plan: EpochPlan,
        *,
        epoch: int,
        position: Position | None = None,
    ) -> EpochLoader: ...

    def val(self, manifest: Manifest, cfg: LoaderConfig, world: World) -> Iterable[Batch]: ...

    def close(self) -> None: ...


class PerRank:
    """Each rank's DataLoader workers read and decode the shards the plan deals it (the default):
    one pool of workers for training and one for validation, each kept for the whole run, so
    an epoch or a validation pass starts no process. The validation workers start with the
    first training epoch, so that its validation does not wait for them."""

    def __init__(self) -> None:
        self.pools: dict[str, Pool] = {}

    def pool(self, name: str, cfg: LoaderConfig, world: World) -> Pool:
        """The run's `name` pool for `world` (a new world, a new pool: its workers' fork server knows the old)."""
        pool = self.pools.get(name)
        if pool is None or pool.world != world or pool.timeout != cfg.loader_timeout:
            if pool is not None:
                pool.close()
            pool = self.pools[name] = Pool(world, timeout=cfg.loader_timeout)
        return pool

    def train(
        self,
        manifest: Manifest,
        cfg: LoaderConfig,
        world: World,
        plan: EpochPlan,
        *,
        epoch: int,
        position: Position | None = None,
    ) -> EpochLoader:
        pool = self.pool("train", cfg, world)
        loader = train_loader(manifest, cfg, world, plan, epoch=epoch, position=position, pool=pool)
        if "val" in manifest.splits:
            self.pool("val", cfg, world).warm(cfg.loader_workers)
        return loader

    def val(self, manifest: Manifest, cfg: LoaderConfig, world: World) -> Iterable[Batch]:
        return val_loader(manifest, cfg, world, pool=self.pool("val", cfg, world))

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
