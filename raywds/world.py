"""Who this process is in the job: built once (from the environment or from Ray) and passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class World:
    """Rank and size of the job; the default is rank 0 of 1 on the CPU."""

    rank: int = 0
    """This process's global rank."""
    world_size: int = 1
    """Number of ranks (one per GPU, or per CPU worker)."""
    local_rank: int = 0
    """Rank on this node; picks the GPU."""
    ranks_per_node: int = 1
    """Ranks on each node (torchrun's LOCAL_WORLD_SIZE); ranks node x ranks_per_node ... share a node."""
    device: str = "cpu"
    """torch device string for this rank, e.g. `cuda:0`."""
    idle_cpus: float | None = None
    """Under Ray, the cluster's CPUs no task or actor held as this rank started (room for the Ray
    Data plane's decode tasks, which the doctor prescribes); None elsewhere."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must lie in [0, world_size={self.world_size})")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def cores(self) -> int:
        """The cores this rank's process may use, shared with the other ranks on its node."""
        return max(len(os.sched_getaffinity(0)) // max(self.ranks_per_node, 1), 1)

    @classmethod
    def from_env(cls) -> World:
        """The world torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), else rank 0 of 1."""
        import torch

        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            local_rank=local_rank,
            ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            device=device,
        )
