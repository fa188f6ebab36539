"""Shared-memory blocks that carry batches from DataLoader workers, reused once the training
process has let go of them.

A worker hands a batch to the training process in shared memory. A fresh block for every
batch means a new shared-memory file whose pages fault in as the batch is written, about
5 ms for a 64 x 224 px batch; reusing blocks made one worker 1.08x and 1.13x faster in two
runs (benchmarks/loader_bench.py, README "Loader speed"). A block may only be written again once
nothing in the training process refers to it, views of it included (a batch split into
samples for the cross-worker shuffle keeps it alive, sample by sample). So:

- the worker takes a block whose flag in `busy` (a small array in shared memory, made before
  the workers start) is clear, sets the flag, and hands the batch over with its lease
  (worker, slot); with every block busy it gets none, and stacks the batch into a fresh
  block (raywds.loader.crops.stack_crops), which is not reused;
- the training process keeps a weak reference to the storage each leased batch arrived in
  (torch's StorageWeakRef, which outlives every tensor and view of it) and clears the flag
  once the reference has expired, checked at each batch it receives.

    blocks = Blocks(num_workers)
    pipeline = ..., wds.batched(n, collation_fn=bind(collate, out_of=blocks.take)), blocks.leased
    # the training process, each batch it receives from a worker (raywds.loader.pool):
    blocks.release(); blocks.watch(lease, batch.images)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.data import get_worker_info

SLOTS = 8
"""Blocks per worker: the batches in flight (DataLoader's prefetch of 2, the one being made,
the one arriving) and the one the training loop holds, with room to spare."""

Lease = tuple[int, int]
"""(worker, slot) of a reused block."""


class Blocks:
    def __init__(self, num_workers: int, slots: int = SLOTS):
        self.busy = torch.zeros((max(1, num_workers), slots), dtype=torch.uint8).share_memory_()
        self._blocks: list[torch.Tensor | None] = [None] * slots
        """Worker side: this worker's blocks, flat uint8 in shared memory, made on first need."""
        self._watched: dict[Lease, StorageWeakRef] = {}
        """Training side: each busy block's storage as it arrived here."""

    def __getstate__(self) -> dict[str, Any]:
        """Workers started by spawn get the flags only (no blocks yet, nothing watched)."""
        return {"busy": self.busy}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.busy = state["busy"]
        self._blocks = [None] * self.busy.shape[1]
        self._watched = {}

    def take(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Worker side: uint8 of `shape` in a free block of this worker's (grown when too
        small); None when every block is busy."""
        info = get_worker_info()
        if info is None:
            return None
        nbytes = math.prod(shape)
        row = self.busy[info.id]
        for slot in (row == 0).nonzero().flatten().tolist():
            block = self._blocks[slot]
            if block is None or block.numel() < nbytes:
                block = self._blocks[slot] = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
            row[slot] = 1
            return block[:nbytes].view(shape)
        return None

    def lease(self, images: Any) -> Lease | None:
        """Worker side: the (worker, slot) whose block `images` lies in, if it is one of ours."""
        info = get_worker_info()
        if info is None or not isinstance(images, torch.Tensor):
            return None
        ptr = images.untyped_storage().data_ptr()
        for slot, block in enumerate(self._blocks):
            if block is not None and block.untyped_storage().data_ptr() == ptr:
                return info.id, slot
        return None

    def leased(self, batches: Iterable[Any]) -> Iterator[tuple[Any, Lease | None]]:
        """Worker side, the pipeline's last stage: each batch with its lease."""
        for batch in batches:
            yield batch, self.lease(batch.images)

    def watch(self, lease: Lease, images: torch.Tensor) -> None:
        """Training side: `images` arrived in the block `lease`; it is busy until their storage dies."""
        worker, slot = lease  # a list after DataLoader's pin_memory
        self._watched[worker, slot] = StorageWeakRef(images.untyped_storage())

    def forget_unwatched(self) -> None:
        """Training side, between passes of idle workers: free the blocks leased for batches
        that never arrived (torch drops what a worker made for a pass that was not finished)."""
        for worker, slot in (self.busy != 0).nonzero().tolist():
            if (worker, slot) not in self._watched:
                self.busy[worker, slot] = 0

    def release(self) -> None:
        """Training side: free the blocks nothing here refers to any more."""
        for lease, ref in list(self._watched.items()):
            if ref.expired():
                del self._watched[lease]
                self.busy[lease] = 0


class Slots:
    """Worker side: where each decoded image (`shape`: C, H, W) goes, in the order the batches
    take them: slot after slot of a block `take` gives (a fresh shared one when every block is
    busy), a new block once `batch_size` slots are filled. The `cpu` decoder resizes straight into
    its slot (raywds.loader.crops.cropped): the batch is then the block, not a stack of copies
    made 64 samples later, when the crops have left the CPU's caches (collating took 73-100 us a
    sample by the loader's clock, 6-7 us now; copying a hot 224 px crop takes 13-30 us)."""

    def __init__(self, batch_size: int, shape: tuple[int, int, int], take: Callable[[tuple[int, ...]], Any]):
        c, h, w = shape
        self.shape, self.take = (batch_size, h, w, c), take
        self.block: torch.Tensor | None = None
        self.used = 0

    def next(self) -> torch.Tensor | None:
        """The next free slot, channels-last CHW; None outside a loader worker (nothing to hand over)."""
        if get_worker_info() is None:
            return None
        if self.block is None or self.used == self.shape[0]:
            self.block = self.take(self.shape)
            if self.block is None:
                self.block = torch.empty(self.shape, dtype=torch.uint8).share_memory_()
            self.used = 0
        return self.block[self.used].permute(2, 0, 1)

    def filled(self) -> None:
        """The slot `next` gave holds an image now (one that failed to decode leaves it free)."""
        self.used += 1
