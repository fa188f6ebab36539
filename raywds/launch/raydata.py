"""The Ray Data plane (`raywds ray --data-plane ray`): JPEGs are read and decoded by Ray Data
tasks on any node of the cluster, not only by each rank's own loader workers, and each rank
trains on the batches of its share. Each Ray touchpoint is marked `# RAY`.

Each rank builds, for each epoch, a dataset over exactly the shards the epoch's plan deals
it (raywds.plan: the same plan the per-rank loader reads, with one slot per rank): a
datasource with one read task per group of shards (`ShardSource`), each task reading its
shards, shuffling their encoded samples (seeded) and decoding them with the loader's own
decoders into blocks of whole batches (raywds.loader.plane.task_blocks); the rank takes a
whole block as a batch, in a thread that starts as the epoch is handed over. So split mode
stays exact (every sample once per epoch across the ranks, uneven ends finished with Join),
resample mode draws shards with replacement per rank, seeded, for equal batch counts, and an
epoch resumes from a checkpoint inside it as exactly as with the per-rank loader. Validation
goes through the plane too.

    loaders = RayData(Plane(...))          # in each Ray Train worker
    train(cfg, world, report, resume, loaders=loaders)
"""

from __future__ import annotations

import functools
import itertools
import logging
import uuid
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import ray.data
from ray.data.block import Block, BlockAccessor, BlockMetadata
from ray.data.datasource import Datasource, ReadTask
from ray.util.debug import log_once
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raywds.data.manifest import Manifest, ShardInfo
from raywds.errors import ShardError, one_line, own_cause
from raywds.loader.labels import Labels
from raywds.loader.loader import EpochLoader, expected, labels_of, split_slots
from raywds.loader.plane import AHEAD, Columns, Rebatcher, ahead, groups, pinned, rebatcher, task_blocks
from raywds.loader.readers import ReadPolicy
from raywds.loader.settings import LoaderConfig
from raywds.loader.stages import Batch, Decoder, train_decoder, val_decoder
from raywds.plan import seeds
from raywds.plan.epoch import EpochPlan
from raywds.plan.position import Position, already_done
from raywds.world import World

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plane:
    """What the driver decides for every rank's pipelines."""

    task_cpus: float = 1.0
    """CPUs each read-and-decode task reserves."""
    object_store_bytes_per_rank: int = 1 << 30
    """Blocks in flight each rank's pipeline may hold in the object store (Ray Data's limit)."""
    trainer_cpus: float = 0.0
    """CPUs the training workers reserve in all: Ray Data leaves them out of what it schedules on."""
    trainer_gpus: float = 0.0
    executor: str = "rank"
    """Where each rank's Ray Data executor runs: in the rank's own process (`rank`), or in a
    feeder actor of the rank's on its node (`feeder`), which hands the rank its blocks' refs."""

    def apply(self, held_bytes: int = 0) -> None:
        """Set this process's Ray Data context (each rank runs its own pipelines); `held_bytes`:
        what the rank holds of its blocks beyond Ray Data's count (its batches are views of the
        blocks in the object store), left out of the pipeline's budget."""
        logging.getLogger("ray.data").setLevel(logging.WARNING)  # each execution's start and stats at INFO
        ctx = ray.data.DataContext.get_current()  # RAY
        ctx.enable_progress_bars = False  # the workers' bars would interleave in the driver's console
        log_once("ray_data_progress_manager_disabled")  # RAY: internal; uses up Ray Data's warning that they are off
        ctx.print_on_execution_start = False
        ctx.raise_original_map_exception = True  # a decode task's raywds error reaches the rank as itself
        ctx.execution_options.preserve_order = False  # blocks as they finish: the rank shuffles anyway
        ctx.execution_options.resource_limits = ctx.execution_options.resource_limits.copy(
            object_store_memory=max(
                self.object_store_bytes_per_rank - held_bytes, self.object_store_bytes_per_rank // 4
            )
        )
        with warnings.catch_warnings():  # deprecated in favour of node labels, which a plain `ray start` lacks
            warnings.simplefilter("ignore", DeprecationWarning)
            ctx.execution_options.exclude_resources = ctx.execution_options.exclude_resources.copy(
                cpu=self.trainer_cpus, gpu=self.trainer_gpus
            )


PREFETCH = 2
"""Blocks Ray Data fetches to the rank ahead of the rank's thread."""
HELD = PREFETCH + AHEAD + 2
"""Blocks a rank may hold: prefetched, made into batches ahead (raywds.loader.plane.ahead), the
one being rebatched and the one the training step holds."""


