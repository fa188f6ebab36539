"""`--loader-workers auto`: each epoch's loader workers per rank, chosen at its start from the
last epoch's stages (raywds.train.doctor): enough workers to decode what the model takes, with
a margin, within the cores a rank has.

    choice = after(metrics["stages"], cores=8)

    >>> first(cores=8).workers  # one core left for the rank itself
    7

Every rank chooses from the same gathered stages and within the fewest cores any rank has, so
all choose the same count, and split mode's plan, made for that count at the epoch's start,
stays exact.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from raywds.train.config import TrainConfig
from raywds.train.doctor import MARGIN
from raywds.train.ledger import per_rank
from raywds.train.timing import ranks
from raywds.world import World

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    """An epoch's loader workers per rank, and why (rank 0 prints it; the metrics row keeps it)."""

    workers: int
    why: str


def first(cores: int) -> Choice:
    """Before anything is measured: every core a rank has but one, kept for the rank's own work."""
    workers = max(1, cores - 1)
    return Choice(workers, f"to start, {cores} core(s) a rank less one for the rank's own work")


def after(stages: dict[str, Any], cores: int) -> Choice:
    """From the last epoch's stages: enough workers for the slowest worker of any rank to keep
    up with the ranks' pace, between 1 and the rank's cores. Ranks step together, so the pace is
    the slowest rank's own compute (a faster rank's would only let it wait in the all-reduce)."""
    workers = stages["loader_workers"]
    every = ranks(stages)
    timed = [r for r in every if r.loader.samples and r.loader.busy_s > 0]
    if not timed or not workers:
        return Choice(max(workers, 1), "kept: the last epoch's loader was not timed")
    pace = min(r.model_rate for r in every)
    short = min(timed, key=lambda r: r.loader_rate(1))
    each = short.loader_rate(1)  # images/s one of its workers made while it ran
    needed = max(1, math.ceil(MARGIN * pace / each))
    chosen = min(needed, cores)
    why = (
        f"{short.where}'s loader made {each:,.0f} images/s a worker and the model takes {pace:,.0f}/s a rank: "
        f"{needed} worker(s) keep up"
    )
    if chosen < needed:
        why += f"; {cores} core(s) a rank allow {chosen}"
    return Choice(chosen, why)


class Workers:
    """A run's loader workers: `config(index)` is the config epoch `index` trains with, the asked
    one or, under `--loader-workers auto`, with the count chosen; `measured(metrics)` chooses the
    next epoch's from this one's row."""

    def __init__(self, asked: TrainConfig, world: World):
        self.asked, self.world, self.cores = asked, world, world.cores
        self.choice = None
        if asked.loader_workers == "auto":  # every rank's plan needs the same count:
            self.cores = int(min(row[0] for row in per_rank(world, [world.cores])))  # the fewest cores any has
            self.choice = first(self.cores)

    def config(self, index: int) -> TrainConfig:
        if self.choice is None:
            return self.asked
        if self.world.is_main:  # rank 0 says what it chose and why
            log.info(f"epoch {index + 1}: {self.choice.workers} loader worker(s) a rank (auto: {self.choice.why})")
        return dataclasses.replace(self.asked, loader_workers=self.choice.workers)

    def measured(self, metrics: dict[str, Any]) -> None:
        """The epoch's row keeps why its count was chosen; its stages choose the next epoch's."""
        if self.choice is not None:
            metrics["loader_workers_auto"] = self.choice.why
            self.choice = after(metrics["stages"], self.cores)
