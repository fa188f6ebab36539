"""The fast decoders against torchvision's reference transform: the same crops for the same
seed (pixels within resampling noise), the same crop distribution, and the device path's
plumbing run on the CPU."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter, JpegImagePlugin
from support.runs import need_jpeg_extension
from torchvision import transforms

from raywds.loader import crops
from raywds.loader import decodings as device_decoder
from raywds.loader.crops import reduction, reference_train, reference_val, train_crop, val_crop
from raywds.loader.decodings import Encoded, encoded_crop
from raywds.train.compute import Compute

SCALE = (0.08, 1.0)


@pytest.fixture(params=["region", "whole"])
def jpeg_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the `cpu` decoder reads JPEGs: the region decoder (the raywds.loader._jpeg
    extension) and, as where the extension could not be built, whole-image decoding."""
    if request.param == "whole":
        monkeypatch.setattr(crops, "_jpeg", None)
    else:
        need_jpeg_extension()
    return request.param


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """Blurred noise: smooth enough that resampling differs little, textured enough that a
    misplaced crop differs a lot."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)
    return Image.fromarray(noise).resize((width, height), Image.Resampling.BICUBIC).filter(ImageFilter.GaussianBlur(2))


def encoded(img: Image.Image, fmt: str = "JPEG", mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    img.convert(mode).save(out, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return out.getvalue()


def seeded(fn, data: bytes, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return fn(data)


def mean_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().mean())


@pytest.mark.parametrize(
    "width,height,fmt,mode,size,tolerance",
    [
        # mean absolute difference in grey levels over the seeds (each seed's under twice it); two
        # different crops differ by 35 to 55. At a reduced DCT scale the box's corners are rounded
        # to the smaller image's pixels (crops.scaled_box): on this noisy photo 6.6 on average, 13
        # at most (1.3 and 3.4 on real photos at 128 px with PIL's fractional box, 0.26 ms slower a crop).
        (500, 375, "JPEG", "RGB", 224, 0.5),  # ImageNet-sized: whole-image decode_jpeg, tensor resize (measured 0.01)
        (1600, 1200, "JPEG", "RGB", 224, 8.0),  # large: DCT-scaled decode for the larger crops (6.6 on average)
        (500, 375, "JPEG", "RGB", 64, 8.0),  # low resolution: DCT scaling for most crops (6.7 on average)
        (500, 375, "JPEG", "L", 224, 0.5),  # grayscale JPEG -> RGB
        (500, 375, "JPEG", "CMYK", 224, 0.5),  # CMYK JPEG: through PIL
        (500, 375, "PNG", "RGB", 224, 0.5),  # not a JPEG: through PIL
    ],
)
def test_cpu_crop_matches_the_reference_for_the_same_seed(
    width: int, height: int, fmt: str, mode: str, size: int, tolerance: float, jpeg_path: str
) -> None:
    data = encoded(photo(width, height), fmt, mode)
    fast, ref = train_crop, reference_train(size, SCALE)
    apart = []
    for seed in range(12):
        a = seeded(lambda d: fast(d, size, SCALE), data, seed)
        b = seeded(ref, data, seed)
        assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape == (3, size, size)
        apart.append(mean_abs(a, b))
        assert apart[-1] < 2 * tolerance, f"seed {seed}: the fast crop must show what the reference crop shows"
        other = seeded(ref, data, seed + 100)
        assert mean_abs(a, other) > 20, "the test image must tell different crops apart"
    assert sum(apart) / len(apart) < tolerance


def test_the_region_decoders_crop_is_the_whole_images_crop(monkeypatch: pytest.MonkeyPatch) -> None:
    """At full scale the `cpu` crop that libjpeg cuts to the box as it decodes (decode_box) is,
    pixel for pixel, the same crop of the whole decoded image: only cheaper."""
    need_jpeg_extension()
    data = encoded(photo(500, 375))  # crops of it at 224 px are never DCT-scaled
    cut = [seeded(lambda d: train_crop(d, 224, SCALE), data, seed) for seed in range(30)]
    monkeypatch.setattr(crops, "_jpeg", None)
    whole = [seeded(lambda d: train_crop(d, 224, SCALE), data, seed) for seed in range(30)]
    assert all(torch.equal(a, b) for a, b in zip(cut, whole))


@pytest.mark.parametrize(
    "height,width,scale",
    [
        (375, 500, SCALE),
        (1200, 1600, SCALE),
        (500, 333, (0.35, 1.0)),
        (20, 900, SCALE),
        (900, 20, SCALE),
        (1, 1, SCALE),
    ],
)
def test_draw_crop_is_torchvisions_draw(height: int, width: int, scale: tuple[float, float]) -> None:
    """The same box and flip as RandomResizedCrop.get_params then RandomHorizontalFlip, seed for
    seed, and the generator left in the same state; very narrow images take get_params's
    centre-crop fallback after ten misses."""
    image = torch.empty(1, 1, 1).expand(3, height, width)
    for seed in range(300):
        torch.manual_seed(seed)
        box, flip = crops.draw_crop(height, width, scale)
        after = torch.rand(1)
        torch.manual_seed(seed)
        expected = transforms.RandomResizedCrop.get_params(image, list(scale), list(crops.RATIO))
        assert (box, flip) == (expected, bool(torch.rand(1) < 0.5)), f"seed {seed}"
        assert torch.equal(torch.rand(1), after), "the same draws from the generator, no more"


def test_large_crops_decode_at_reduced_scale(monkeypatch: pytest.MonkeyPatch, jpeg_path: str) -> None:
    scales: list[int] = []
    if jpeg_path == "region":
        real_region = crops._jpeg.decode_region

        def spy_region(data: bytes, top: int, left: int, height: int, width: int, scale: int):  # type: ignore[no-untyped-def]
            scales.append(scale)
            return real_region(data, top, left, height, width, scale)

        monkeypatch.setattr(crops._jpeg, "decode_region", spy_region)
    else:
        real_draft = JpegImagePlugin.JpegImageFile.draft

        def spy_draft(self: Image.Image, mode: str, size: tuple[int, int]):  # type: ignore[no-untyped-def]
            scales.append(round(self.width / size[0]))
            return real_draft(self, mode, size)

        monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy_draft)
    data = encoded(photo(1600, 1200))
    for seed in range(20):
        seeded(lambda d: train_crop(d, 224, SCALE), data, seed)
    assert any(s > 1 for s in scales), "crops at least twice the output size must be decoded at reduced scale"
    assert (
        reduction((0, 0, 1200, 1600), 224) == 4
        and reduction((0, 0, 447, 900), 224) == 1
        and reduction((0, 0, 448, 448), 224) == 2
    )
    assert reduction((0, 0, 2000, 2000), 224) == 8


def test_a_scaled_box_is_the_box_at_its_scale_within_half_a_pixel() -> None:
    """Each corner of a crop box, in the 1/r image decoded from (y0, x0), is where it falls there
    rounded to that image's pixels: never more than half of one of them off, inside the image."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        r = int(rng.choice([2, 4, 8]))
        top, left = int(rng.integers(0, 800)), int(rng.integers(0, 800))
        h, w = int(rng.integers(2 * r, 900)), int(rng.integers(2 * r, 900))
        y0, x0 = top // r - int(rng.integers(0, 2)), left // r - int(rng.integers(0, 2))
        rows, cols = -(-(top + h) // r) - y0 + 1, -(-(left + w) // r) - x0 + 1
        y, x, bh, bw = crops.scaled_box((top, left, h, w), r, (y0, x0), (rows, cols))
        assert abs(y - (top / r - y0)) <= 0.5 and abs(x - (left / r - x0)) <= 0.5
        assert abs(y + bh - ((top + h) / r - y0)) <= 0.5 and abs(x + bw - ((left + w) / r - x0)) <= 0.5
        assert 0 <= y and y + bh <= rows and 0 <= x and x + bw <= cols


def coordinates(width: int, height: int) -> bytes:
    """Red encodes x and green y, so a crop's output tells where it came from."""
    x = np.linspace(0, 255, width)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height)[:, None].repeat(width, 1)
    rgb = np.stack([x, y, np.full_like(x, 128)], -1).round().astype(np.uint8)
    return encoded(Image.fromarray(rgb))