class ShardSource(Datasource):  # RAY
    """One read task per group of shards (raywds.loader.plane.groups): each reads its shards,
    shuffles their encoded samples together (`shuffle`: the seed's parts, None for none) and
    decodes them into blocks of whole batches with `decoder`, on whichever node runs it."""

    def __init__(
        self,
        manifest: Manifest,
        split: str,
        shards: Sequence[ShardInfo],
        cfg: LoaderConfig,
        *,
        exact: bool,
        decoder: Decoder,
        left_out: dict[str, np.ndarray] | None = None,
        shuffle: tuple[Any, ...] | None = None,
    ):
        self.shards = shards
        self.groups = groups(shards, cfg.worker_shuffle_buffer if shuffle is not None else 0)
        self.expected = expected(manifest, split, {s.name for s in shards})
        self.labels = labels_of(manifest)
        self.urls = {s.name: manifest.url(s) for s in shards}
        self.policy = cfg.read_policy(skip_unreadable=not exact)
        self.cfg, self.decoder, self.shuffle = cfg, decoder, shuffle
        self.left_out = left_out or {}
        """By shard name, a bool per sample already trained on, for the shards a resumed epoch partly trained on."""

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(s.num_samples for s in self.shards) * self.cfg.crop_size**2 * 3 or None

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ReadTask]:
        tasks = []
        for g, group in enumerate(self.groups):
            reads = [(self.urls[s.name], self.expected[self.urls[s.name]], self.left_out.get(s.name)) for s in group]
            seed = seeds.number(seeds.PLANE_SHUFFLE, *self.shuffle, g) if self.shuffle is not None else None
            read = functools.partial(_read, reads, self.decoder, self.policy, self.cfg, seed, self.labels)
            rows = sum(e.num_samples - (int(c.sum()) if c is not None else 0) for _, e, c in reads)
            size = rows * self.cfg.crop_size**2 * 3
            meta = BlockMetadata(
                num_rows=rows, size_bytes=size, exec_stats=None, input_files=tuple(u for u, _, _ in reads)
            )
            tasks.append(ReadTask(read, meta))  # RAY
        return tasks


def _read(
    reads: list[Any], decoder: Decoder, policy: ReadPolicy, cfg: LoaderConfig, seed: int | None, labels: Labels | None
) -> Iterator[Block]:
    """Runs in a Ray Data read task: the task's blocks of decoded crops, each row marked with its node."""
    node = ray.util.get_node_ip_address()  # RAY
    blocks = task_blocks(
        reads, decoder, policy, size=cfg.crop_size, batch_size=cfg.batch_size, shuffle_seed=seed,
        verify_hash=cfg.verify_hashes, labels=labels,
    )  # fmt: skip
    for columns in blocks:
        columns["node"] = np.full(len(columns["id"]), node, dtype=object)
        yield BlockAccessor.batch_to_block(columns)  # RAY


class RayData:
    """The run's batches from the Ray Data plane (raywds.loader.loader.Loaders)."""

    def __init__(self, plane: Plane):
        self.plane = plane
        self._feeder: Any = None
        plane.apply()

    def dataset(
        self,
        manifest: Manifest,
        split: str,
        shards: Sequence[ShardInfo],
        cfg: LoaderConfig,
        *,
        epoch: int | None,
        exact: bool,
        left_out: dict[str, np.ndarray] | None = None,
        shuffle: tuple[Any, ...] | None = None,
    ) -> ray.data.Dataset:
        """`shards` read, shuffled (`shuffle`) and decoded (`epoch`'s training crops, None:
        validation's) by read tasks of whole batches."""
        decoder = val_decoder(cfg) if epoch is None else train_decoder(cfg, epoch)
        cfg = cfg.validating if epoch is None else cfg  # validation's crop size, in the blocks' sizes too
        self.plane.apply(held_bytes=HELD * cfg.batch_size * cfg.crop_size**2 * 3)
        source = ShardSource(
            manifest, split, shards, cfg, exact=exact, decoder=decoder, left_out=left_out, shuffle=shuffle
        )
        return ray.data.read_datasource(  # RAY
            source, override_num_blocks=max(len(source.groups), 1), num_cpus=self.plane.task_cpus
        )

    def blocks(self, ds: ray.data.Dataset) -> Iterator[Columns]:
        """The dataset's blocks as they come (each a whole batch but a task's last), from the
        executor in this process or the rank's feeder's."""
        if self.plane.executor == "feeder":
            return fed(self.feeder(), ds)
        return iter(ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=PREFETCH))  # RAY

    def feeder(self) -> Any:
        """The rank's feeder actor, started on this node at the first need."""
        if self._feeder is None:
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)  # RAY
            self._feeder = Feeder.options(scheduling_strategy=here).remote(self.plane)  # type: ignore[attr-defined]
        return self._feeder

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
        """The rank's epoch, started now (in a thread of its own: while the epoch before validates)."""
        rank = world.rank
        left_out, reseed = already_done(position, epoch, manifest.shards("train"))
        draws = plan.mode.shards_for(
            plan, manifest.shards("train"), rank=rank, worker=0, seed=cfg.seed, epoch=epoch, reseed=reseed
        )
        batches = rebatcher(plan, cfg.batch_size)
        exact = batches.partial  # every sample once: the rank's shards once, a short last batch
        shuffle = (cfg.seed, epoch, rank) if cfg.worker_shuffle_buffer else None
        delivered = [0]

        def rounds() -> Iterator[Columns]:
            """Split: the rank's shards, once. Resample: shard draws until the epoch's batches are
            full (a round draws what the batches still need, plus one shard for skipped samples)."""
            for round_ in itertools.count():
                shards = list(draws) if exact else _enough(draws, plan.samples_per_rank[rank] - delivered[0])
                before = batches.num_decoded
                if shards:
                    seeded = (*shuffle, round_) if shuffle is not None else None
                    ds = self.dataset(
                        manifest, "train", shards, cfg, epoch=epoch, exact=exact, left_out=left_out, shuffle=seeded
                    )
                    yield from self.blocks(ds)
                if exact:
                    return
                if batches.num_decoded == before:  # resample skips unreadable shards, but not all of them
                    raise ShardError(
                        f"rank {rank}: none of the {len(shards)} shards drawn could be read, the last: "
                        f"{batches.last_bad_shard}; is the shard server down?"
                    )

        def stream() -> Iterator[Batch]:
            try:
                for batch in unwrapped(batches(rounds())):
                    delivered[0] += len(batch.keys)
                    yield batch
            finally:
                if batches.nodes:  # Ray Data's stats count nodes, not which rank's crops came from where
                    where = ", ".join(f"{ip} ({n})" for ip, n in sorted(batches.nodes.items()))
                    log.info(f"rank {rank}'s epoch {epoch + 1} was decoded on {len(batches.nodes)} node(s): {where}")

        pin = pinned if world.device.startswith("cuda") else None
        started = [ahead(stream(), each=pin)]
        return EpochLoader(lambda: started.pop() if started else ahead(stream(), each=pin), plan, rank)

    def val(self, manifest: Manifest, cfg: LoaderConfig, world: World) -> Iterable[Batch]:
        shards = split_slots(manifest, "val", world.world_size)[world.rank]
        batches = Rebatcher(cfg.batch_size, partial=True)
        if not shards:
            return iter(())
        ds = self.dataset(manifest, "val", shards, cfg, epoch=None, exact=True)
        return ahead(unwrapped(batches(self.blocks(ds))), each=pinned if world.device.startswith("cuda") else None)

    def close(self) -> None:
        """Stop the rank's feeder (each epoch's Dataset ends with the epoch)."""
        if self._feeder is not None:
            ray.kill(self._feeder)  # RAY
            self._feeder = None


