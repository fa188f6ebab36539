"""On a CUDA GPU: a bf16 channels_last step against float32, `--decode device` against `--decode
cpu`, a compiled run, and validation's all_reduce over NCCL. Skipped, with the reason, where torch
sees no GPU; benchmarks/gpu_run.sh runs them on a GPU machine:

    .venv/bin/python -m pytest -m cuda tests/train/test_cuda.py
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from PIL import Image, ImageFilter
from support.runs import small_config

from raywds.data.convert import ConvertOptions, convert
from raywds.data.manifest import read_manifest
from raywds.loader.decodings import Encoded
from raywds.loader.loader import train_loader, val_loader
from raywds.loader.stages import Batch
from raywds.plan.modes import epoch_plan
from raywds.serve import free_port
from raywds.train.compute import Compute
from raywds.train.loop import evaluate, train_epoch
from raywds.train.model import build_model
from raywds.train.trainer import train
from raywds.world import World

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"),
]
DEVICE = "cuda:0"


@pytest.fixture
def exact_fp32() -> Iterator[None]:
    """float32 matmuls and convolutions without TF32, so the reference is float32 indeed."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def one_step(model: torch.nn.Module, compute: Compute, batch: Batch) -> tuple[float, torch.Tensor]:
    """One step of the training loop; the loss and how much the parameters moved, flattened."""
    before = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result = train_epoch(model, [batch], optimizer, lambda step: 0.1, World(device=DEVICE), compute, uneven=False)
    after = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    return result.loss_sum / result.num_samples, after - before


def test_bf16_channels_last_step_matches_fp32(exact_fp32: None) -> None:
    """CUDA's defaults (bf16 autocast, channels_last) take the step float32 takes, within bf16's
    precision: the same loss, and the parameters moved the same way by about as much. bf16's
    rounding through 18 layers leaves the update of a freshly initialised ResNet-18 on noise at
    a cosine of 0.94 to float32's on the CPU's bf16 path; unrelated updates are near 0."""
    cfg = small_config("unused", model="resnet18", image_size=64)
    fast = Compute.for_run(cfg, DEVICE)
    exact = Compute.for_run(dataclasses.replace(cfg, precision="fp32", memory_format="contiguous"), DEVICE)
    assert fast.autocast_dtype == torch.bfloat16 and fast.channels_last, "bf16 and channels_last by default on CUDA"
    torch.manual_seed(0)
    base = build_model("resnet18", 10)
    images = torch.randint(0, 256, (32, 3, 64, 64), dtype=torch.uint8)
    labels = torch.randint(0, 10, (32,))
    batch = Batch(images, labels, torch.arange(32), [])
    x, _ = fast.inputs(images, labels)
    model = fast.model(copy.deepcopy(base))
    with fast.autocast():
        assert model(x).dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last)
    loss_fast, moved_fast = one_step(fast.model(copy.deepcopy(base)), fast, batch)
    loss_exact, moved_exact = one_step(exact.model(copy.deepcopy(base)), exact, batch)
    assert loss_fast == pytest.approx(loss_exact, rel=0.02)
    cosine = float(torch.nn.functional.cosine_similarity(moved_fast, moved_exact, dim=0))
    norm_ratio = float(moved_fast.norm() / moved_exact.norm())
    print(f"bf16 / float32: loss {loss_fast:.4f} / {loss_exact:.4f}, update cosine {cosine:.4f}, norm {norm_ratio:.3f}")
    assert cosine > 0.85, f"the bf16 update points elsewhere than the float32 one (cosine {cosine:.4f})"
    assert norm_ratio == pytest.approx(1.0, abs=0.1)


def photo(width: int, height: int, seed: int) -> Image.Image:
    """Blurred noise: smooth enough that decoders differ little, textured enough that another crop differs a lot."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)
    return Image.fromarray(noise).resize((width, height), Image.Resampling.BICUBIC).filter(ImageFilter.GaussianBlur(2))


@pytest.fixture(scope="module")
def photo_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 ImageNet-sized JPEGs (500x375 and 375x500) of 2 classes in shards of 16."""
    tree = tmp_path_factory.mktemp("photos")
    for i in range(48):
        folder = tree / f"class{i % 2}"
        folder.mkdir(exist_ok=True)
        photo(*((500, 375) if i % 3 else (375, 500)), seed=i).save(folder / f"photo{i}.JPEG", quality=90)
    out = tmp_path_factory.mktemp("photo-shards")
    convert(tree, out, ConvertOptions(maxcount=16))
    return out


