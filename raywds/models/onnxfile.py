"""`raywds export --onnx`: the model as an ONNX file with a dynamic batch axis, checked against
the model itself before it is kept. torch.onnx's exporter has written graphs that load and run but
compute something else, so the file is run by onnxruntime on real validation images, decoded and
normalised as raywds validates, and its logits are compared with the model's.

    write_onnx(trained.model, Path("model.onnx"), crop=224)
    check = check_onnx(Path("model.onnx"), trained.model, validation_images(trained, CheckImages(count=64)))
    check.passed, check.line()
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from raywds.data.source import Source
from raywds.errors import ConfigError, RaywdsError
from raywds.loader.settings import LoaderConfig, Loading
from raywds.models.trained import Trained
from raywds.plan.modes import Schedule

log = logging.getLogger(__name__)

ONNX_INSTALL = "pip install 'raywds[onnx]'"
TOLERANCE = 1e-3
"""The largest absolute difference in float32 logits a checked ONNX file may show; every image's
top-1 class must be the same as well."""
CHECK_BATCH = 32
"""Images a batch in the check: not EXAMPLE_BATCH, so the dynamic batch axis is what runs."""
EXAMPLE_BATCH = 2
"""The batch the model is traced with (torch.export specialises a batch of 1)."""
INLINE_LIMIT = 1_800_000_000
"""Bytes of weights up to which they are kept inside model.onnx (protobuf stops at 2 GiB); above,
they go to model.onnx.data beside it."""


def need_onnx() -> None:
    """ConfigError, saying how to install them, where onnx, onnxruntime or onnxscript is missing."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401  # torch.onnx's exporter translates with it
    except ImportError as e:
        raise ConfigError(
            f"--onnx needs onnx, onnxruntime and onnxscript ({e.name} is not installed): {ONNX_INSTALL}"
        ) from None


@dataclass(frozen=True)
class CheckImages:
    """Where the check's validation images come from."""

    data: str | None = None
    """Shards with a val split (--data); None: the run's own --data (and --val-data)."""
    s3_endpoint: str | None = None
    count: int = 128
    """The first this many images of the val split (all of them where it holds fewer)."""


@dataclass(frozen=True)
class OnnxCheck:
    """How an ONNX file's logits compared with the model's on the same images."""

    images: int
    max_diff: float
    agree: int
    batch_sizes: tuple[int, ...]
    tolerance: float = TOLERANCE

    @property
    def passed(self) -> bool:
        return self.images > 0 and self.max_diff <= self.tolerance and self.agree == self.images

    def line(self) -> str:
        """`onnx: max |logit difference| 2.1e-06, top-1 agreement 50/50 (1.000) on 50 validation images`."""
        share = self.agree / max(self.images, 1)
        return (
            f"onnx: max |logit difference| {self.max_diff:.2g}, top-1 agreement {self.agree}/{self.images} "
            f"({share:.3f}) on {self.images} validation images"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "images": self.images,
            "max_abs_diff": self.max_diff,
            "top1_agree": self.agree,
            "batch_sizes": list(self.batch_sizes),
            "tolerance": self.tolerance,
            "passed": self.passed,
        }


@dataclass(frozen=True)
class CheckData:
    """What the check reads its images with: where they are, and the model's validation inputs."""

    source: Source
    loading: Loading

    def loader(self) -> LoaderConfig:
        """A validation pass of CHECK_BATCH images a batch, read in this process."""
        schedule = Schedule(loader_workers=0, batch_size=CHECK_BATCH)
        return LoaderConfig.of(self.loading, schedule, self.source, crop_size=self.loading.val_crop)


def check_config(trained: Trained, images: CheckImages) -> CheckData:
    """Where and how the check reads its images: --data (else the run's data) at the model's
    validation inputs, read in this process."""
    saved = trained.config.get("data") or {}  # the run's data section
    if images.data is None and not saved.get("data"):
        raise ConfigError(
            f"--onnx checks the ONNX file on validation images, and {trained.source} names no data: "
            "give --data SHARDS with a val split"
        )
    where = {"data": images.data} if images.data else {k: saved.get(k) for k in ("data", "val_data", "shards_at")}
    inputs = trained.inputs
    source = Source(
        **where,
        s3_endpoint=images.s3_endpoint or saved.get("s3_endpoint"),
        index_cache=saved.get("index_cache") if images.data is None else None,
    )
    loading = Loading(
        val_resize_size=inputs.resize,
        val_crop_size=inputs.crop,
        mean=",".join(map(str, inputs.mean)),
        std=",".join(map(str, inputs.std)),
    )
    return CheckData(source, loading)


