"""How often Ray Train's controller polls its workers in a `raywds ray` run.

    with cluster.environ(controller_polls(plan.num_workers)):   # a user's own setting wins
        result = trainer.fit()

Imports no Ray: Ray Train reads the variable in the driver as `fit()` starts its controller, and
hands it on (docs/ray.md, What a run starts).
"""

from __future__ import annotations

POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
POLL_S = 0.5
"""How often Ray Train's controller polls the workers, where raywds sets it (Ray's default: 2 s).
The poll is also how a worker's `ray.train.report` reaches the controller: each worker holds one
report at a time and waits for the next poll to take it, and the controller sees the training
function end only at a poll. On a long-lived cluster a 2-epoch demo run spent 5.9 s after its last
step (validation, checkpoint, shutdown) at 2 s, 3.5 s at 0.5 s (benchmarks/ray_cost.py). A poll
that is late is waited for at the next one, silently; a worker is taken for dead only after Ray's
10 minutes of hanging polls, whatever the interval."""
MAX_POLLED_WORKERS = 64
"""Above this many workers raywds leaves Ray's 2 s: each poll is a call to every worker."""


def controller_polls(num_workers: int) -> dict[str, str]:
    """The controller's poll interval for a run of `num_workers`, as the environment Ray Train
    hands its controller (a user's own RAY_TRAIN_HEALTH_CHECK_INTERVAL_S wins: `cluster.environ`)."""
    return {POLL_ENV: str(POLL_S)} if num_workers <= MAX_POLLED_WORKERS else {}