def mean_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().mean())


def test_device_decode_crops_the_boxes_the_cpu_decoder_crops(photo_shards: Path) -> None:
    """The same seed gives each sample the same crop with either decoder: the cpu decoder's
    pixels are the crop of the box and flip the device batch carries (decoded by libjpeg on
    the CPU: within 0.5 grey levels; another box differs by 35 to 55), and nvJPEG's decode of
    that batch on the GPU is within 2 grey levels of them on average."""
    cfg = small_config(photo_shards, mode="split", image_size=224, crop_scale_min=0.08, batch_size=16)
    world = World(device=DEVICE)
    manifest = read_manifest(str(photo_shards))
    by_id: dict[str, dict[int, torch.Tensor]] = {"cpu": {}, "boxes": {}, "device on cpu": {}, "device": {}}
    for how in ("cpu", "device"):
        run = dataclasses.replace(cfg, decode=how)
        for batch in train_loader(manifest, run.loader(), world, epoch_plan(manifest, run, 1, epoch=0), epoch=0):
            ids = [int(i) for i in batch.ids]
            if how == "cpu":
                assert isinstance(batch.images, torch.Tensor)
                by_id["cpu"].update(zip(ids, batch.images))
                continue
            assert isinstance(batch.images, Encoded)
            by_id["boxes"].update(zip(ids, torch.cat([batch.images.boxes, batch.images.flips[:, None]], 1)))
            by_id["device on cpu"].update(zip(ids, batch.images.decode("cpu")))
            by_id["device"].update(zip(ids, batch.images.decode(DEVICE).cpu()))
    ids = sorted(by_id["cpu"])
    assert ids == sorted(by_id["device"]) and len(ids) == 48
    same_box = {i: mean_abs(by_id["cpu"][i], by_id["device on cpu"][i]) for i in ids}
    wrong = {i: (by_id["boxes"][i].tolist(), round(d, 2)) for i, d in same_box.items() if d >= 0.5}
    assert not wrong, f"the cpu decoder cropped elsewhere than these device boxes (top, left, h, w, flip): {wrong}"
    on_gpu = [mean_abs(by_id["cpu"][i], by_id["device"][i]) for i in ids]
    assert sum(on_gpu) / len(on_gpu) < 2.0, f"nvJPEG against libjpeg, grey levels per sample: {on_gpu}"


def test_two_compiled_steps_of_two_sizes_compile_once(shards: Path) -> None:
    """`--compile` on the GPU with inductor: a split epoch of 120 samples is two steps, of 64 and
    56; the batch dimension is dynamic, so the second step runs the graph the first compiled."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    cfg = small_config(shards, model="resnet18", mode="split", compile=True, epochs=1, batch_size=64)
    final = train(cfg, World(device=DEVICE))
    torch._dynamo.reset()
    assert final["step"] == 2 and final["train_samples"] == 120
    assert math.isfinite(final["train_loss"]) and final["val_samples"] == 50
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_validation_all_reduces_over_nccl(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation's one all_reduce, over NCCL on one GPU (a world of 1, taken as distributed so
    that evaluate calls it), gives what the rank counted alone."""
    if not dist.is_nccl_available():
        pytest.skip("this torch was built without NCCL")
    cfg = small_config(shards)
    world = World(device=DEVICE)
    manifest = read_manifest(str(shards))
    compute = Compute.for_run(cfg, DEVICE)
    torch.manual_seed(0)
    model = compute.model(build_model(cfg.model, len(manifest.classes)))
    alone = evaluate(model, val_loader(manifest, cfg.loader(), world), world, compute)
    calls: list[str] = []
    all_reduce = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        calls.append(f"{dist.get_backend()} {tensor.dtype} {tensor.device}")
        return all_reduce(tensor, *args, **kwargs)  # type: ignore[arg-type]

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        monkeypatch.setattr(World, "distributed", property(lambda self: True))
        monkeypatch.setattr(dist, "all_reduce", counted)
        reduced = evaluate(model, val_loader(manifest, cfg.loader(), world), world, compute)
    finally:
        dist.destroy_process_group()
    assert calls == ["nccl torch.float64 cuda:0"]
    assert reduced["val_samples"] == alone["val_samples"] == 50
    assert reduced["val_top1"] == pytest.approx(alone["val_top1"], abs=1 / 50)
    assert reduced["val_loss"] == pytest.approx(alone["val_loss"], rel=1e-3)
