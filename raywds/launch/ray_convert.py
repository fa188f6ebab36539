"""`raywds convert SRC OUT --ray`: the conversion of raywds.data.convert, its shards written by Ray
tasks on every node of a cluster. Each Ray touchpoint is marked `# RAY`.

    conversion = Tasks()                      # after cluster.connect(address)
    manifest = convert(src, out, options, run=conversion)
    conversion.nodes                          # {node IP: shards it wrote}

The plan (which sample goes to which shard) is made once, on the driver, from the listing, as
the local converter makes it; a task only reads its shard's images, checks them, adds restart
markers and writes the shard (`write_shard`, the same function the local processes run), so
the shards are the same bytes. A task whose worker or node dies is run again by Ray (up to
MAX_RETRIES times), writing under a temporary name of its own; the driver journals each shard
as its task returns, so a driver stopped and run again keeps every shard whose size and sha256
still match, and the manifest is written last, by the driver.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from raywds.data import append as appending
from raywds.data import convert as converting
from raywds.data import listed, stores, upload
from raywds.data.convert import ShardJob
from raywds.data.manifest import MANIFEST
from raywds.data.shardoptions import ConvertOptions
from raywds.data.stores import Storage
from raywds.errors import DataError, RaywdsError
from raywds.launch import cluster

MAX_RETRIES = 3
"""Times Ray runs a shard's task again after its worker process or node died (a lost node, the
OOM killer); an exception the task raises itself (an unreadable image under --strict) is final."""

IN_FLIGHT_PER_CPU = 2
"""Tasks submitted ahead per CPU of the cluster: each holds its shard's list of files, and the
driver keeps the rest, so a conversion of millions of images never puts them all in Ray's store."""


def _write(job: ShardJob, bucket: str | None, storage: Storage) -> dict[str, Any]:
    """One shard, on whichever node Ray chose, into the folder or under the `bucket` prefix; the
    record says which node."""
    record = converting.write_shard(job) if bucket is None else upload.write_to_bucket(job, bucket, storage)
    return {**record, "node": ray.util.get_node_ip_address()}  # RAY


class Tasks:
    """A Runner (raywds.data.convert) of Ray tasks, one a shard, each taking a CPU, spread over
    the nodes, writing into the jobs' folder or under a `bucket` prefix; `nodes` counts the shards
    each node wrote (not those kept from an earlier run)."""

    def __init__(self, in_flight: int | None = None, *, bucket: str | None = None, storage: Storage = Storage()):
        self.bucket, self.storage = bucket, storage
        cpus = int(ray.cluster_resources().get("CPU", 1))  # RAY
        self.in_flight = in_flight or max(2, IN_FLIGHT_PER_CPU * cpus)
        self.nodes: Counter[str] = Counter()
        self._remote = ray.remote(_write).options(  # RAY
            num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False, scheduling_strategy="SPREAD"
        )

    def __call__(self, jobs: list[ShardJob]) -> Iterator[tuple[ShardJob, dict[str, Any]]]:
        waiting = list(reversed(jobs))
        pending: dict[Any, ShardJob] = {}
        try:
            while waiting or pending:
                while waiting and len(pending) < self.in_flight:
                    job = waiting.pop()
                    pending[self._remote.remote(job, self.bucket, self.storage)] = job  # RAY
                [ref], _ = ray.wait(list(pending), num_returns=1)  # RAY
                job = pending.pop(ref)
                record = _result(ref, job)
                if not record["kept"]:
                    self.nodes[record["node"]] += 1
                yield job, record
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM (raywds.cli): the tasks under way end with the driver's job
            raise  # not cancelled: a task's reply that crosses its cancel crashes Ray's core worker (Check failed)
        except BaseException:
            for ref in pending:  # after an error: write no more shards than are under way
                ray.cancel(ref)  # RAY
            raise


def _result(ref: Any, job: ShardJob) -> dict[str, Any]:
    """The task's record; its own error (a raywds one) as it is, Ray's in one line."""
    try:
        return ray.get(ref)  # type: ignore[no-any-return]  # RAY
    except ray.exceptions.RayTaskError as e:  # RAY: the task raised
        if isinstance(e.cause, RaywdsError):
            raise e.cause from None
        raise DataError(f"writing {job.path.name} failed on the cluster: {str(e.cause)[:500]}") from None
    except ray.exceptions.RayError as e:  # RAY: its worker or node died more often than it was retried
        raise DataError(
            f"the task writing {job.path.name} was lost {MAX_RETRIES + 1} times ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:300]}); run the same command again: it keeps every shard written so far"
        ) from None


def convert_on_ray(
    src: str,
    out: str,
    options: ConvertOptions,
    address: str | None,
    *,
    append: bool = False,
    storage: Storage = Storage(),
    staging: Path | None = None,
) -> dict[str, Any]:
    """Convert the tree at `src` (a folder every node sees, or an s3:// or gs:// prefix) into `out`
    (a folder every node sees, or a prefix), or with `append` add its images to the dataset there,
    with Ray tasks on the cluster at `address` (RAY_ADDRESS, a running `ray start`, else a local
    one). Into a bucket, the driver journals in `staging` (a folder of its own by default) and
    puts the manifest last. Returns the manifest, with `written_on` (node IP -> shards written)."""
    tree = listed.tree_at(src, storage)
    bucket = out if stores.is_url(out) else None
    if bucket is not None and append:
        raise DataError(
            f"--append with --ray adds to a dataset in a folder every node sees, not in a bucket ({out}) yet: "
            "append into a shared folder, then upload it"
        )
    folder = (staging or upload.staging_folder(out)) if bucket is not None else Path(out)
    converting.check_outside(tree, folder)
    cluster.connect(address, training=False)  # signals as before it: one line, 130 or 143
    folder.mkdir(parents=True, exist_ok=True)
    # The tasks read SRC and (but into a bucket) write OUT on every node; a missing SRC is the converter's line.
    seen = [(tree, "SRC")] if isinstance(tree, Path) and tree.exists() else []
    for path, what in [*seen, *([(folder, "OUT")] if bucket is None else [])]:
        cluster.check_every_node_sees(os.path.abspath(path), what)
    if bucket is not None:
        storage.at(bucket).delete(stores.join(bucket, MANIFEST))  # no manifest while shards there may change
    tasks = Tasks(bucket=bucket, storage=storage)
    try:
        manifest = (appending.append if append else converting.convert)(tree, folder, options, run=tasks)
    except KeyboardInterrupt as e:
        e.add_note("run the same command again: it keeps every shard written so far")
        raise
    if bucket is not None:
        upload.publish(folder, bucket, storage)
    manifest["written_on"] = dict(sorted(tasks.nodes.items()))
    return manifest
