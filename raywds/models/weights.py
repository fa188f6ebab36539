"""Weights to start from, and the preprocessing they were trained with.

- `pretrained(name)`: the library's own weights for a --model name (torchvision's weights enum,
  timm's tags on the Hugging Face Hub), read through the library's own cache (TORCH_HOME,
  HF_HOME; HF_HUB_OFFLINE=1 never asks the network). An empty cache with no network is one line
  that says where raywds looked and how to fill it.
- `initial(path)`: --initial-checkpoint: a `.safetensors` file, a `.pth`/`.pt` state dict (read
  with `weights_only`), or a raywds run folder or checkpoint (its weights and EMA; not its
  optimizer, position or epochs), from a path, s3://, gs:// or http(s)://.

Whatever a node fetches it keeps in a cache folder (RAYWDS_WEIGHTS_CACHE, else
~/.cache/raywds/weights) under an exclusive file lock: the ranks of one node read the network once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pickle
import socket
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raywds.data import stores
from raywds.data.stores import Storage
from raywds.errors import ConfigError, StorageError
from raywds.loader.settings import rgb
from raywds.models.sources import ModelName, Timm, TorchVision

HUB_PROBE_S = 5.0
"""How long to wait for the Hugging Face Hub to answer before saying it cannot be reached."""
FETCH_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Preprocessing:
    """How images were normalised and cropped for the weights (timm's data config's names)."""

    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    crop_pct: float = 0.875
    """The validation centre crop's side over the resized short side."""
    interpolation: str = "bilinear"

    def to_dict(self) -> dict[str, Any]:
        return {
            "mean": list(self.mean),
            "std": list(self.std),
            "crop_pct": self.crop_pct,
            "interpolation": self.interpolation,
        }


IMAGENET = Preprocessing()
"""torchvision's and raywds's defaults."""


@dataclass
class Weights:
    """A state dict to start from, and what it is."""

    state: dict[str, torch.Tensor]
    source: str
    """What the weights are, in words: `torchvision ResNet50_Weights.IMAGENET1K_V2`, a file's URL."""
    sha256: str
    """Of the file they were read from."""
    classes: list[str] | None = None
    """The class names of a raywds checkpoint's outputs (None: not known)."""
    ema: dict[str, torch.Tensor] | None = None
    """A raywds checkpoint's --model-ema average."""
    preprocessing: Preprocessing | None = None
    """The weights' own preprocessing, where the library publishes it."""
    config: dict[str, Any] = field(default_factory=dict)
    """A raywds checkpoint's run config."""

    def record(self) -> dict[str, Any]:
        """What a checkpoint and a tracking run keep of them."""
        record: dict[str, Any] = {"source": self.source, "sha256": self.sha256}
        if self.preprocessing is not None:
            record["preprocessing"] = self.preprocessing.to_dict()
        return record


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_root() -> Path:
    return Path(os.environ.get("RAYWDS_WEIGHTS_CACHE") or Path.home() / ".cache" / "raywds" / "weights")


@contextlib.contextmanager
def node_once(path: Path) -> Iterator[None]:
    """Hold an exclusive lock beside `path` while it is filled: the other ranks of a node wait,
    then find it there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_file(path: Path, named: str) -> dict[str, Any]:
    """A .safetensors file or a torch.save'd dict, loaded without running code."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as e:
            raise StorageError(f"weights file {named} is damaged or not safetensors ({_first_line(e)})") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise StorageError(f"weights file {named} is damaged ({_first_line(e)})") from None
        raise StorageError(
            f"weights file {named} holds Python objects beside its tensors: not loaded, as it could run code; "
            "save the state dict alone (torch.save(model.state_dict(), PATH)) or as .safetensors"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise StorageError(f"weights file {named} is damaged or cut short ({_first_line(e)})") from None
    if not isinstance(state, dict):
        raise StorageError(f"weights file {named} holds a {type(state).__name__}, not a state dict")
    return state


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:160] if lines else type(e).__name__


