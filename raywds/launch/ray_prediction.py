"""`raywds predict MODEL --data SHARDS --out DIR --ray`: a predict on the Ray cluster, in one of two
ways (`--data-plane`), both writing the same parts into DIR (which every node must reach, as it must
reach --data). Each Ray touchpoint is marked `# RAY`.

- `loader` (rank per worker): the ranks of a torchrun predict as Ray tasks, one a GPU of the
  cluster (without GPUs, --num-workers tasks of one CPU each and their loader workers' CPUs, as
  raywds.launch.cluster.plan_workers places training's). Each reads its share of the units with
  its own loader workers and writes their parts (raywds.infer.prediction.predict_rank); the driver
  adds their counts. A task whose worker or node dies runs again (MAX_RETRIES) and skips the parts
  it had written.
- `ray` (Ray Data): one read task per unit reads it with raywds's own reader and decodes it with
  raywds's validation crop (raywds.infer.samples.decoded_columns), on any node; an actor pool of
  model replicas (one a GPU; without GPUs one a CPU, half the cluster's CPUs unless told) scores
  the blocks; the driver gathers the rows by unit and writes each part once it is whole.

The driver loads MODEL and opens DIR first, so a refusal (another model's DIR, --top-k beyond the
classes) is one line before anything starts on the cluster; the model travels in the object store.

    tally, seconds = predict_on_ray(job, {"batch_size": 64}, "loader", address=None, num_workers=4)
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from functools import partial as bind
from typing import Any, cast

import numpy as np
import ray
import ray.data
from ray.data.block import Block, BlockAccessor, BlockMetadata
from ray.data.datasource import Datasource, ReadTask
from ray.util.debug import log_once

from raywds.data import stores
from raywds.errors import ConfigError, RaywdsError, StorageError, one_line, own_cause
from raywds.infer.inputs import Inputs, Reading, Unit, unit_of
from raywds.infer.parts import Collector
from raywds.infer.prediction import Setup, Tally, load, predict_rank, scored, set_up, weights_sha256
from raywds.infer.predictoptions import Prediction
from raywds.infer.samples import decoded_columns
from raywds.launch import cluster
from raywds.launch.raydata import unwrapped
from raywds.loader.labels import Labels
from raywds.loader.readers import Failures
from raywds.loader.settings import LoaderConfig
from raywds.loader.stages import Batch, Decoder, val_decoder
from raywds.train.compute import Compute
from raywds.train.config import TrainConfig
from raywds.world import World

log = logging.getLogger(__name__)

MAX_RETRIES = 2
"""Times Ray runs a rank's task again after its worker process or node died; an error the task
raises itself (a shard that stays unreadable) is final. The parts it wrote are kept either way."""
PATHS = ("index_cache", "shards_at", "cache_dir")
"""The reading settings that may name a local path, which a task resolves in a folder of Ray's."""
ROWS_PER_BLOCK = 64
"""Samples per block a Ray Data read task decodes and hands on."""


def absolute(reading: Mapping[str, Any]) -> dict[str, Any]:
    """The reading flags with their local paths absolute (URLs and lists of servers stay)."""
    paths = {
        name: os.path.abspath(stores.local_path(value))
        for name in PATHS
        if (value := reading.get(name)) and "," not in value and stores.scheme(value) == stores.LOCAL
    }
    return {**reading, **paths}


def _device() -> str:
    """The task's or actor's GPU where it has one (Ray makes it the only one it sees)."""
    return "cuda:0" if ray.get_gpu_ids() else "cpu"  # RAY


def _rank(job: Prediction, reading: dict[str, Any], trained: list[Any], rank: int, world_size: int) -> Tally:
    """Runs in a Ray task: rank `rank`'s share, its parts written into --out."""
    world = World(rank=rank, world_size=world_size, device=_device())
    return predict_rank(job, reading, world, trained=ray.get(trained[0]))  # RAY


def _got(ref: Any, what: str) -> Any:
    """A task's result; its own raywds error as it is (naming `what`), Ray's in one line."""
    try:
        return ray.get(ref)  # RAY
    except ray.exceptions.RayError as e:  # RAY: the task raised, or its worker died more often than retried
        own = own_cause(e)
        if own is not None:
            raise type(own)(f"{one_line(own)} ({what})") from None
        raise RaywdsError(f"{what}'s predict failed on the cluster: {one_line(e)[:500]}") from None


