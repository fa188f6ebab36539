"""The training loop's accumulation and validation's sums (raywds.train.loop), in process on plain
lists of batches: batches accumulated into an optimizer step train as one batch of all of them
(a rank's last, short step averages what it has), each step's rate is asked once, at its first
batch, DDP all-reduces gradients only at a step's last batch, the epoch's counts add up; and
validation's top-1, top-5, loss and count are the sums a hand count gives, for the model and its
average alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raywds.loader.clock import Spent
from raywds.loader.stages import BadSample, Batch
from raywds.train.compute import Compute
from raywds.train.loop import EpochResult, evaluate, train_epoch
from raywds.world import World

CPU = Compute("cpu", None, False)


def batch_of(size: int, seed: int, classes: int = 4, **more: object) -> Batch:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (size, 3, 2, 5), dtype=torch.uint8, generator=g)  # 5 wide, 2 high
    labels = torch.randint(0, classes, (size,), generator=g)
    ids = torch.arange(seed * 100, seed * 100 + size)
    return Batch(images, labels, ids, [f"k{i}" for i in ids.tolist()], **more)  # type: ignore[arg-type]


def joined(*batches: Batch) -> Batch:
    return Batch(
        torch.cat([b.images for b in batches]),  # type: ignore[misc]
        torch.cat([b.labels for b in batches]),
        torch.cat([b.ids for b in batches]),
        [k for b in batches for k in b.keys],
    )


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(30, 4))  # no BatchNorm: a mean over 8 is the mean of two over 4


def trained(
    batches: list[Batch], accumulate: int, rates: dict[int, float], model: nn.Module | None = None
) -> tuple[nn.Module, list[int]]:
    """The model after one epoch on `batches` at `rates` (by `lr`'s argument, the batches done
    before the step's last), and the arguments the loop asked `lr` for."""
    model = model if model is not None else net()
    asked: list[int] = []

    def lr(done: int) -> float:
        asked.append(done)
        return rates[done]

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    train_epoch(model, batches, optimizer, lr, World(), CPU, uneven=False, accumulate=accumulate)
    return model, asked


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("count", [4, 3])
def test_batches_accumulated_into_a_step_train_as_one_batch_of_them(count: int) -> None:
    """Four batches of 4, two a step: as two steps on batches of 8. Three: the last step has one
    batch, and its gradient is that batch's own (not halved)."""
    batches = [batch_of(4, seed) for seed in range(count)]
    last = 3 if count == 4 else 2  # a step's rate is its last batch's, asked at its first
    alone, asked = trained(batches, 2, {1: 0.5, last: 0.25})
    together, asked_together = trained(
        [joined(*batches[at : at + 2]) for at in range(0, count, 2)], 1, {0: 0.5, 1: 0.25}
    )
    assert asked == [1, last] and asked_together == [0, 1]
    for a, b in zip(weights(alone), weights(together)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(weights(alone), weights(net()))), "it trained"


def test_three_batches_a_step_and_an_unsized_stream_of_whole_steps_train_alike() -> None:
    batches = [batch_of(4, seed) for seed in range(6)]
    alone, asked = trained(batches, 3, {2: 0.5, 5: 0.25})
    together, _ = trained([joined(*batches[:3]), joined(*batches[3:])], 1, {0: 0.5, 1: 0.25})
    streamed, _ = trained(iter(batches), 3, {2: 0.5, 5: 0.25})  # type: ignore[arg-type]  # no len(): whole steps
    assert asked == [2, 5]
    for a, b, c in zip(weights(alone), weights(together), weights(streamed)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_mixing_is_handed_each_batch_on_the_device_and_trains_on_its_targets() -> None:
    batches = [batch_of(4, seed) for seed in range(2)]
    handed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def mix(images: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        handed.append((images, labels, ids))
        return images.flip(0), nn.functional.one_hot(labels.flip(0), 4).float()

    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    train_epoch(model, batches, optimizer, lambda done: 0.5, World(), CPU, uneven=False, mix=mix)
    assert len(handed) == 2
    for (images, labels, ids), batch in zip(handed, batches):
        torch.testing.assert_close(images, CPU.inputs(batch.images, batch.labels)[0])
        assert torch.equal(labels, batch.labels) and torch.equal(ids, batch.ids)
    flipped = [Batch(b.images.flip(0), b.labels.flip(0), b.ids, b.keys) for b in batches]  # type: ignore[union-attr]
    plain, _ = trained(flipped, 1, {0: 0.5, 1: 0.5})
    for a, b in zip(weights(model), weights(plain)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_epochs_counts_add_up_and_after_step_may_stop_it() -> None:
    bad = BadSample("train-001.tar", "k3", "k3.jpg", "cannot decode")
    batches = [
        batch_of(4, 0, spent=Spent(read_s=1.0, read_bytes=10, samples=4)),
        batch_of(3, 1, bad_samples=(bad,), bad_shards=("train-002.tar",), read_retries=2, spent=Spent(read_s=2.0)),
        batch_of(4, 2, bad_samples=(bad, bad._replace(key="k4")), read_retries=1),
        batch_of(4, 3),
    ]
    model, seen = net(), []

    def after_step(done: int, batch: Batch, so_far: EpochResult) -> bool:
        seen.append((done, len(batch.labels), so_far.num_samples))
        return done == 3

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # rate 0: the losses are the untrained model's
    result = train_epoch(model, batches, optimizer, lambda done: 0.0, World(), CPU, uneven=False, after_step=after_step)
    assert seen == [(1, 4, 4), (2, 3, 7), (3, 4, 11)] and result.stopped
    assert (result.num_steps, result.num_samples, result.num_bad_shards, result.num_read_retries) == (3, 11, 1, 3)
    assert result.bad_samples == [bad, bad, bad._replace(key="k4")]
    assert list(result.distinct_bad) == [("train-001.tar", "k3"), ("train-001.tar", "k4")]
    with torch.no_grad():
        expected = sum(
            nn.functional.cross_entropy(model(CPU.inputs(b.images, b.labels)[0]), b.labels, reduction="sum").item()
            for b in batches[:3]
        )
    assert result.loss_sum == pytest.approx(expected, rel=1e-6)
    assert result.image_px == 5 and result.seconds > 0
    assert (result.loader.read_s, result.loader.read_bytes, result.loader.samples) == (3.0, 10, 4)


def test_ddp_all_reduces_gradients_only_at_a_steps_last_batch(tmp_path: Path) -> None:
    """One gloo rank, in process: the batches before a step's last run under no_sync (DDP's
    flag, read as each forward pass starts and as its gradients are made), the last and a rank's
    short last step do not."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        inner = net()
        model = DistributedDataParallel(inner)
        synced: list[bool] = []
        backward: list[bool] = []  # read again as the gradient is made (compiled autograd reads it there)
        inner.register_forward_pre_hook(lambda module, args: synced.append(model.require_backward_grad_sync))
        inner[1].weight.register_hook(lambda grad: backward.append(model.require_backward_grad_sync))
        trained([batch_of(4, seed) for seed in range(5)], 2, {1: 0.1, 3: 0.1, 4: 0.1}, model=model)
        assert synced == backward == [False, True, False, True, True]
        synced.clear()
        backward.clear()
        trained([batch_of(4, seed) for seed in range(2)], 1, {0: 0.1, 1: 0.1}, model=model)
        assert synced == backward == [True, True]
    finally:
        dist.destroy_process_group()


class Scores(nn.Module):
    """A model whose logits are given, batch by batch; it notes whether it was asked in eval mode."""

    def __init__(self, logits: list[torch.Tensor]):
        super().__init__()
        self.logits = list(logits)
        self.modes: list[bool] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.training)
        assert torch.is_grad_enabled() is False, "validation computes no gradients"
        return self.logits.pop(0)


def scored(logits: list[torch.Tensor], labels: list[torch.Tensor]) -> dict[str, float]:
    """The hand count: hits in the top 1 and top 5 (of fewer classes, all), the summed loss, per sample."""
    every, truth = torch.cat(logits).double(), torch.cat(labels)
    ranked = every.argsort(dim=1, descending=True)
    top1 = (ranked[:, 0] == truth).sum().item()
    top5 = (ranked[:, :5] == truth[:, None]).any(dim=1).sum().item()
    loss = nn.functional.cross_entropy(every, truth, reduction="sum").item()
    return {"val_top1": top1 / len(truth), "val_top5": top5 / len(truth), "val_loss": loss / len(truth)}


@pytest.mark.parametrize("classes", [8, 3])
def test_validation_sums_hits_loss_and_count_over_uneven_batches(classes: int) -> None:
    g = torch.Generator().manual_seed(classes + 1)
    sizes = [5, 2, 4]
    logits = [torch.randn(n, classes, generator=g) for n in sizes]
    averaged = [torch.randn(n, classes, generator=g) for n in sizes]
    batches = [batch_of(n, seed, classes) for seed, n in enumerate(sizes)]
    labels = [b.labels for b in batches]
    model, ema = Scores(logits), Scores(averaged)
    metrics = evaluate(model, batches, World(), CPU, ema=ema)
    mine, its = scored(logits, labels), scored(averaged, labels)
    assert set(metrics) == {*mine, *(f"{k}_ema" for k in its), "val_samples"}
    assert metrics["val_samples"] == 11
    for key, value in mine.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6), key
        assert metrics[f"{key}_ema"] == pytest.approx(its[key], rel=1e-6), key
    assert 0 < mine["val_top1"] < mine["val_top5"] < 1 if classes == 8 else mine["val_top5"] == 1.0
    assert model.modes == ema.modes == [False] * 3

    alone = evaluate(Scores(logits), batches, World(), CPU)
    assert alone == {key: metrics[key] for key in ("val_top1", "val_top5", "val_loss", "val_samples")}


def test_validation_of_one_sample_and_of_none() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    one = evaluate(Scores([logits]), [batch_of(1, 0, 3)._replace(labels=torch.tensor([1]))], World(), CPU)
    loss = nn.functional.cross_entropy(logits, torch.tensor([1])).item()
    assert one == {"val_top1": 1.0, "val_top5": 1.0, "val_loss": pytest.approx(loss), "val_samples": 1}
    none = evaluate(Scores([]), [], World(), CPU)
    assert none == {"val_top1": 0.0, "val_top5": 0.0, "val_loss": 0.0, "val_samples": 0}, "none scored: 0, not 1"