def check_manifest(source: Source, given: bool) -> Any:
    """The manifest of the check's data (read before anything is written), with a val split."""
    from raywds.data.dataset import manifest_of

    try:
        manifest = manifest_of(source)
    except RaywdsError as e:
        if given:
            raise
        raise type(e)(
            f"--onnx checks on the run's validation images, which cannot be read ({e}); "
            "give --data SHARDS with a val split"
        ) from None
    if not manifest.shards("val"):
        raise ConfigError(
            f"--onnx checks on validation images, and {source.data} has no val split: give --data SHARDS with one"
        )
    return manifest


def validation_images(manifest: Any, check: CheckData, count: int) -> Iterator[torch.Tensor]:
    """The val split's first `count` images, decoded by raywds's validation loader and normalised
    as raywds.train.compute does, as float32 batches."""
    from raywds.loader.loader import val_loader
    from raywds.world import World

    mean, std = check.loading.normalisation()
    mean_255 = torch.tensor([m * 255 for m in mean]).view(1, 3, 1, 1)
    std_255 = torch.tensor([s * 255 for s in std]).view(1, 3, 1, 1)
    left = count
    batches = iter(val_loader(manifest, check.loader(), World()))
    try:
        for batch in batches:
            if not isinstance(batch.images, torch.Tensor):  # cfg.decode is "cpu": decoded in the loader
                raise ConfigError(f"the check's loader gave {type(batch.images).__name__}, not decoded images")
            images = batch.images[:left]
            yield (images.float() - mean_255) / std_255
            left -= len(images)
            if left <= 0:
                return
    finally:
        getattr(batches, "close", lambda: None)()  # the loader's workers stop, read to the end or not


def write_onnx(model: nn.Module, path: Path, crop: int) -> dict[str, Any]:
    """`model` (on the CPU, in eval mode) as ONNX at `path`, its batch axis dynamic and its images
    `crop` px square; what the file is, for model.json."""
    need_onnx()
    example = torch.zeros(EXAMPLE_BATCH, 3, crop, crop)
    size = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    external = size > INLINE_LIMIT
    batch = torch.export.Dim("batch", min=1)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the exporter's notes on its own internals
            torch.onnx.export(
                model,
                (example,),
                str(path),
                input_names=["images"],
                output_names=["logits"],
                dynamic_shapes=({0: batch},),
                external_data=external,
                verbose=False,
                dynamo=True,
            )
    except Exception as e:  # noqa: BLE001  # the exporter raises many kinds; each is one line here
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RaywdsError(
            f"torch.onnx.export (torch {torch.__version__}) could not export this model: {first}; export without --onnx"
        ) from None
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    return {"opset": opset, "exporter": f"torch.onnx dynamo (torch {torch.__version__})", "external_data": external}


def check_onnx(
    path: Path, model: nn.Module, batches: Iterator[torch.Tensor], tolerance: float = TOLERANCE
) -> OnnxCheck:
    """Run the ONNX file at `path` with onnxruntime (CPU) and `model` on the same batches: the
    largest absolute difference in their logits and how many top-1 classes agree."""
    need_onnx()
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # errors only
    try:
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001  # onnxruntime's own exception types
        raise RaywdsError(f"onnxruntime cannot load {path}: {str(e).strip().splitlines()[0]}") from None
    name = session.get_inputs()[0].name
    images, agree, worst, sizes = 0, 0, 0.0, []
    for batch in batches:
        with torch.no_grad():
            expected = model(batch).float()
        got = torch.from_numpy(session.run(None, {name: batch.numpy()})[0]).float()
        if got.shape != expected.shape:
            raise RaywdsError(f"{path} gave logits of shape {tuple(got.shape)} for {tuple(expected.shape)}")
        diff = (got - expected).abs().max().item()
        worst = max(worst, diff if math.isfinite(diff) else math.inf)
        agree += int((got.argmax(1) == expected.argmax(1)).sum().item())
        images += len(batch)
        sizes.append(len(batch))
    return OnnxCheck(images, worst, agree, tuple(sizes), tolerance)
