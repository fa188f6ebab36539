"""Where a Ray run keeps its folder (`--storage-path`): a local or shared path, which the driver
holds and every node must see, or an s3:// prefix, where Ray keeps its checkpoints through pyarrow
and rank 0 puts metrics.jsonl, best/ and TensorBoard's files (raywds.runs.bucket).

    storage, local = split_storage("s3://bucket/runs")      # ("s3://bucket/runs", None)
    RunConfig(name=name, **ray_storage(storage, endpoint))
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raywds.data import s3
from raywds.launch.cluster import check_every_node_sees, split_storage
from raywds.runs import files
from raywds.runs.bucket import BucketRunDir
from raywds.runs.checkpoint import load_checkpoint
from raywds.runs.folder import RunDir
from raywds.runs.lock import RunLock
from raywds.train.config import TrainConfig


def open_run_dir(cfg: TrainConfig) -> RunDir | None:
    """Rank 0's run folder: the one the driver made, where this node sees it (local or shared
    storage), or the run's prefix in a bucket; None for storage it cannot write (gs://…). Rank 0
    writes raywds-config.json there when the run starts, after its own checks."""
    if s3.is_s3(cfg.out):
        return BucketRunDir(cfg.out, cfg.s3_endpoint)
    return RunDir(cfg.out, append=True, config=files.RAY_CONFIG) if Path(cfg.out).is_dir() else None


@contextlib.contextmanager
def hold_run_folder(cfg: TrainConfig, local: str | None) -> Iterator[None]:
    """Where the storage is a path (`local`): hold the run's folder while it trains, so a second
    driver with the same --name is refused, and check that every node sees the lock file there.
    The driver writes nothing else there: rank 0 writes raywds-config.json when its run starts
    (raywds.runs.folder.RunDir.start), and a run refused before that, in the driver or in a
    worker, leaves the lock file as it was found (raywds.runs.lock)."""
    if local is None:  # a bucket: nothing here can lock it
        if s3.is_s3(cfg.out):  # a wrong key or bucket is one line now, not a failure in every worker
            s3.check_bucket(cfg.out, cfg.s3_endpoint)
        yield
        return
    with RunLock(cfg.out) as lock:
        check_every_node_sees(str(lock.file), f"--storage-path {local}")
        config = Path(cfg.out) / files.RAY_CONFIG
        before = _stamp(config)
        try:
            yield
        finally:
            if _stamp(config) != before:  # rank 0 wrote it: the run started
                lock.start()


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What changes when `path` is written again (None: no such file)."""
    try:
        found = path.stat()
    except FileNotFoundError:
        return None
    return found.st_ino, found.st_size, found.st_mtime_ns


def ray_storage(storage: str, endpoint: str | None) -> dict[str, Any]:
    """RunConfig's storage: an s3:// URI at a store other than AWS's (--s3-endpoint or
    AWS_ENDPOINT_URL) goes through pyarrow's S3FileSystem pointed at it, with the URI's scheme
    stripped as Ray wants it then; credentials come from the standard chain in each process.

    Its transfers wait s3.READ_TIMEOUT_S for a store that has gone quiet, as raywds's own S3 reads
    do: pyarrow's default (the AWS SDK's 3 s without a byte, curl's low-speed time) failed a
    restarted rank's checkpoint download from a loaded store, after its retries, and with it the
    run."""
    where = s3.endpoint_of(endpoint)
    if not s3.is_s3(storage) or where is None:
        return {"storage_path": storage}
    import pyarrow.fs

    filesystem = pyarrow.fs.S3FileSystem(
        endpoint_override=where, request_timeout=s3.READ_TIMEOUT_S, connect_timeout=s3.CONNECT_TIMEOUT_S
    )
    return {"storage_path": storage[len(s3.SCHEME) :], "storage_filesystem": filesystem}


@contextlib.contextmanager
def checkpoint_folder(checkpoint: Any) -> Iterator[str | None]:
    """The folder of the checkpoint Ray hands a restarted rank (a `ray.train.Checkpoint`, or None):
    its own where this node sees it, else a download into a folder of this rank's own, removed after.

    Ray's `as_directory()` and `to_directory()` share one folder per node between the ranks there,
    and a rank that comes after another's download has finished downloads again over the files the
    other is still reading (Ray 2.60): that rank then reads a damaged checkpoint and the restart
    fails. Here each rank on a node downloads once."""
    import pyarrow.fs

    if checkpoint is None or isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
        yield None if checkpoint is None else checkpoint.path
        return
    with tempfile.TemporaryDirectory(prefix="raywds-restart-") as own:
        yield checkpoint.to_directory(own)


def load_ray_checkpoint(checkpoint: Any) -> dict[str, Any]:
    """The state in the checkpoint Ray hands a restarted rank, read as `checkpoint_folder` says; a
    damaged one downloaded from a bucket is named by its address there, not by the folder it was
    downloaded into."""
    with checkpoint_folder(checkpoint) as where:
        assert where is not None
        if where == checkpoint.path:  # read where it is stored, by its own name
            return load_checkpoint(where)
        source = f"{checkpoint.filesystem.type_name}://{checkpoint.path.rstrip('/')}/{files.CHECKPOINT}"
        return load_checkpoint(
            where, named=source, instead="Ray restarted the run from it: run again under a new --name"
        )


def as_uri(path: str, storage: str) -> str:
    """A path Ray reports inside a bucket's file system (`bucket/runs/NAME/checkpoint_…`) as the
    s3:// address a user can give back to raywds; any other path as it is."""
    return s3.SCHEME + path if s3.is_s3(storage) and not s3.is_s3(path) else path


__all__ = [
    "as_uri",
    "checkpoint_folder",
    "hold_run_folder",
    "load_ray_checkpoint",
    "open_run_dir",
    "ray_storage",
    "split_storage",
]