def _state_dict_in(loaded: dict[str, Any], named: str) -> dict[str, torch.Tensor]:
    """The state dict in a loaded file: the file itself, or under `state_dict`/`model` (timm's and
    torchvision's training checkpoints), with DDP's `module.` prefix dropped."""
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(loaded.get(key), dict):
            loaded = loaded[key]
            break
    tensors = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise StorageError(f"weights file {named} holds no tensors")
    if all(k.startswith("module.") for k in tensors):
        tensors = {k[len("module.") :]: v for k, v in tensors.items()}
    return tensors


def _fetched(url: str, storage: Storage) -> Path:
    """A remote file, fetched once per node into the weights cache."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    name = Path(urllib.parse.urlparse(url).path).name or "weights"
    path = cache_root() / f"{digest}-{name}"
    with node_once(path):
        if not path.is_file():
            try:
                data = storage.read(url, timeout_s=FETCH_TIMEOUT_S)
            except FileNotFoundError:
                raise ConfigError(f"no weights at {url} (--initial-checkpoint)") from None
            except OSError as e:
                raise StorageError(f"cannot read weights {url}: {_first_line(e)}") from None
            stores.write_atomic(path, data)
    return path


def initial(where: str, storage: Storage = Storage()) -> Weights:
    """--initial-checkpoint: the weights (and EMA) in a file, a raywds checkpoint or run folder."""
    local = Path(stores.local_path(where)) if not stores.is_url(where) else _fetched(where, storage)
    if local.is_dir():
        from raywds.runs.checkpoint import checkpoint_file

        local = checkpoint_file(str(local))
    if not local.is_file():
        raise ConfigError(
            f"no weights file at {where} (--initial-checkpoint): give a .safetensors, .pth or .pt file, or a raywds run"
        )
    loaded = _read_file(local, where)
    sha = sha256_of(local)
    if "model" in loaded and "classes" in loaded and isinstance(loaded.get("model"), dict):  # a raywds checkpoint
        config = loaded.get("config") if isinstance(loaded.get("config"), dict) else {}
        started = loaded.get("weights", {}) if isinstance(loaded.get("weights"), dict) else {}
        prep = started.get("preprocessing")
        return Weights(
            state=_state_dict_in(loaded["model"], where),
            source=f"raywds checkpoint {where}",
            sha256=sha,
            classes=list(loaded["classes"]),
            ema=loaded.get("model_ema"),
            preprocessing=_preprocessing(prep) if isinstance(prep, dict) else _configured(config or {}),
            config=dict(config or {}),
        )
    return Weights(state=_state_dict_in(loaded, where), source=f"file {where}", sha256=sha)


def _preprocessing(d: dict[str, Any]) -> Preprocessing:
    return Preprocessing(
        mean=tuple(float(x) for x in d["mean"]),  # type: ignore[arg-type]
        std=tuple(float(x) for x in d["std"]),  # type: ignore[arg-type]
        crop_pct=float(d.get("crop_pct", 0.875)),
        interpolation=str(d.get("interpolation", "bilinear")),
    )


def _configured(saved: dict[str, Any]) -> Preprocessing | None:
    """A raywds run's --mean, --std and --crop-pct (its config's loader section), where it set any."""
    config = saved.get("loader") or {}
    if config.get("mean") is None and config.get("std") is None and config.get("crop_pct") is None:
        return None
    return Preprocessing(
        mean=rgb(config.get("mean"), "mean", IMAGENET.mean),
        std=rgb(config.get("std"), "std", IMAGENET.std),
        crop_pct=float(config.get("crop_pct") or IMAGENET.crop_pct),
    )


def preprocessing_of(name: ModelName) -> Preprocessing | None:
    """The preprocessing of the weights --pretrained would load for `name`, without loading them."""
    if isinstance(name.source, TorchVision):
        meta = name.source.weights(name).transforms()
        return Preprocessing(
            mean=tuple(meta.mean),
            std=tuple(meta.std),
            crop_pct=meta.crop_size[0] / meta.resize_size[0],
            interpolation=meta.interpolation.value,
        )
    if isinstance(name.source, Timm):
        cfg = name.source.pretrained_cfg(name)
        return Preprocessing(
            mean=tuple(cfg.get("mean", IMAGENET.mean)),
            std=tuple(cfg.get("std", IMAGENET.std)),
            crop_pct=float(cfg.get("crop_pct", IMAGENET.crop_pct)),
            interpolation=str(cfg.get("interpolation", "bilinear")),
        )
    return None


def pretrained(name: ModelName) -> Weights:
    """The library's own pretrained weights for `name`, from its cache (filled once per node)."""
    if isinstance(name.source, TorchVision):
        return _torchvision(name)
    if isinstance(name.source, Timm):
        return _timm(name)
    raise ConfigError(f"--pretrained: {name.source.name} has no pretrained weights for {name}; drop --pretrained")


