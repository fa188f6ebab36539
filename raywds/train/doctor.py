"""Why is the GPU waiting? The verdict on an epoch's `stages` (raywds.train.timing): the
bottleneck named in one sentence with its numbers, the rank and node it is on, and what to
change, ranked by expected gain.

    raywds doctor runs/demo        # the verdict on a run's last epoch (metrics.jsonl)
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from raywds.loader.decodings import decoding
from raywds.train.timing import Rank, ranks

WAITS = 0.10
"""A rank that waits this share of its steps or less for data is not held back by it."""
SLOWER = 1.2
"""A rank whose own compute per sample is this many times the others' median is a slow GPU or node."""
MARGIN = 1.15
"""Loaders prescribed (workers, the plane's CPUs, `--loader-workers auto`) make this many times
what the model takes: a loader just at the model's rate still leaves it waiting whenever a batch
comes late."""
SLOW_SHARD = 0.25
"""A shard read at this share of its rank's read rate or less is a slow shard."""
SMALL_SHARD = 16e6
"""Shards of fewer bytes on average than this, read slowly, pay their requests' latency more than their bytes."""
MORE_SERVERS = (
    "shards from object storage (s3://) or several servers of the same shards "
    "(--shards-at http://a:8080,http://b:8080): one server's link or disk is full"
)


REGION = "--decode cpu: decodes only the crop's part of each JPEG, at a reduced scale"


def _whole_in_workers(stages: dict[str, Any]) -> bool:
    """The workers decode every JPEG whole (`--decode pil`): `--decode cpu` would not."""
    how = decoding(stages["decode"])
    return how.in_workers and not how.region


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:,.1f} MB"


def diagnose(row: dict[str, Any]) -> list[str]:
    """The verdict on one epoch's metrics row: the bottleneck in a sentence with its numbers (a
    slow rank first, where there is one), then what to change, best first (`1. ...`). Rows
    written before stages were timed get one line."""
    stages = row.get("stages")
    if not stages:
        return [f"epoch {row.get('epoch')}: no step times in this row (written by a raywds that did not time them)"]
    every = ranks(stages)
    found, fixes = _slow_rank(every)
    worst = max(every, key=lambda r: r.waits)
    if worst.waits <= WAITS:
        found.append(
            f"the data is not the bottleneck: no rank waits more than {100 * worst.waits:.0f}% of its steps for "
            f"batches once its loader has started; the model takes "
            f"{statistics.median(r.model_rate for r in every):,.0f} images/s a rank"
        )
    else:
        head = f"{worst.where} waits {100 * worst.waits:.0f}% of each step for data"
        others = [r.waits for r in every if r is not worst]
        if others and statistics.median(others) < worst.waits / 2:
            head += f" (the other ranks {100 * statistics.median(others):.0f}%)"
        read_share = worst.loader.read_s / max(worst.loader.busy_s, 1e-9)
        # Batches made but late count only where the loader makes more than the model takes: a
        # worker whose next decode holds its GIL also holds back the batch it has just made.
        keeps_up = worst.loader_rate(stages["loader_workers"]) >= worst.model_rate
        if not worst.loader.samples:  # batches that carry no clock (plane blocks without times)
            more = f"{head}: its batches come from the Ray Data plane (--data-plane ray), whose tasks were not timed"
            also = ["more CPUs for the plane's tasks (CPU-only nodes join the cluster): see docs/data-plane.md"]
        elif stages.get("data_plane"):
            more, also = _plane(worst, stages, head)
        elif worst.handover_s >= 0.5 * (worst.wait_s - worst.startup_s) and keeps_up:
            more, also = _handover(worst, stages, head)
        elif read_share >= 0.5:
            more, also = _read_bound(every, worst, stages, head)
        else:
            more, also = _decode_bound(worst, stages, head)
        found.append(more)
        fixes += also
    return found + [f"{i}. {fix}" for i, fix in enumerate(fixes, 1)]


def _slow_rank(every: list[Rank]) -> tuple[list[str], list[str]]:
    """A rank slower in its own compute than the others: the others wait for it in the all-reduce."""
    if len(every) < 2:
        return [], []
    slow = max(every, key=lambda r: r.own_s / max(r.samples, 1))
    typical = statistics.median(r.own_s / max(r.samples, 1) for r in every if r is not slow)
    if slow.own_s / max(slow.samples, 1) < SLOWER * typical:
        return [], []
    waiting = statistics.median(r.blocked_s / max(r.seconds, 1e-9) for r in every if r is not slow)
    return (
        [
            f"{slow.where} is {100 * (slow.own_s / max(slow.samples, 1) / max(typical, 1e-9) - 1):.0f}% slower in "
            "compute than the "
            f"others (same data wait), who wait {100 * waiting:.0f}% of each step for it in the all-reduce: "
            "a slow GPU or node, not the data"
        ],
        [f"check or leave out {slow.host} (its GPU's clocks and temperature, other work on it)"],
    )


def _handover(worst: Rank, stages: dict[str, Any], head: str) -> tuple[str, list[str]]:
    """Most of the wait was for batches already made: between the workers and the loop."""
    batches = max(worst.samples / max(stages.get("batch_size", 1), 1) - 1, 1)
    per_batch = worst.handover_s / batches
    return (
        f"{head}, mostly for batches already made ({1e3 * per_batch:.1f} ms a batch in the hand-over from its "
        f"loader workers: the DataLoader's queue and shared memory); its loader makes "
        f"{worst.loader_rate(stages['loader_workers']):,.0f} images/s, the model takes {worst.model_rate:,.0f}/s"
    ), [
        f"larger batches (--batch-size), where the hand-over's {1e3 * per_batch:.1f} ms a batch "
        "grows less than the batch"
    ]