def recovered(out: torch.Tensor, width: int, height: int) -> tuple[float, float, float, float, bool]:
    """(area scale, log aspect ratio, centre x, centre y, flipped) of the crop behind `out`."""
    r, g = out[0].double() / 255, out[1].double() / 255
    n = out.shape[-1]
    x0, x1 = float(r[:, 0].mean()) * (width - 1), float(r[:, -1].mean()) * (width - 1)
    y0, y1 = float(g[0].mean()) * (height - 1), float(g[-1].mean()) * (height - 1)
    w, h = abs(x1 - x0) * n / (n - 1), abs(y1 - y0) * n / (n - 1)
    return w * h / (width * height), float(np.log(w / h)), (x0 + x1) / 2 / width, (y0 + y1) / 2 / height, x1 < x0


CROP_WIDTH, CROP_HEIGHT, CROP_SIZE, CROP_DRAWS = 1200, 900, 112, 300


@pytest.fixture(scope="module")
def reference_crops() -> np.ndarray:
    """The reference transform's crops of `coordinates`, drawn once for both decoders' tests."""
    data = coordinates(CROP_WIDTH, CROP_HEIGHT)
    ref = reference_train(CROP_SIZE, SCALE)
    return np.array([recovered(seeded(ref, data, 10_000 + s), CROP_WIDTH, CROP_HEIGHT) for s in range(CROP_DRAWS)])


