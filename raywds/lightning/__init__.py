"""PyTorch Lightning on raywds's shards (the `lightning` extra): `ShardDataModule`."""

from raywds.lightning.datamodule import ShardDataModule

__all__ = ["ShardDataModule"]
