"""One rank's epoch: the training loop (with Join for uneven ranks) and exact validation."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from raywds.errors import CollectiveError
from raywds.loader.clock import Spent
from raywds.loader.stages import BadSample, Batch
from raywds.models.finetune import Freeze
from raywds.train.compute import Compute
from raywds.train.optim import set_lr
from raywds.train.timing import StepTimer
from raywds.world import World


@dataclass
class EpochResult:
    """This rank's counts, updated as the epoch runs (after_step sees them) and returned at its end."""

    num_samples: int = 0
    loss_sum: float = 0.0
    seconds: float = 0.0
    num_steps: int = 0
    stopped: bool = False
    """True when `after_step` asked to stop before the epoch's end."""
    data_wait_s: float = 0.0
    """Time the loop spent waiting for the loader."""
    handover_s: float = 0.0
    """Of it, the waits for batches already made: in the DataLoader's queue, shared memory, the
    pin-memory thread (the clock's `ready_at` to the batch's arrival)."""
    startup_s: float = 0.0
    """Of it, what the first batch waited beyond its worker's reading and decoding: the loader's
    workers starting (a slow first shard still counts as waiting for data)."""
    bad_samples: list[BadSample] = field(default_factory=list)
    """resample mode: each skipped sample and why (the loader workers' words), once per draw:
    shards repeat within a resample epoch, and a bad sample with them."""
    distinct_bad: dict[tuple[str, str], BadSample] = field(default_factory=dict)
    """resample mode: each distinct bad sample, (shard, key) -> its latest draw."""
    num_bad_shards: int = 0
    """resample mode: shards skipped as unreadable."""
    num_read_retries: int = 0
    """Shard reads retried after a transient failure (a throttled store, a dropped connection)."""
    copy_s: float = 0.0
    """Time putting each batch on the device (and, with `--decode device`, decoding it there)."""
    forward_s: float = 0.0
    """Time in the model's forward pass and loss: this rank's own compute, no collective."""
    backward_s: float = 0.0
    """Time in backward and the optimizer step, gradient all-reduce included: a rank that waits
    there for a slower one spends more here than that rank does (raywds.train.doctor)."""
    own_s: float = 0.0
    """The forward and backward passes' own compute, waits for other ranks left out (CPU seconds
    on a CPU, device time on a GPU: raywds.train.timing): compared across ranks only."""
    loader: Spent = Spent()
    """What the rank's loader workers spent making the batches it trained on (raywds.loader.clock)."""
    image_px: int = 0
    """The side of the images the model was given (the last batch's)."""

    def waited(self, seconds: float, batch: Batch | None) -> None:
        self.data_wait_s += seconds
        if self.num_steps and batch is not None and batch.spent is not None and batch.spent.ready_at:
            self.handover_s += min(max(time.time() - batch.spent.ready_at, 0.0), seconds)
        if not self.num_steps and batch is not None:  # the first: less the batch's own making
            self.startup_s = max(seconds - (batch.spent.busy_s if batch.spent else 0.0), 0.0)

    def add(self, batch: Batch, loss: float) -> None:
        """Count a step on `batch`, whose mean loss was `loss`."""
        self.num_steps += 1
        self.num_samples += len(batch.labels)
        self.bad_samples += batch.bad_samples
        self.distinct_bad.update(((b.shard, b.key), b) for b in batch.bad_samples)
        self.num_bad_shards += len(batch.bad_shards)
        self.num_read_retries += batch.read_retries
        self.loss_sum += loss * len(batch.labels)
        if batch.spent is not None:
            self.loader = self.loader.plus(batch.spent)

    def add_times(self, between: list[float], own_s: float) -> None:
        """A step's copy, forward and backward seconds, and its own compute."""
        copy_s, forward_s, backward_s = between
        self.copy_s += copy_s
        self.forward_s += forward_s
        self.backward_s += backward_s
        self.own_s += own_s