@pytest.mark.parametrize("decoder", ["cpu", "device"])
def test_crop_distribution_matches_the_reference(decoder: str, reference_crops: np.ndarray) -> None:
    """Independent draws (different seeds) from the fast path and the reference: the crops'
    scale, aspect ratio, position and flips must be the same distribution, within the
    standard transform's ranges."""
    from scipy.stats import ks_2samp  # 0.9 s: paid by the worker that runs this test, not by every collection

    width, height, size, n = CROP_WIDTH, CROP_HEIGHT, CROP_SIZE, CROP_DRAWS
    data = coordinates(width, height)
    if decoder == "cpu":
        fast = lambda d: train_crop(d, size, SCALE)  # noqa: E731
    else:
        fast = lambda d: Encoded.of([encoded_crop(d, size, SCALE)]).decode("cpu")[0]  # noqa: E731
    a = np.array([recovered(seeded(fast, data, s), width, height) for s in range(n)])
    b = reference_crops
    for stats in (a, b):
        assert stats[:, 0].min() > 0.08 * 0.9 and stats[:, 0].max() < 1.05, "area scale within (0.08, 1)"
        assert np.exp(stats[:, 1]).min() > 0.75 * 0.95 and np.exp(stats[:, 1]).max() < 4 / 3 * 1.05, (
            "ratio within (3/4, 4/3)"
        )
        assert 0.4 < stats[:, 4].mean() < 0.6, "half the crops flipped"
    for column, name in enumerate(["scale", "log ratio", "centre x", "centre y"]):
        p = ks_2samp(a[:, column], b[:, column]).pvalue
        assert p > 0.001, f"{name}: the fast path's crops must be distributed as the reference's (KS p={p:.2g})"
    shifted = a[:, 0] * 0.8  # what a crop box off by a constant factor would give
    assert ks_2samp(shifted, b[:, 0]).pvalue < 0.001, "the test must catch a crop that is systematically too small"


def test_val_crop_matches_the_reference() -> None:
    for img in (photo(500, 375), photo(375, 500, seed=1)):
        data = encoded(img)
        assert mean_abs(val_crop(data, 224), reference_val(224)(data)) < 1.5
        assert mean_abs(val_crop(data, 224, 232), reference_val(224, 232)(data)) < 1.5