def _read_bound(every: list[Rank], worst: Rank, stages: dict[str, Any], head: str) -> tuple[str, list[str]]:
    spent = worst.loader
    rate = spent.read_bytes / max(spent.read_s, 1e-9)
    if spent.slow_shard and spent.slow_shard_bytes / max(spent.slow_shard_s, 1e-9) <= SLOW_SHARD * rate:
        rest = (spent.read_bytes - spent.slow_shard_bytes) / max(spent.read_s - spent.slow_shard_s, 1e-9)
        return (
            f"{head}: its loader waited {spent.slow_shard_s:.1f} s for shard {spent.slow_shard} "
            f"({_mb(spent.slow_shard_bytes)}, {_mb(spent.slow_shard_bytes / max(spent.slow_shard_s, 1e-9))}/s; "
            f"its other shards {_mb(rest)}/s)",
            ["a slow shard: fetch it by hand to see whether the disk or server behind it is slow; copy it elsewhere"],
        )
    total = sum(r.loader.read_bytes for r in every) / max(statistics.median(r.seconds for r in every), 1e-9)
    line = (
        f"{head}: its loader spends {100 * spent.read_s / max(spent.busy_s, 1e-9):.0f}% of its time reading "
        f"shards, at {_mb(rate)}/s a rank and {_mb(total)}/s in all from {stages['data_from']}"
    )
    fixes = []
    if not stages["cache_dir"]:
        fixes.append("--cache-dir on a local disk: every epoch after the first reads the shards from it")
    fixes.append(MORE_SERVERS)
    if spent.shards and spent.read_bytes / spent.shards < SMALL_SHARD:  # helps where requests, not bytes, cost
        fixes.append(
            f"larger shards (`raywds convert --maxcount`, `--maxsize`) where the link is not full: this rank's "
            f"{spent.shards} shards averaged {_mb(spent.read_bytes / spent.shards)}, each a request's latency more"
        )
    return line, fixes


def _decode_bound(worst: Rank, stages: dict[str, Any], head: str) -> tuple[str, list[str]]:
    workers, cores = stages["loader_workers"], stages["cores_per_rank"]
    made, wanted = worst.loader_rate(workers), worst.model_rate
    spent, busy = worst.loader, max(worst.loader.busy_s, 1e-9)
    resizing = f", {100 * spent.resize_s / busy:.0f}% resizing the crops" if spent.resize_s else ""
    line = (
        f"{head}: its loader decodes {made:,.0f} images/s with {workers} worker(s) "
        f"({100 * (spent.decode_s + spent.collate_s - spent.resize_s) / busy:.0f}% of their time decoding{resizing}), "
        f"the model takes {wanted:,.0f}/s"
    )
    if made >= 1.2 * wanted:
        return line + (
            ": the loader keeps up when it runs, but its workers do not get the CPU they need "
            f"({cores} core(s) a rank, shared with the rank's own work and anything else on the node)"
        ), ["fewer other processes on the node, or --data-plane ray: decode on the cluster's idle CPUs"]
    needed = math.ceil(max(workers, 1) * wanted / max(made, 1e-9) * MARGIN)
    fixes = []  # the measured gain first; those that depend on the GPU or the cluster after
    usable = min(needed, cores)
    if usable > workers:
        gain = min(wanted, made * usable / max(workers, 1)) / made
        enough = "" if usable == needed else f", as many as its {cores} cores allow ({needed} would keep up)"
        fixes.append(f"--loader-workers {usable}{enough}: about {gain:.1f}x the images/s")
    if stages["device"] == "cuda" and decoding(stages["decode"]).in_workers:
        fixes.append("--decode device: the GPU decodes the JPEGs, the workers only read them")
    if needed > cores:
        idle = stages.get("idle_cpus")  # under Ray: the cluster's CPUs free as the run started
        room = "`ray status` lists them" if idle is None else f"{idle:g} were idle as the run started"
        fixes.append(f"--data-plane ray: decode on the cluster's idle CPUs too ({room}; CPU-only nodes may join)")
    if _whole_in_workers(stages):
        fixes.append(REGION)
    return line, fixes


def _plane(worst: Rank, stages: dict[str, Any], head: str) -> tuple[str, list[str]]:
    """The rank's batches come from the Ray Data plane's read and decode tasks, on any node."""
    spent = worst.loader
    each = worst.loader_rate(1)  # images/s while a task read and decoded them
    needed = math.ceil(MARGIN * worst.model_rate / max(each, 1e-9))
    line = (
        f"{head}: its batches come from the Ray Data plane, whose tasks made {each:,.0f} images/s a CPU "
        f"({100 * spent.read_s / max(spent.busy_s, 1e-9):.0f}% of their time reading shards, at "
        f"{_mb(spent.read_bytes / max(spent.read_s, 1e-9))}/s), the model takes {worst.model_rate:,.0f}/s: "
        f"about {needed} CPUs busy for this rank alone would keep up"
    )
    fixes = [f"more CPUs for the plane's tasks, about {needed} a rank: CPU-only nodes join the cluster (`ray status`)"]
    if spent.read_s >= 0.5 * spent.busy_s:
        fixes.append(MORE_SERVERS)
    if _whole_in_workers(stages):
        fixes.append(REGION)
    return line, fixes
