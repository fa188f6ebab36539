"""A trained model to use: from a raywds run folder, a checkpoint, or an export (`raywds export`'s
folder: model.safetensors beside model.json), with its classes and the inputs it was validated on.
`raywds evaluate` and `raywds predict` take any of the three as MODEL.

    trained = load_trained("runs/local")          # or runs/local/best, a checkpoint.pt, an export folder
    trained.model(images), trained.classes, trained.inputs.crop
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from raywds.errors import ConfigError, StorageError
from raywds.loader.settings import Loading
from raywds.models.sources import parse_model
from raywds.models.spec import ModelSpec
from raywds.models.weights import sha256_of
from raywds.runs.files import CHECKPOINT

EXPORT_JSON = "model.json"
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_EMA = "model_ema.safetensors"
EXPORT_FORMAT = "raywds-export"
EXPORT_VERSION = 1
"""model.json's format version (raywds.models.export writes it); a later one is refused."""
MODEL_IS = "give a run folder, RUN/best, a checkpoint.pt or an export folder (model.json, model.safetensors)"


@dataclass(frozen=True)
class Inputs:
    """How images reach the model when it is evaluated: resized so the short side is `resize`,
    centre-cropped to `crop`, normalised with `mean` and `std` (0-1 scale)."""

    resize: int
    crop: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str = "bilinear"

    @classmethod
    def of(cls, cfg: Loading) -> Inputs:
        mean, std = cfg.normalisation()
        return cls(cfg.val_resize, cfg.val_crop, mean, std)

    def to_dict(self) -> dict[str, Any]:
        return {
            "resize": self.resize,
            "crop": self.crop,
            "mean": list(self.mean),
            "std": list(self.std),
            "interpolation": self.interpolation,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Inputs:
        return cls(
            int(d["resize"]), int(d["crop"]), tuple(d["mean"]), tuple(d["std"]), str(d.get("interpolation", "bilinear"))
        )


@dataclass
class Trained:
    """A model ready to evaluate (eval mode, on the CPU), its class names and inputs."""

    name: str
    """The --model name it was built as."""
    model: nn.Module
    classes: list[str]
    inputs: Inputs
    source: str
    """Where it was read from, in words."""
    ema: nn.Module | None = None
    """The --model-ema average, where the checkpoint or export holds one."""
    config: dict[str, Any] = field(default_factory=dict)
    """The run's config as it was saved (empty where unknown)."""
    record: dict[str, Any] = field(default_factory=dict)
    """What the run's checkpoint says it started from (raywds.models.start.Start.record), and an
    export's metrics."""


def _built(name: str, num_classes: int, state: dict[str, torch.Tensor], named: str) -> nn.Module:
    parsed = parse_model(name)
    model = parsed.source.build(parsed, num_classes)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise StorageError(
            f"the weights in {named} do not fit a {name}: {first[1].strip() if len(first) > 1 else first[0]}"
        ) from None
    return model.eval()


def _ema_module(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len("module.") :]: v for k, v in state.items() if k.startswith("module.")}


def load_trained(where: str) -> Trained:
    """The model in a run folder (its checkpoint.pt), a checkpoint file, or an export folder."""
    path = Path(where)
    if (path / EXPORT_JSON).is_file():
        return _export(path)
    if path.suffix == ".onnx":
        raise ConfigError(f"{where} is an ONNX file, which raywds does not run: {MODEL_IS}")
    if not path.exists() or (path.is_dir() and not (path / CHECKPOINT).is_file()):
        what = "holds neither checkpoint.pt nor model.json" if path.is_dir() else "does not exist"
        raise ConfigError(f"{where} is not a raywds run, checkpoint or export: it {what}; {MODEL_IS}")
    from raywds.runs.checkpoint import load_checkpoint

    state = load_checkpoint(where)
    if "classes" not in state or "config" not in state:
        raise StorageError(f"checkpoint {where} holds no classes or config: not one raywds wrote")
    saved = dict(state["config"])
    try:  # the two sections a trained model needs of its run's config
        spec, loading = ModelSpec(**saved["model"]), Loading(**saved["loader"])
    except (ConfigError, TypeError, KeyError) as e:
        raise StorageError(f"checkpoint {where}: its config cannot be read by this raywds ({e})") from None
    classes = list(state["classes"])
    model = _built(spec.model, len(classes), state["model"], where)
    ema = _built(spec.model, len(classes), _ema_module(state["model_ema"]), where) if "model_ema" in state else None
    record = dict(state.get("weights") or {})
    return Trained(spec.model, model, classes, Inputs.of(loading), f"checkpoint {where}", ema, saved, record)


def _export(folder: Path) -> Trained:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        meta = json.loads((folder / EXPORT_JSON).read_text())
        if not isinstance(meta, dict) or not {"model", "classes", "inputs"} <= set(meta):
            raise ValueError("no model, classes or inputs in it")
    except (OSError, ValueError) as e:
        raise StorageError(f"export {folder}: {EXPORT_JSON} is damaged ({e})") from None
    if meta.get("format") != EXPORT_FORMAT:
        raise StorageError(f"export {folder}: {EXPORT_JSON} is not a raywds export (format {meta.get('format')!r})")
    if not isinstance(meta.get("version", 1), int) or meta.get("version", 1) > EXPORT_VERSION:
        raise StorageError(
            f"export {folder}: {EXPORT_JSON} is format version {meta.get('version')!r}, and this raywds reads up to "
            f"{EXPORT_VERSION}: upgrade raywds"
        )

    def weights(name: str) -> dict[str, torch.Tensor]:
        said = (meta.get("files") or {}).get(name, {}).get("sha256")
        try:
            if said is not None and sha256_of(folder / name) != said:
                raise ValueError(f"its sha256 is not the {said[:12]}... {EXPORT_JSON} gives; export again")
            return dict(load_file(str(folder / name)))
        except (SafetensorError, OSError, ValueError) as e:
            raise StorageError(f"export {folder}: {name} is damaged or missing ({e})") from None

    classes = list(meta["classes"])
    model = _built(meta["model"], len(classes), weights(EXPORT_WEIGHTS), str(folder / EXPORT_WEIGHTS))
    ema = None
    if (folder / EXPORT_EMA).is_file():
        ema = _built(meta["model"], len(classes), weights(EXPORT_EMA), str(folder / EXPORT_EMA))
    inputs = Inputs.from_dict(meta["inputs"])
    return Trained(meta["model"], model, classes, inputs, f"export {folder}", ema, dict(meta.get("config") or {}), meta)