@pytest.mark.parametrize("shape", [(500, 375), (375, 500), (256, 300), (333, 257)])
def test_val_crop_is_torchvisions_resize_and_centre_crop_on_the_decoded_image(shape: tuple[int, int]) -> None:
    """val_crop resizes and crops with torch alone (no torchvision import in loader workers):
    the same sizes, offsets and pixels as torchvision's tensor Resize and CenterCrop, for
    landscape, portrait, already-short-enough and odd sizes, colour and grey; a PNG goes through PIL."""
    from torchvision.transforms.v2 import functional as F

    for fmt, mode in (("JPEG", "RGB"), ("JPEG", "L"), ("PNG", "RGB")):
        data = encoded(photo(*shape), fmt, mode)
        image = crops.jpeg_tensor(data) if fmt == "JPEG" else F.pil_to_tensor(Image.open(io.BytesIO(data)))
        for resize in (None, 232):  # the default (224 / 0.875 = 256) and --val-resize-size 232
            want = F.center_crop(F.resize(image, [resize or 256], antialias=True), [224, 224])
            got = val_crop(data, 224, resize)
            assert got.shape == want.shape == (3, 224, 224)
            assert torch.equal(got, want), (
                f"{shape} {fmt} {mode} {resize}: {(got.int() - want.int()).abs().max()} apart"
            )