def _is_collective_failure(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(
        w in text for w in ("timed out", "timeout", "gloo", "nccl", "connection closed", "connection reset")
    )


@contextlib.contextmanager
def _iterating(batches: Iterable[Batch]) -> Iterator[Iterator[Batch]]:
    """An iterator over `batches`, closed on the way out, errors included: its loader stops its
    workers then, not whenever the garbage collector gets to it."""
    it = iter(batches)
    try:
        yield it
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def train_epoch(
    model: nn.Module,
    batches: Iterable[Batch],
    optimizer: torch.optim.Optimizer,
    lr: Callable[[int], float],
    world: World,
    compute: Compute,
    *,
    uneven: bool,
    label_smoothing: float = 0.0,
    after_step: Callable[[int, Batch, EpochResult], bool] | None = None,
    where: str = "",
    pg_timeout: float | None = None,
    accumulate: int = 1,
    mix: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    freeze: Freeze | None = None,
) -> EpochResult:
    """One pass; `lr(batches done)` sets the rate before each optimizer step, and `after_step(batches
    done, batch, counts so far)` runs after each batch and may stop the epoch by returning True.
    With `uneven` (split mode) Join lets ranks that run out early shadow the collectives of the
    rest. `accumulate`: batches an optimizer step adds the gradients of (--global-batch), each
    but a step's last under DDP's no_sync; a rank's last, short step averages what it has.
    `mix(images, labels, ids)` (--mixup-alpha, --cutmix-alpha: raywds.train.mixup) mixes each batch
    on the device into soft targets. `freeze` (--freeze-epochs) trains only the classifier."""
    model.train()
    if freeze is not None:
        freeze.hold()
    loss_fn = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
    r = EpochResult()
    start = time.perf_counter()
    joinable = uneven and isinstance(model, DistributedDataParallel)
    timer = StepTimer(world.device)
    total = len(batches) if isinstance(batches, Sized) else None
    try:
        with Join([model]) if joinable else contextlib.nullcontext(), _iterating(batches) as it:  # type: ignore[list-item]
            while True:
                asked = time.perf_counter()
                batch = next(it, None)
                r.waited(time.perf_counter() - asked, batch)  # time the step waited for the loader
                if batch is None:
                    break
                _one_batch(model, batch, optimizer, lr, compute, loss_fn, timer, r, accumulate, total, mix, freeze)
                r.seconds = time.perf_counter() - start
                if after_step is not None and after_step(r.num_steps, batch, r):
                    r.stopped = True
                    break
    except RuntimeError as e:
        if world.distributed and _is_collective_failure(e):
            raise CollectiveError(
                f"rank {world.rank} of {world.world_size}: a collective failed {where} step {r.num_steps + 1} "
                f"after {time.perf_counter() - start:.0f} s (process-group timeout {pg_timeout} s): another rank "
                f"stalled or died, see its log. {str(e).splitlines()[0][:300]}"
            ) from e
        raise
    r.seconds = time.perf_counter() - start
    return r


def _one_batch(
    model: nn.Module,
    batch: Batch,
    optimizer: torch.optim.Optimizer,
    lr: Callable[[int], float],
    compute: Compute,
    loss_fn: nn.Module,
    timer: StepTimer,
    r: EpochResult,
    accumulate: int,
    total: int | None,
    mix: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    freeze: Freeze | None = None,
) -> None:
    """Forward and backward of one batch into the optimizer step it is part of; the step is taken
    at its last batch, the others under DDP's no_sync."""
    first, in_step = r.num_steps % accumulate == 0, _in_step(r.num_steps, accumulate, total)
    last = (r.num_steps + 1) % accumulate == 0 or r.num_steps + 1 == total
    if first:  # the rate at the step's end, on the clock of samples: as one batch of them would
        set_lr(optimizer, lr(r.num_steps + in_step - 1))
        optimizer.zero_grad(set_to_none=True)
    marks = [timer.mark()]
    images, labels = compute.inputs(batch.images, batch.labels)
    images, targets = mix(images, labels, batch.ids) if mix is not None else (images, labels)
    r.image_px = images.shape[-1]
    marks.append(timer.mark())
    with _no_sync(model, not last), compute.autocast():
        value = loss_fn(model(images), targets)
    marks.append(timer.mark())
    with _no_sync(model, not last):
        (value / in_step if in_step > 1 else value).backward()
    if last:
        if freeze is not None:
            freeze.drop_grads()
        optimizer.step()
    marks.append(timer.mark())
    r.add(batch, value.item())  # waits for the device: the marks are done
    r.add_times(timer.between(marks), timer.own(marks[1], marks[3]))


def _in_step(done: int, accumulate: int, total: int | None) -> int:
    """Batches in the optimizer step that batch `done` (from 0) is part of: `accumulate`, or
    fewer in a rank's last step."""
    begun = done - done % accumulate
    return min(accumulate, total - begun) if total is not None else accumulate


def _no_sync(model: nn.Module, skip: bool) -> contextlib.AbstractContextManager[None]:
    """DDP's no_sync (no gradient all-reduce) for a batch that does not end its step."""
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if skip and no_sync is not None else contextlib.nullcontext()


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: Iterable[Batch], world: World, compute: Compute, *, ema: nn.Module | None = None
) -> dict[str, float]:
    """Exact validation: each rank sums its share, then one all_reduce, so uneven ranks never block.
    With `ema` (--model-ema's average) the same batches validate it too (`val_top1_ema`, ...)."""
    models = [model] if ema is None else [model, ema]
    for each in models:
        each.eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    totals = torch.zeros(len(models), 4, dtype=torch.float64, device=world.device)  # top1, top5, loss, count
    for batch in batches:
        images, labels = compute.inputs(batch.images, batch.labels)
        for row, each in enumerate(models):
            with compute.autocast():
                logits = each(images).float()
            k = min(5, logits.shape[1])
            hits = logits.topk(k, dim=1).indices.eq(labels[:, None])
            totals[row] += torch.tensor(
                [hits[:, 0].sum().item(), hits.any(dim=1).sum().item(), loss_fn(logits, labels).item(), len(labels)],
                dtype=torch.float64,
                device=world.device,
            )
    if world.distributed:
        dist.all_reduce(totals)
    metrics: dict[str, float] = {}
    for row, suffix in zip(totals.tolist(), ["", "_ema"]):
        top1, top5, loss, count = row
        count = max(count, 1.0)
        metrics.update({f"val_top1{suffix}": top1 / count, f"val_top5{suffix}": top5 / count})
        metrics.update({f"val_loss{suffix}": loss / count})
    metrics["val_samples"] = int(totals[0, 3].item())  # 0 for none: the averages above are 0 then
    return metrics
