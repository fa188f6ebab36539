"""What `raywds ray` takes besides the training config, with the one default of each: the CLI's
flags are made from RayOptions (raywds.cli.flags), and raywds.launch.ray_train.run takes the same
object (DEFAULTS unless given). Imports no Ray, so `raywds --help` does not load it.

    ray_train.run(cfg, RayOptions(storage_path="runs/ray", name="first", max_failures=0))
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass, field
from typing import Literal

from raywds.fields import ADDRESS, NAME, PLACE, flag
from raywds.train.config import MAX_SECONDS

DataPlane = Literal["loader", "ray"]
PlaneExecutor = Literal["rank", "feeder"]
DATA_PLANES: tuple[str, ...] = typing.get_args(DataPlane)


def worker_count(text: str) -> int | tuple[int, int]:
    """`--num-workers`: N, or MIN..MAX for an elastic run (each number's range is the field's)."""
    try:
        if ".." in text:
            low, high = (int(part) for part in text.split("..", 1))
            if low > high:
                raise argparse.ArgumentTypeError(f"{text!r}: MIN..MAX gives the smaller first")
            return (low, high)
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither N nor MIN..MAX") from None


def resource(text: str) -> tuple[str, float]:
    """`--worker-resource`: NAME=AMOUNT (the amount's range is the field's)."""
    name, _, amount = text.partition("=")
    try:
        if not name:
            raise ValueError
        return name, float(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=AMOUNT") from None


@dataclass(frozen=True, kw_only=True)
class RayOptions:
    """How a run uses the Ray cluster. `serve` is the command's: it serves the data before
    raywds.launch.ray_train.run, which reads the rest (it joins the cluster in `address`)."""

    serve: bool = False
    """Serve the --data folder from this driver, so workers on every node read it over HTTP."""
    num_workers: int | tuple[int, int] | None = field(
        default=None, metadata=flag(parse=worker_count, metavar="N|MIN..MAX", minimum=1, maximum=100_000)
    )
    """Ray Train workers (default: one per cluster GPU, else 2 CPU workers); MIN..MAX is elastic:
    start with what the cluster holds, shrink when a node is lost, grow when nodes come."""
    address: str | None = field(default=None, metadata=flag(form=ADDRESS))
    """Ray cluster address (default: RAY_ADDRESS, a running `ray start`, else a new local cluster)."""
    storage_path: str = field(default="runs/ray", metadata=flag(form=PLACE))
    """Ray Train storage for checkpoints and results: a folder, a folder every node shares, or s3://…"""
    max_failures: int = field(default=3, metadata=flag(minimum=0, maximum=10_000))
    """Restarts after a worker or its node is lost, each resuming from the latest checkpoint; as
    many waits for a fixed worker count to fit again."""
    node_wait_s: float | None = field(default=None, metadata=flag(above=0, maximum=MAX_SECONDS))
    """After a failure, how long Ray waits for the workers to fit on the cluster before that
    restart counts as failed too (default: Ray's, 60)."""
    resize_check_s: float = field(default=60.0, metadata=flag(above=0, maximum=MAX_SECONDS))
    """Elastic runs: how often Ray checks whether more workers fit."""
    keep_checkpoints: int | None = field(default=2, metadata=flag(minimum=1, maximum=10**6))
    """Checkpoints kept in the run folder (None: every one)."""
    data_plane: DataPlane = "loader"
    """Who reads and decodes the shards: each rank's own DataLoader workers (loader), or Ray Data
    tasks on any node of the cluster (ray; --loader-workers then has no effect)."""
    plane_store_mb: int = field(default=1024, metadata=flag(minimum=1, maximum=2**24))
    """--data-plane ray: object store memory each rank's pipeline may fill with blocks."""
    plane_executor: PlaneExecutor = "rank"
    """--data-plane ray: where each rank's Ray Data executor runs: in the rank's process (rank),
    or in a feeder actor of the rank's on its node, which hands it its blocks (feeder)."""
    worker_resource: list[tuple[str, float]] | None = field(
        default=None, metadata=flag(parse=resource, append=True, metavar="NAME=AMOUNT", above=0, maximum=10**6)
    )
    """A custom Ray resource each training worker reserves, so the workers run only on nodes that
    have it (`ray start --resources '{"trainer": 8}'`); repeatable."""
    async_validation: bool = False
    """Validate each epoch's checkpoint in a Ray task of its own while training goes on (Ray
    Train's ValidationConfig), not on the ranks between epochs: the numbers land in the same epoch
    rows, tracking runs and best/ (raywds.launch.ray_validation)."""
    name: str | None = field(default=None, metadata=flag(form=NAME))
    """Ray Train run name (default raywds-DATE-TIME; reusing a name resumes that run)."""


DEFAULTS = RayOptions()
