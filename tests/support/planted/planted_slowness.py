"""Slowness the tests plant in the product from outside it: the product reads no test variable.

    slow_forward(0.05)                          # this process: every model raywds builds spins 50 ms a forward pass
    slow_decode(monkeypatch, 0.15)              # this process and its forked loader workers: each crop waits
    netnodes.two_nodes(..., worker_env=environment(0.1))   # every process of a node: a slow node

`environment` puts this folder on PYTHONPATH, where `sitecustomize` (run by every interpreter
as it starts) reads PLANTED_SLOW_FORWARD_S and plants the slow forward pass once raywds's
trainer is imported, so that a node's Ray workers compute slower than the head's (and in every
model raywds.models.trained.load_trained reads: a slow `raywds predict`).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

FORWARD_ENV = "PLANTED_SLOW_FORWARD_S"
TRAINER = "raywds.train.trainer"


def spin(seconds: float) -> None:
    """Keep this CPU busy for `seconds` of its CPU time: work, as a slower processor would do, not
    a sleep (on a busy machine it takes longer, as the rank's other work does)."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _slowed(start: Any, seconds: float) -> Any:
    @functools.wraps(start)
    def start_model(*args: Any, **kwargs: Any) -> Any:
        started = start(*args, **kwargs)
        started.model.register_forward_hook(
            lambda *_: spin(seconds)
        )  # inside the step's forward pass, as a slower device
        return started

    return start_model


def _plant(trainer: Any, seconds: float) -> None:
    trainer.start_model = _slowed(trainer.start_model, seconds)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Plants the slow forward pass (or, given `module` and `plant`, anything) as soon as the
    trainer's module (or `module`) has run."""

    def __init__(self, seconds: float, module: str = TRAINER, plant: Any = None):
        self.seconds, self.module, self.plant = seconds, module, plant or _plant

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            self.plant(module, self.seconds)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def slow_forward(seconds: float) -> None:
    """Every model raywds's trainer builds in this process from now on spins `seconds` of CPU in
    each forward pass."""
    if TRAINER in sys.modules:
        _plant(sys.modules[TRAINER], seconds)
    else:
        sys.meta_path.insert(0, _AfterImport(seconds))


def slow_decode(monkeypatch: Any, seconds: float) -> None:
    """Each training crop of this process's loader (and of the workers it forks) waits `seconds`
    after its work: a decoder whose pace is set by how many run at once, not by free cores."""
    import raywds.loader.loader
    import raywds.loader.stages

    real = raywds.loader.stages.train_decoder

    def train_decoder(*args: Any, **kwargs: Any) -> Any:
        return Waiting(real(*args, **kwargs), seconds)

    monkeypatch.setattr(raywds.loader.stages, "train_decoder", train_decoder)
    monkeypatch.setattr(raywds.loader.loader, "train_decoder", train_decoder)


class Waiting:
    """A decoder that waits `seconds` after each crop; picklable, as the loader's pool sends each
    epoch's pipeline to its workers."""

    def __init__(self, decode: Any, seconds: float):
        self.decode, self.seconds = decode, seconds

    def __call__(self, *a: Any, **k: Any) -> Any:
        try:
            return self.decode(*a, **k)
        finally:
            time.sleep(self.seconds)


CONVERTER = "raywds.data.convert"
SHARD_ENV = "PLANTED_SLOW_SHARD_S"
HOLD_ENV = "PLANTED_SHARD_HOLD_DIR"
HELD_PREFIX = "held"
"""Only shards named HELD_PREFIX-* are held (`--prefix held`): no other test's conversion on a node with HOLD_ENV."""
HOLD_S = 120.0


def _slow_shards(converter: Any, seconds: float) -> None:
    """Each shard this process writes (`write_shard`, which `convert --ray`'s tasks call) takes `seconds` longer."""
    real = converter.write_shard

    @functools.wraps(real)
    def write_shard(job: Any) -> Any:
        time.sleep(seconds)
        return real(job)

    converter.write_shard = write_shard


def _hold_shards(converter: Any, folder: str) -> None:
    """After this process wrote one `held-*` shard, each next one marks `folder`/held-PID-NAME and
    waits HOLD_S before it is written: a task under way when the test kills its node."""
    real, written = converter.write_shard, []

    @functools.wraps(real)
    def write_shard(job: Any) -> Any:
        if job.path.name.startswith(HELD_PREFIX + "-"):
            if written:
                Path(folder, f"held-{os.getpid()}-{job.path.name}").touch()
                time.sleep(HOLD_S)
            written.append(job.path.name)
        return real(job)

    converter.write_shard = write_shard


def _plant_on_import(module: str, seconds: float, plant: Any) -> None:
    if module in sys.modules:
        plant(sys.modules[module], seconds)
    else:
        sys.meta_path.insert(0, _AfterImport(seconds, module, plant))


def environment(seconds: float = 0.0, *, shard_s: float = 0.0, hold_dir: str | None = None) -> dict[str, str]:
    """The environment that makes every raywds process started with it slow its forward passes
    by `seconds`, write each shard of a conversion `shard_s` later, or hold its `held-*` shards
    after the first (`hold_dir`, where it marks each)."""
    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, FORWARD_ENV: str(seconds)}
    if shard_s:
        env[SHARD_ENV] = str(shard_s)
    if hold_dir:
        env[HOLD_ENV] = hold_dir
    return env


TRAINED = "raywds.models.trained"


def _slow_trained(module: Any, seconds: float) -> None:
    """Every model `load_trained` reads (evaluate, predict) spins `seconds` in each forward pass."""
    real = module.load_trained

    @functools.wraps(real)
    def load_trained(*args: Any, **kwargs: Any) -> Any:
        trained = real(*args, **kwargs)
        trained.model.register_forward_hook(lambda *_: spin(seconds))
        return trained

    module.load_trained = load_trained


def from_environment() -> None:
    seconds = float(os.environ.get(FORWARD_ENV) or 0)
    if seconds:
        slow_forward(seconds)
        _plant_on_import(TRAINED, seconds, _slow_trained)
    shard_s = float(os.environ.get(SHARD_ENV) or 0)
    if shard_s:
        _plant_on_import(CONVERTER, shard_s, _slow_shards)
    hold = os.environ.get(HOLD_ENV)
    if hold:
        _plant_on_import(CONVERTER, 0.0, lambda module, _: _hold_shards(module, hold))