def _torchvision(name: ModelName) -> Weights:
    source = name.source
    assert isinstance(source, TorchVision)
    weights = source.weights(name)
    path = Path(torch.hub.get_dir()) / "checkpoints" / Path(urllib.parse.urlparse(weights.url).path).name
    with node_once(path):
        if not path.is_file():
            try:
                data = Storage().read(weights.url, timeout_s=FETCH_TIMEOUT_S)
            except OSError as e:
                raise ConfigError(
                    f"--pretrained: torchvision's {weights} are not in the cache ({path}) and cannot be downloaded "
                    f"({_first_line(e)}): on a machine with network, download {weights.url} into that folder "
                    "(TORCH_HOME/hub/checkpoints) and copy it here"
                ) from None
            stores.write_atomic(path, data)
    return Weights(
        state=_state_dict_in(_read_file(path, str(path)), str(path)),
        source=f"torchvision {weights}",
        sha256=sha256_of(path),
        preprocessing=preprocessing_of(name),
    )


def _hub_reachable(endpoint: str) -> str | None:
    """None when the Hub's host answers a TCP connection; else why not."""
    url = urllib.parse.urlparse(endpoint)
    try:
        with socket.create_connection(
            (url.hostname or "", url.port or (443 if url.scheme == "https" else 80)), HUB_PROBE_S
        ):
            return None
    except OSError as e:
        return e.strerror or str(e)


def _timm(name: ModelName) -> Weights:
    source = name.source
    assert isinstance(source, Timm)
    cfg = source.pretrained_cfg(name)
    repo = cfg.get("hf_hub_id")
    if not repo:
        raise ConfigError(
            f"--pretrained: timm's weights for {name} are not on the Hugging Face Hub; "
            "give them as --initial-checkpoint"
        )
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    filenames = ("model.safetensors", "pytorch_model.bin")
    found = [try_to_load_from_cache(repo, f) for f in filenames]
    path = next((Path(p) for p in found if isinstance(p, str)), None)
    if path is None:
        where = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
        fill = f"on a machine with network run `hf download {repo}` (HF_HOME={constants.HF_HOME}) and copy {where} here"
        if constants.HF_HUB_OFFLINE:
            raise ConfigError(
                f"--pretrained: {repo} is not in the Hugging Face cache ({where}) and HF_HUB_OFFLINE is set: {fill}"
            )
        why = _hub_reachable(constants.ENDPOINT)
        if why is not None:
            raise ConfigError(
                f"--pretrained: {repo} is not in the Hugging Face cache ({where}) and {constants.ENDPOINT} "
                f"cannot be reached ({why}): {fill}"
            )
        with node_once(where / "raywds-fetch"):
            path = Path(hf_hub_download(repo, filenames[0]))
    return Weights(
        state=_state_dict_in(_read_file(path, f"{repo} ({path})"), str(path)),
        source=f"timm {repo}",
        sha256=sha256_of(path),
        preprocessing=preprocessing_of(name),
    )