def test_device_decode_equals_the_cpu_path_and_normalises(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`--decode device` on a CPU: the same draws as the cpu decoder give the same pixels, and
    a PNG sample is re-encoded as JPEG on the worker side."""
    datas = [encoded(photo(500, 375, seed=i)) for i in range(5)] + [encoded(photo(300, 200, seed=9), "PNG")]
    torch.manual_seed(0)
    parts = [encoded_crop(d, 224, SCALE) for d in datas]
    batch = Encoded.of(parts)
    assert len(batch) == 6 and batch[5].data[:2].tolist() == [0xFF, 0xD8], "the PNG travels as a JPEG"
    decoded = batch.decode("cpu")
    torch.manual_seed(0)
    reference = [train_crop(d, 224, SCALE) for d in datas]
    for i in range(5):  # 500x375 at 224 px: both decode the whole JPEG with decode_jpeg
        assert mean_abs(decoded[i], reference[i]) < 0.5
    assert mean_abs(decoded[5], reference[5]) < 2.0, "JPEG quality 95 re-encoding stays close"
    compute = Compute("cpu", None, False)
    x, y = compute.inputs(batch, torch.arange(6))
    assert x.shape == (6, 3, 224, 224) and x.dtype == torch.float32
    assert -3 < float(x.mean()) < 3 and torch.equal(y, torch.arange(6))
    again = Encoded.of([batch[i] for i in range(len(batch))])
    assert torch.equal(again.data, batch.data) and torch.equal(again.boxes, batch.boxes)


def test_collate_in_a_worker_uses_shared_memory() -> None:
    from torch.utils.data import DataLoader, IterableDataset

    class Crops(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            stacked = device_decoder.stack([torch.full((3, 4, 4), i, dtype=torch.uint8) for i in range(3)])
            yield stacked, stacked.is_shared()

    ((batch, shared_in_worker),) = list(DataLoader(Crops(), batch_size=None, num_workers=1))
    assert batch.shape == (3, 3, 4, 4) and batch[2].max() == 2
    assert shared_in_worker, "the worker stacks straight into shared memory: no copy when it hands the batch over"
    assert device_decoder.stack([torch.zeros(3, 2, 2, dtype=torch.uint8)]).is_shared() is False, (
        "outside workers: plain memory"
    )


@pytest.mark.parametrize(
    "width,height,fmt,mode,size",
    [
        (500, 375, "JPEG", "RGB", 224),  # full-scale crops: resized straight into the slot
        (1600, 1200, "JPEG", "RGB", 224),  # DCT-scaled crops among them: PIL resamples, then a copy
        (500, 375, "JPEG", "L", 96),
        (500, 375, "PNG", "RGB", 96),  # not a JPEG: through PIL
    ],
)
def test_a_crop_decoded_into_its_slot_is_the_same_crop(
    jpeg_path: str, width: int, height: int, fmt: str, mode: str, size: int
) -> None:
    """`out=` (a batch block's slot, raywds.loader.blocks.Slots) changes where the crop goes,
    never its pixels: every seed, flipped or not, and the validation crop too."""
    data = encoded(photo(width, height), fmt, mode)
    block = torch.zeros((12, size, size, 3), dtype=torch.uint8)
    for seed in range(12):
        slot = block[seed].permute(2, 0, 1)
        alone = train_crop(data, size, SCALE, crops.crop_rng(0, 0, seed))
        filled = train_crop(data, size, SCALE, crops.crop_rng(0, 0, seed), out=slot)
        assert filled.data_ptr() == slot.data_ptr()
        assert torch.equal(block[seed].permute(2, 0, 1), alone), f"seed {seed}"
    assert torch.equal(val_crop(data, size, out=block[0].permute(2, 0, 1)), val_crop(data, size))
    assert torch.equal(block[0].permute(2, 0, 1), val_crop(data, size))


def test_crops_decoded_into_their_slots_are_the_batch_without_a_copy() -> None:
    block = torch.zeros((4, 6, 6, 3), dtype=torch.uint8).share_memory_()
    images = [block[i].permute(2, 0, 1).fill_(i + 1) for i in range(3)]
    batch = crops.stack_crops(images)
    assert batch.data_ptr() == block.data_ptr() and batch.shape == (3, 3, 6, 6)
    assert torch.equal(batch.amax(dim=(1, 2, 3)), torch.tensor([1, 2, 3], dtype=torch.uint8))
    for other in ([images[1], images[0]], images[1:], [images[0], images[2]], [images[0].clone(), images[1]]):
        stacked = crops.stack_crops(other)  # out of order, not from the start, a gap, not in the block
        assert stacked.data_ptr() != block.data_ptr()
        assert torch.equal(stacked, torch.stack(other))


def test_a_gpu_batch_is_resized_together_as_each_crop_alone() -> None:
    """`--decode device` on a GPU resizes every crop as floats (CUDA's antialiased resize has no
    uint8 kernel) and rounds, casts and flips the batch at once (device_decoder.resized_together); that
    must be what `cropped` gives crop by crop with the CPU's uint8 kernel, within one grey level,
    flips on the right images. Run here on CPU tensors: the float path is the same code."""
    g = torch.Generator().manual_seed(5)
    images = [
        torch.from_numpy(np.array(photo(w, h, seed=i))).permute(2, 0, 1)
        for i, (w, h) in enumerate([(300, 200), (180, 260), (224, 224), (500, 333)])
    ]
    drawn = [crops.draw_crop(im.shape[1], im.shape[2], SCALE, g) for im in images]
    flips = torch.tensor([True, False, True, False])
    together = device_decoder.resized_together(images, [list(box) for box, _ in drawn], flips, 64)
    alone = torch.stack([crops.cropped(im, box, bool(flip), 64) for im, (box, _), flip in zip(images, drawn, flips)])
    assert together.shape == (4, 3, 64, 64) and together.dtype == torch.uint8
    assert together.is_contiguous(memory_format=torch.channels_last)
    assert (together.int() - alone.int()).abs().max() <= 1
    assert (together.int() - alone.flip(-1).int()).abs().float().mean() > 5  # the flips matter on these photos


def test_each_decode_choice_has_its_object() -> None:
    import typing

    from raywds.errors import ConfigError
    from raywds.loader.decodings import DECODINGS, decoding
    from raywds.loader.settings import DecodeName

    assert tuple(DECODINGS) == typing.get_args(DecodeName)
    assert [d.name for d in DECODINGS.values() if not d.in_workers] == ["device"]
    assert [d.name for d in DECODINGS.values() if d.region] == ["cpu"]
    with pytest.raises(ConfigError, match="not one of cpu, device, pil"):
        decoding("gpu")