def on_ranks(job: Prediction, reading: dict[str, Any], setup: Setup, num_workers: int | None) -> Tally:
    """`--data-plane loader`: the ranks as Ray tasks, each with its own loader workers."""
    plan, task = cluster.rank_tasks(_rank, setup.cfg.loader_workers, num_workers, MAX_RETRIES)
    log.info(f"predicting with {plan.num_workers} {'GPU' if plan.use_gpu else 'CPU'} rank(s) as Ray tasks")
    shared = [ray.put(setup.trained)]  # RAY: the model once into the object store, not once a task
    refs = [task.remote(job, reading, shared, rank, plan.num_workers) for rank in range(plan.num_workers)]  # RAY
    tally = Tally()
    for rank, ref in enumerate(refs):
        tally = tally.plus(_got(ref, f"rank {rank}"))
    return tally


class UnitSource(Datasource):  # RAY
    """One read task per unit: its samples read by raywds's reader (checked against the manifest, an
    unreadable shard raised after the reader's retries) and decoded by the validation crop, every
    sample a row (one that cannot be decoded with a black image and its reason in `error`)."""

    def __init__(self, inputs: Inputs, units: list[Unit], cfg: LoaderConfig):
        self.units, self.size = units, cfg.val_crop_size
        self.read = inputs.reading({u.name for u in units}, cfg, Failures(cfg.read_policy(skip_unreadable=False)), None)
        self.decode, self.labels = val_decoder(cfg), inputs.labels

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(u.num_samples for u in self.units) * self.size**2 * 3 or None

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ReadTask]:
        tasks = []
        for unit in self.units:
            read = bind(_read, self.read, unit.url, self.decode, self.size, self.labels)
            meta = BlockMetadata(
                num_rows=unit.num_samples,
                size_bytes=unit.num_samples * self.size**2 * 3,
                exec_stats=None,
                input_files=(unit.url,),
            )
            tasks.append(ReadTask(read, meta))  # RAY
        return tasks


def _read(read: Reading, url: str, decode: Decoder, size: int, labels: Labels | None) -> Iterator[Block]:
    """Runs in a Ray Data read task: a unit's samples in decoded blocks of ROWS_PER_BLOCK."""
    held: list[dict[str, Any]] = []
    for sample in read([{"url": url}]):
        held.append(sample)
        if len(held) == ROWS_PER_BLOCK:
            yield BlockAccessor.batch_to_block(decoded_columns(held, decode, size=size, labels=labels))  # RAY
            held = []
    if held:
        yield BlockAccessor.batch_to_block(decoded_columns(held, decode, size=size, labels=labels))  # RAY


