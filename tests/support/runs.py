"""The tests' runs: the config they share, what gloo ranks' fork server imports, a made-up
epoch row's stage times for the doctor, TensorBoard's charts against metrics.jsonl, the region
decoder's presence, and the CPU other processes used meanwhile (`OthersCpu`)."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import time
from pathlib import Path

import pytest

from raywds.runs.rows import kind
from raywds.train.config import TrainConfig

SUMMARY = re.compile(r"^epochs (\d+)  top-1 ([\d.]+)  top-5 ([\d.]+)  samples seen (\d+)  images/s ([\d.]+)$", re.M)
"""The summary line a run prints at its end (raywds.train.progress.summary_line): epochs, top-1,
top-5, samples seen, images/s."""


def command(line: list[str], *, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    """`line` run to its end as a user runs it (one torch thread a process, `env` added), its
    output captured as text."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(line, capture_output=True, text=True, timeout=timeout, env=environment)


def small_config(data: str | Path, **overrides: object) -> TrainConfig:
    """The config the tests share: the demo model on small crops, one loader worker, adamw at a
    fixed rate without warm-up; each test overrides what it is about."""
    values: dict = dict(
        data=str(data),
        model="demo",
        optimizer="adamw",
        lr=3e-3,
        batch_size=16,
        image_size=28,
        crop_scale_min=0.5,
        loader_workers=1,
        epochs=4,
        warmup_epochs=0.0,
    )
    values.update(overrides)
    return TrainConfig(**values)


def need_jpeg_extension() -> None:
    """Skip where raywds.loader._jpeg or raywds.data._restarts was not built, except under
    RAYWDS_REQUIRE_JPEG_EXT (set by .ci/run): there their absence is a failure."""
    from raywds.data import convert as images
    from raywds.loader import crops

    for name, module in (("raywds.loader._jpeg", crops._jpeg), ("raywds.data._restarts", images._restarts)):
        if module is None:
            if os.environ.get("RAYWDS_REQUIRE_JPEG_EXT"):
                pytest.fail(f"{name} was not built (a C compiler and libjpeg's headers are needed)")
            pytest.skip(f"{name} was not built", allow_module_level=True)


FORKSERVER_PRELOAD = ["torch", "torch.distributed", "raywds.train.trainer", "raywds.loader.loader"]
"""What the fork server that starts the tests' gloo ranks and simulated ranks' loader workers imports once."""


def made_stages(*ranks: tuple[float, float, float], workers: int = 1, handover: float = 0.0) -> dict:
    """An epoch row's `stages` (raywds.train.doctor) of ranks given as (loader images/s a worker,
    model images/s, samples), each waiting as long as it computes, `handover` of that wait for
    batches already made."""
    out: dict = {key: [] for key in ("seconds", "samples", "wait_s", "handover_s", "startup_s", "copy_s")}
    out.update({key: [] for key in ("forward_s", "backward_s", "own_s", "read_s", "decode_s", "collate_s")})
    out.update(read_bytes=[], decoded=[], resize_s=[], shards=[], host=[], slow_shard=[])
    for each, model, samples in ranks:
        compute = samples / model
        for key, value in dict(
            seconds=2 * compute, samples=samples, wait_s=compute, handover_s=handover * compute
        ).items():
            out[key].append(value)
        for key, value in dict(startup_s=0.0, copy_s=0.0, forward_s=compute / 2, backward_s=compute / 2).items():
            out[key].append(value)
        for key, value in dict(own_s=compute, read_s=0.0, decode_s=samples / each, collate_s=0.0).items():
            out[key].append(value)
        out["read_bytes"].append(1e6)
        out["decoded"].append(samples)
        out["resize_s"].append(0.0)
        out["shards"].append(1)
        out["host"].append("node")
        out["slow_shard"].append(["", 0.0, 0])
    settings = {"loader_workers": workers, "batch_size": 8, "cores_per_rank": 8, "decode": "cpu", "device": "cpu"}
    return {**out, **settings, "cache_dir": False, "data_from": "shards/"}


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TensorBoard event files in `folder`, as TensorBoard's own reader
    loads them: tag -> [(step, value)] in the order written (values are float32 there)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep all, no sampling
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def assert_charts_hold(folder: Path, rows: list[dict], num_ranks: int) -> None:
    """The event files in `folder` hold the numbers of these metrics.jsonl rows, and no others:
    each epoch row's at its epoch (validation only where it ran), its per-rank lists one chart
    per rank (where each rank's epoch went too), each progress row's at its global step."""
    from raywds.runs.stagetimes import shares

    epochs = [r for r in rows if kind(r) == "epoch"]
    progress = [r for r in rows if kind(r) == "progress"]
    keys = ("train_loss", "val_loss", "val_top1", "val_top5", "lr", "images_per_s", "data_wait_max")
    expected = {f"epoch/{key}": [(r["epoch"], r[key]) for r in epochs if key in r] for key in keys}
    for key in ("images_per_s_per_rank", "data_wait_per_rank"):
        for rank in range(num_ranks):
            expected[f"epoch/{key}/rank{rank}"] = [(r["epoch"], r[key][rank]) for r in epochs]
    for key in ("loss", "lr", "images_per_s_rank0", "data_wait_rank0"):
        expected[f"progress/{key}"] = [(r["step"], r[key]) for r in progress]
    for part in ("data_wait", "copy", "compute", "waiting_for_other_ranks", "other"):
        for rank in range(num_ranks):
            expected[f"epoch/step_time/{part}/rank{rank}"] = [
                (r["epoch"], shares(r["stages"])[part.replace("_", " ")][rank]) for r in epochs
            ]
    charts = tensorboard_scalars(folder)
    assert sorted(charts) == sorted(expected)
    for tag, points in expected.items():  # event files hold float32
        assert charts[tag] == [(step, pytest.approx(value, rel=1e-6)) for step, value in points], tag


class OthersCpu:
    """The CPU that processes other than this one and its children used while a block ran, in
    cores (CPU seconds a second of wall time): the machine's busy time in /proc/stat less this
    process's and its reaped children's (getrusage), over the block's wall time."""

    def __enter__(self) -> OthersCpu:
        self.cores = 0.0
        self._start = (_machine_busy_s(), own_cpu_s(), time.monotonic())
        return self

    def __exit__(self, *exc: object) -> None:
        busy, own, start = self._start
        wall = max(time.monotonic() - start, 1e-9)
        self.cores = max(0.0, (_machine_busy_s() - busy) - (own_cpu_s() - own)) / wall


def _machine_busy_s() -> float:
    """CPU seconds all processes have used since boot: user, nice, system, irq and softirq (guest
    time is in user already; idle, iowait and steal are not work here)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """User + system CPU seconds of this process (all its threads) and of its waited-for children
    (loader workers, curl)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime
