"""`raywds export MODEL --out DIR`: a trained model (a run folder, RUN/best, a checkpoint, or an
export) as a folder that loads without raywds's checkpoints:

    DIR/model.safetensors       the weights, named as the architecture names them (torchvision and timm load them)
    DIR/model_ema.safetensors   the --model-ema average, where the run kept one (--ema: it is model.safetensors)
    DIR/model.json              what they are: the --model, classes, inputs, the run, each file's sha256
    DIR/config.json             for timm/NAME models: timm's own config (`timm.create_model("local-dir:DIR")`)
    DIR/model.onnx              with --onnx, kept only once onnxruntime agrees with the model

The folder is made beside DIR and renamed into place once it is whole and read back, so DIR holds a
whole export or none. `raywds.models.trained.load_trained(DIR)` reads it back.

    export_model("runs/local/best", Path("exports/local"), onnx=CheckImages(count=64)).lines()
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from raywds.data.stores import sync_path
from raywds.errors import ConfigError, RaywdsError, StorageError
from raywds.models.onnxfile import (
    CheckImages,
    OnnxCheck,
    check_config,
    check_manifest,
    check_onnx,
    need_onnx,
    validation_images,
    write_onnx,
)
from raywds.models.sources import Timm, parse_model
from raywds.models.trained import (
    EXPORT_EMA,
    EXPORT_FORMAT,
    EXPORT_JSON,
    EXPORT_VERSION,
    EXPORT_WEIGHTS,
    Trained,
    load_trained,
)
from raywds.models.weights import sha256_of

log = logging.getLogger(__name__)

ONNX_FILE = "model.onnx"
ONNX_REJECTED = "model.onnx.rejected"
TIMM_CONFIG = "config.json"
VALIDATION = ("epoch", "step", "val_top1", "val_top5", "val_loss", "val_samples")


class OnnxRejected(RaywdsError):
    """The ONNX file's logits differ from the model's: the export was written, its ONNX file kept
    as model.onnx.rejected, not model.onnx."""


@dataclass(frozen=True)
class Exported:
    folder: Path
    name: str
    classes: int
    files: list[str]
    check: OnnxCheck | None = None

    def lines(self) -> list[str]:
        """What `raywds export` prints."""
        said = f"raywds: exported {self.name} ({self.classes} classes) to {self.folder}: {', '.join(self.files)}"
        return [said] + ([f"raywds: {self.check.line()}"] if self.check is not None else [])


def export_model(
    model: str, out: Path, *, ema: bool = False, force: bool = False, onnx: CheckImages | None = None
) -> Exported:
    """Write the model at `model` (load_trained's MODEL) as an export in `out`: refused where `out`
    holds anything but an export (and an export unless `force`). With `onnx`, model.onnx checked
    on those validation images; OnnxRejected (after writing the rest) when it fails the check."""
    _check_out(out, force)
    if onnx is not None:
        need_onnx()
    trained = load_trained(model)
    module = trained.ema if ema else trained.model
    if module is None:
        raise ConfigError(
            f"--ema: {trained.source} holds no --model-ema average beside its weights; export without --ema"
        )
    images = None
    if onnx is not None:  # the data is found before anything is written
        cfg = check_config(trained, onnx)
        images = (check_manifest(cfg.source, given=onnx.data is not None), cfg, onnx.count)
    tmp = out.with_name(f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        written, check = _write(tmp, model, trained, module, ema, images)
        _place(tmp, out, force)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise StorageError(f"cannot write the export to {out}: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if check is not None and not check.passed:
        raise OnnxRejected(
            f"{check.line()}: over the tolerance (|difference| at most {check.tolerance:g} and every top-1 the "
            f"same), so the file is {out / ONNX_REJECTED}, not {ONNX_FILE}, beside the rest of the export; "
            f"torch.onnx (torch {torch.__version__}) and onnxruntime ({_version('onnxruntime')}) do not compute "
            "this model: use model.safetensors, or another torch or onnxruntime"
        )
    return Exported(out, trained.name, len(trained.classes), [*written, EXPORT_JSON], check)


def _write(
    folder: Path, model: str, trained: Trained, module: nn.Module, ema: bool, images: tuple[Any, Any, int] | None
) -> tuple[list[str], OnnxCheck | None]:
    """The export's files in `folder`, read back; the weights' names and the ONNX check."""
    written = _weights(folder, trained, module, ema)
    meta = _meta(model, trained, ema)
    check = None
    if images is not None:
        about = write_onnx(module, folder / ONNX_FILE, trained.inputs.crop)
        check = check_onnx(folder / ONNX_FILE, module, validation_images(*images))
        about.update(file=ONNX_FILE if check.passed else ONNX_REJECTED, check=check.to_dict())
        if not check.passed:
            (folder / ONNX_FILE).rename(folder / ONNX_REJECTED)
        meta["onnx"] = about
    meta["files"] = {p.name: {"sha256": sha256_of(p), "bytes": p.stat().st_size} for p in sorted(folder.iterdir())}
    _write_json(folder / EXPORT_JSON, meta)
    _read_back(folder, module, trained.ema if not ema else None)
    return written, check


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a folder for the export")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / EXPORT_JSON).is_file():
        raise ConfigError(f"--out {out} holds other files, not an export: give a new or empty folder")
    if not force:
        raise ConfigError(f"--out {out} already holds an export: give another folder, or --force to replace it")


def _weights(folder: Path, trained: Trained, module: nn.Module, ema: bool) -> list[str]:
    """model.safetensors (and model_ema.safetensors beside, unless it is the average itself), and
    timm's config.json for a timm model; the names written."""
    from safetensors.torch import save

    def write(state: nn.Module, name: str) -> str:
        # clone: tensors that share memory (tied weights) are refused by safetensors
        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.state_dict().items()}
        with (folder / name).open("wb") as f:  # open's mode (0666 less the umask), not save_file's 0600
            f.write(save(tensors, metadata={"format": "pt"}))
            f.flush()
            os.fsync(f.fileno())
        return name

    written = [write(module, EXPORT_WEIGHTS)]
    if not ema and trained.ema is not None:
        written.append(write(trained.ema, EXPORT_EMA))
    if isinstance(parse_model(trained.name).source, Timm):
        written.append(_timm_config(folder, trained, module))
    return written


def _timm_config(folder: Path, trained: Trained, module: nn.Module) -> str:
    """timm's config.json for the weights (as timm's save_for_hf writes it) with the classes and the
    inputs the model was validated on: `timm.create_model("local-dir:DIR", pretrained=True)`."""
    from timm.models._hub import save_config_for_hf  # timm.models does not re-export it

    path = folder / TIMM_CONFIG
    save_config_for_hf(module, str(path), model_config={"label_names": list(trained.classes)})
    config = json.loads(path.read_text())
    inputs = trained.inputs
    pretrained = config["pretrained_cfg"]
    for key in ("test_input_size", "test_crop_pct", "test_pool_size"):
        pretrained.pop(key, None)  # the inputs below are the ones it was validated on
    if list(pretrained.get("input_size", [])) != [3, inputs.crop, inputs.crop]:
        pretrained["pool_size"] = None  # as timm says of weights saved at another size
    pretrained.update(
        input_size=[3, inputs.crop, inputs.crop],
        crop_pct=inputs.crop / inputs.resize,
        crop_mode="center",
        mean=list(inputs.mean),
        std=list(inputs.std),
        interpolation=inputs.interpolation,
        num_classes=len(trained.classes),
    )
    _write_json(path, config)
    return TIMM_CONFIG


def _meta(model: str, trained: Trained, ema: bool) -> dict[str, Any]:
    """model.json but its files: what the weights are, where they came from."""
    again = (Path(model) / EXPORT_JSON).is_file()  # an export exported again keeps what it said
    return {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "model": trained.name,
        "classes": list(trained.classes),
        "inputs": trained.inputs.to_dict(),
        "ema": ema or bool(again and trained.record.get("ema")),
        "run": trained.record.get("run", {}) if again else _run_of(model),
        "config": trained.config,
        "weights": trained.record.get("weights", {}) if again else trained.record,
        "raywds": metadata.version("raywds"),
        "torch": torch.__version__,
    }


def _run_of(model: str) -> dict[str, Any]:
    """The run the checkpoint at `model` belongs to (its folder, or the folder above its best/) and
    that run's last and best validation numbers."""
    from raywds.runs import files
    from raywds.runs.checkpoint import checkpoint_file
    from raywds.runs.rows import epochs, read_rows

    file = checkpoint_file(model).resolve()
    run = next((d for d in (file.parent, file.parent.parent) if (d / files.METRICS).is_file()), None)
    record: dict[str, Any] = {"path": str(run or file.parent), "checkpoint": str(file)}
    if run is None:
        return record
    validation: dict[str, Any] = {}
    try:
        rows = [r for r in epochs(read_rows(run / files.METRICS)) if "val_top1" in r]
        if rows:
            validation["last"] = _numbers(rows[-1])
        if (run / files.BEST_ROW).is_file():
            validation["best"] = _numbers(json.loads((run / files.BEST_ROW).read_text()))
    except (OSError, ValueError, KeyError) as e:  # the weights matter; the numbers are a note
        log.warning("%s cannot be read (%s): model.json holds no validation numbers", run / files.METRICS, e)
    record["validation"] = validation
    return record


def _numbers(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k in VALIDATION or k.startswith("val_")}


def _read_back(folder: Path, module: nn.Module, ema: nn.Module | None) -> None:
    """The export as load_trained reads it holds exactly the weights it was written from."""
    again = load_trained(str(folder))
    for wrote, read in ((module, again.model), (ema, again.ema)):
        if wrote is None:
            continue
        theirs = read.state_dict() if read is not None else {}
        for key, value in wrote.state_dict().items():
            if key not in theirs or not torch.equal(value.cpu(), theirs[key]):
                raise StorageError(f"export {folder}: {key} reads back other than it was written; export again")


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
    sync_path(path)


def _place(tmp: Path, out: Path, force: bool) -> None:
    """The whole export renamed to `out`; an export there before (--force) or an empty folder goes."""
    sync_path(tmp)
    _check_out(out, force)  # again: another export may have been placed there meanwhile
    if not out.exists():
        tmp.rename(out)
        return
    old = out.with_name(f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.old")
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