@ray.remote(num_cpus=0)  # RAY
class Feeder:
    """A rank's Ray Data executor in a process of its own on the rank's node, so that the
    executor's scheduling does not share the training process's interpreter: the rank asks it
    for its next blocks' refs and fetches them itself (from the node's object store, no copy)."""

    def __init__(self, plane: Plane):
        plane.apply()
        self.streams: dict[str, Iterator[Any]] = {}

    def start(self, key: str, ds: ray.data.Dataset) -> None:
        """Execute `ds` (with the context it was made with, the rank's) as the stream `key`."""
        self.streams[key] = iter(ds.iter_internal_ref_bundles())  # RAY

    def next(self, key: str, most: int) -> tuple[list[Any], bool]:
        """Up to `most` blocks' refs of the stream `key`, and whether it has ended."""
        stream, refs = self.streams[key], []
        for bundle in stream:
            refs += bundle.block_refs
            if len(refs) >= most:
                return refs, False
        del self.streams[key]
        return refs, True

    def stop(self, key: str) -> None:
        self.streams.pop(key, None)


def fed(feeder: Any, ds: ray.data.Dataset) -> Iterator[Columns]:
    """The blocks of `ds` as the rank's feeder executes it: their refs asked for one request
    ahead, each block fetched here as numpy columns."""
    key = uuid.uuid4().hex
    ray.get(feeder.start.remote(key, ds))  # RAY
    pending = feeder.next.remote(key, PREFETCH)  # RAY
    done = False
    try:
        while not done:
            refs, done = ray.get(pending)  # RAY
            if not done:
                pending = feeder.next.remote(key, PREFETCH)  # RAY
            for ref in refs:
                yield BlockAccessor.for_block(ray.get(ref)).to_batch_format("numpy")  # RAY
    finally:
        if not done:
            feeder.stop.remote(key)  # RAY


def unwrapped(batches: Iterator[Batch]) -> Iterator[Batch]:
    """A bad sample or shard raised in a Ray Data task arrives wrapped in Ray's errors: raise
    raywds's own, in its own words (from Ray's, which keeps the traceback)."""
    try:
        yield from batches
    except Exception as e:
        own = own_cause(e)
        if own is None or own is e:
            raise
        raise type(own)(one_line(own).splitlines()[0]) from e  # Ray Data adds its retry advice below


def store_use() -> tuple[int, int]:
    """(bytes in this node's object store now, bytes it has spilled to disk so far): for benchmarks and tests."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address  # RAY: internal

    state = get_state_from_address(ray.get_runtime_context().gcs_address)  # RAY
    stats = get_memory_info_reply(state).store_stats
    return int(stats.object_store_bytes_used), int(stats.spilled_bytes_total)


def _enough(draws: Iterator[ShardInfo], samples: int) -> list[ShardInfo]:
    """Shards from `draws` (endless) holding at least `samples` samples, and one more."""
    out: list[ShardInfo] = []
    held = 0
    while held < samples or not out:
        shard = next(draws)
        out.append(shard)
        held += shard.num_samples
    out.append(next(draws))
    return out