class Replica:
    """A model replica in Ray Data's actor pool: a block of decoded crops -> its rows' top-k. It reads
    MODEL itself (a path every node reads, as --data), refused where its weights are not the driver's."""

    def __init__(self, job: Prediction, sha256: str, cfg: TrainConfig):
        trained = load(job)
        if weights_sha256(trained.model) != sha256:
            node = ray.util.get_node_ip_address()  # RAY
            raise StorageError(
                f"{trained.source} on node {node} holds other weights than on the driver: "
                "give MODEL as a path that every node reads the same"
            )
        self.compute = Compute.for_run(cfg, _device())
        self.model = self.compute.model(trained.model).eval()
        self.top_k = job.top_k

    def __call__(self, block: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        with warnings.catch_warnings():  # Arrow's buffers are read-only; nothing here writes to them
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            images = torch.from_numpy(np.ascontiguousarray(block["image"])).permute(0, 3, 1, 2)
        labels, ids = torch.tensor(block["label"]), torch.tensor(block["id"])
        classes, probs = scored(self.model, Batch(images, labels, ids, list(block["key"])), self.compute, self.top_k)
        kept = {k: block[k] for k in ("id", "key", "label", "error")}
        return {**kept, "top_classes": classes.numpy(), "top_probs": probs.numpy()}


def replicas(num_workers: int | None) -> tuple[int, bool]:
    """How many model replicas, and whether each holds a GPU: one a GPU, else --num-workers, else
    half the cluster's CPUs (the other half reads and decodes)."""
    resources = ray.cluster_resources()  # RAY
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    if gpus:
        return min(num_workers or gpus, gpus), True
    count = num_workers or max(1, cpus // 2)
    if count >= cpus:
        raise ConfigError(
            f"--num-workers {count} model replicas leave none of the cluster's {cpus} CPUs to read and decode: "
            f"give --num-workers {max(cpus - 1, 1)} or fewer, or --data-plane loader"
        )
    return count, False


def on_ray_data(job: Prediction, reading: dict[str, Any], setup: Setup, num_workers: int | None) -> Tally:
    """`--data-plane ray`: Ray Data read tasks decode each unit, a pool of model replicas scores the
    blocks, the driver writes each unit's part once it holds all its rows."""
    folder, inputs = setup.folder, setup.inputs
    cfg = setup.cfg.loader().validating
    todo = [u for u in inputs.units if not folder.done(u)]
    kept = len(inputs.units) - len(todo)
    collector = Collector(inputs.units, folder, setup.trained.classes)
    for unit in todo:
        folder.clear_unfinished(unit)
        collector.empty(unit)
    todo = [u for u in todo if u.num_samples]
    if todo:
        count, gpu = replicas(num_workers)
        count = min(count, len(todo))  # a replica a read task at most: more would have nothing to score
        log.info(f"predicting with {count} model replica(s) on {'GPUs' if gpu else 'CPUs'}")
        logging.getLogger("ray.data").setLevel(logging.WARNING)  # each execution's start and stats at INFO
        ctx = ray.data.DataContext.get_current()  # RAY
        ctx.enable_progress_bars, ctx.print_on_execution_start = False, False
        log_once("ray_data_progress_manager_disabled")  # RAY: internal; uses up Ray Data's warning that they are off
        ctx.execution_options.preserve_order = False  # blocks as they finish: the driver gathers by unit
        ds = ray.data.read_datasource(UnitSource(inputs, todo, cfg), override_num_blocks=len(todo))  # RAY
        scored_ds = ds.map_batches(  # RAY
            Replica,
            fn_constructor_args=(job, setup.folder.identity.model_sha256, setup.cfg),
            batch_size=cfg.batch_size,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=count),  # RAY
            num_cpus=0 if gpu else 1,
            num_gpus=1 if gpu else 0,
        )
        firsts = [u.first_id for u in inputs.units]
        blocks = scored_ds.iter_batches(batch_size=None, batch_format="numpy")  # RAY
        for block in cast(Iterator[dict[str, Any]], unwrapped(iter(blocks))):  # a read task's error in its words
            columns = [block[k].tolist() for k in ("id", "key", "label", "top_classes", "top_probs", "error")]
            for sample_id, key, label, top, probs, error in zip(*columns):
                collector.row(unit_of(inputs.units, firsts, sample_id), key, label, top, probs, error or None)
    collector.check_complete(todo)
    return Tally(collector.samples, collector.errors, collector.written, kept)


PLANES: dict[str, Callable[[Prediction, dict[str, Any], Setup, int | None], Tally]] = {
    "loader": on_ranks,
    "ray": on_ray_data,
}
"""Each --data-plane of `raywds predict --ray`."""


def predict_on_ray(
    job: Prediction, reading: Mapping[str, Any], data_plane: str, address: str | None, num_workers: int | None
) -> tuple[Tally, float]:
    """Predict `job` on the cluster at `address` (RAY_ADDRESS, a running `ray start`, else a new local
    one) the `data_plane` way; the job's tally and seconds."""
    if data_plane not in PLANES:
        raise ConfigError(f"--data-plane {data_plane!r} is not one of {', '.join(PLANES)}")
    started = time.perf_counter()
    job, given = job.absolute(), absolute(reading)
    setup = set_up(job, given, World())  # refused here, in one line, before anything starts on the cluster
    cluster.connect(address, training=False)
    tally = PLANES[data_plane](job, given, setup, num_workers)
    return tally, time.perf_counter() - started
