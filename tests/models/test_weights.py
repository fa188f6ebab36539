"""Models by name from their sources, and the weights they start from: the library's pretrained
ones through its own cache (a Hub cache laid out here, offline), files, and raywds runs."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub.constants
import pytest
import timm
import torch
from safetensors.torch import save_file
from support import hubcache

from raywds.errors import ConfigError, StorageError
from raywds.models import sources
from raywds.models.start import start_model
from raywds.models.weights import IMAGENET, initial, preprocessing_of
from raywds.train.model import build_model

CLASSES = [f"n{i:08d}" for i in range(7)]
REPO = "timm/test_resnet.r160_in1k"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, offline (as HF_HOME and HF_HUB_OFFLINE=1 make it)."""
    home = tmp_path / "hf"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HOME", str(home))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("RAYWDS_WEIGHTS_CACHE", str(tmp_path / "weights-cache"))
    return home


def published(seed: int = 1, num_classes: int = 1000) -> dict[str, torch.Tensor]:
    """What the Hub would hold for test_resnet.r160_in1k: its weights at 1,000 classes."""
    torch.manual_seed(seed)
    return timm.create_model("test_resnet", num_classes=num_classes).state_dict()


def test_the_table_holds_each_source_and_each_parses_its_own_names() -> None:
    assert list(sources.SOURCES) == ["demo", "timm", "torchvision"]
    spelled = {"demo": "demo", "timm": "timm/test_vit.r160_in1k", "torchvision": "resnet50.IMAGENET1K_V2"}
    assert set(spelled) == set(sources.SOURCES)  # a new source needs a name here
    for name, text in spelled.items():
        parsed = sources.parse_model(text)
        assert parsed.source is sources.SOURCES[name] and str(parsed) == text
        assert parsed.source.build(parsed, 3)(torch.zeros(2, 3, 32, 32)).shape == (2, 3)


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("resnet7", "unknown model 'resnet7'; did you mean resnet50 or resnet34 or resnet18?"),
        ("timm/convnxt_tiny", "unknown model 'timm/convnxt_tiny'; did you mean timm/convnext_tiny"),
        (
            "resnet50.IMAGENET1K_V9",
            "torchvision has no weights 'IMAGENET1K_V9' for resnet50 (it has: IMAGENET1K_V1, IMAGENET1K_V2)",
        ),
        ("timm/test_resnet.in22k", "timm has no weights 'in22k' for test_resnet (it has: r160_in1k)"),
    ],
)
def test_an_unknown_name_or_tag_is_one_line_with_the_closest(name: str, said: str) -> None:
    with pytest.raises(ConfigError) as e:
        build_model(name, 3)
    assert str(e.value).startswith(said) and "\n" not in str(e.value)


def test_a_timm_name_without_timm_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm now raises ImportError
    with pytest.raises(
        ConfigError, match=r"timm models need timm, which is not installed: pip install 'raywds\[timm\]'"
    ):
        build_model("timm/test_resnet", 3)
    assert build_model("resnet18", 3) is not None  # torchvision's names need no timm


def test_pretrained_timm_weights_load_from_the_hub_cache_offline_with_only_the_head_new(hub: Path) -> None:
    weights = published()
    hubcache.put(hub, REPO, weights)
    start = start_model(f"{REPO}", CLASSES, pretrained=True)
    loaded = start.model.state_dict()
    for key, value in weights.items():
        if key.startswith("fc."):
            assert loaded[key].shape[0] == len(CLASSES)  # the head: new, for the data's classes
        else:
            assert torch.equal(loaded[key], value), key  # the backbone: exactly the file's
    assert start.fit is not None and start.fit.action == "replaced" and start.fit.layer == "fc"
    assert start.lines() == [
        f"model {REPO} from timm {REPO} (sha256 {start.weights.sha256[:12]}); the classifier fc replaced: "  # type: ignore[union-attr]
        "1000 classes in the weights, 7 in the data, newly initialised"
    ]
    assert start.record()["preprocessing"] == {
        "mean": [0.5] * 3,
        "std": [0.5] * 3,
        "crop_pct": 0.95,
        "interpolation": "bilinear",
    }


def test_an_empty_hub_cache_offline_is_one_line_saying_where_and_how_to_fill_it(hub: Path) -> None:
    began = time.monotonic()
    with pytest.raises(ConfigError) as e:
        start_model(REPO, CLASSES, pretrained=True)
    said = str(e.value)
    assert time.monotonic() - began < 5  # no retries against a network that is not there
    assert said.startswith(
        f"--pretrained: {REPO} is not in the Hugging Face cache ({hub}/hub/models--timm--test_resnet"
    )
    assert f"`hf download {REPO}`" in said and "HF_HUB_OFFLINE" in said and "\n" not in said


def test_an_empty_hub_cache_with_the_hub_unreachable_is_one_line_at_once(
    hub: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    began = time.monotonic()
    with pytest.raises(ConfigError) as e:
        start_model(REPO, CLASSES, pretrained=True)
    assert time.monotonic() - began < 8  # one connection, not the Hub client's minute of retries
    said = str(e.value)
    cache = hub / "hub" / "models--timm--test_resnet.r160_in1k"
    assert f"is not in the Hugging Face cache ({cache}) and http://127.0.0.1:9 cannot be reached" in said
    assert "\n" not in said


def test_an_empty_torch_cache_without_network_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))

    def unreachable(*args: object, **kwargs: object) -> bytes:
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr("raywds.data.stores.Storage.read", unreachable)
    with pytest.raises(ConfigError) as e:
        start_model("resnet18", CLASSES, pretrained=True)
    said = str(e.value)
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    assert said.startswith(
        f"--pretrained: torchvision's ResNet18_Weights.IMAGENET1K_V1 are not in the cache ({cache}/resnet18-"
    )
    assert "download https://download.pytorch.org/models/resnet18-" in said and "\n" not in said


def test_torchvision_weights_in_the_torch_cache_load_with_their_preprocessing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import torchvision

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    torch.manual_seed(0)
    weights = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    source = torchvision.models.resnet18(num_classes=1000).state_dict()
    cached = tmp_path / "torch" / "hub" / "checkpoints" / Path(weights.url).name
    cached.parent.mkdir(parents=True)
    torch.save(source, cached)
    start = start_model("resnet18", CLASSES, pretrained=True)
    assert torch.equal(start.model.state_dict()["layer4.1.conv2.weight"], source["layer4.1.conv2.weight"])
    assert start.fit is not None and (start.fit.layer, start.fit.before, start.fit.after) == ("fc", 1000, 7)
    assert start.preprocessing == preprocessing_of(sources.parse_model("resnet18"))
    assert start.preprocessing is not None and start.preprocessing.crop_pct == pytest.approx(224 / 256)


def test_initial_weights_from_safetensors_and_a_state_dict_file(tmp_path: Path) -> None:
    source = published(num_classes=7)
    save_file(source, str(tmp_path / "w.safetensors"))
    torch.save({"state_dict": {f"module.{k}": v for k, v in source.items()}}, tmp_path / "w.pth")  # timm's, under DDP
    for path in (tmp_path / "w.safetensors", tmp_path / "w.pth"):
        start = start_model("timm/test_resnet", CLASSES, initial_checkpoint=str(path))
        assert all(torch.equal(start.model.state_dict()[k], v) for k, v in source.items())
        assert start.fit is not None and start.fit.action == "kept"


def test_bad_weight_files_are_one_line_each(tmp_path: Path) -> None:
    class Planted:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    (tmp_path / "code.pth").write_bytes(pickle.dumps({"fc.weight": Planted()}))
    buffer = io.BytesIO()
    save_file(published(num_classes=7), str(tmp_path / "whole.safetensors"))
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "whole.safetensors").read_bytes()[:5000])
    torch.save(timm.create_model("test_vit", num_classes=7).state_dict(), buffer)
    (tmp_path / "vit.pt").write_bytes(buffer.getvalue())
    cases = {
        "code.pth": (StorageError, "holds Python objects beside its tensors: not loaded, as it could run code"),
        "cut.safetensors": (StorageError, "is damaged or not safetensors"),
        "missing.pt": (ConfigError, "no weights file at"),
        "vit.pt": (
            ConfigError,
            "do not fit this --model: .* missing \\(conv1.0.weight, .*are they of another architecture\\?",
        ),
    }
    for name, (kind, said) in cases.items():
        with pytest.raises(kind, match=said) as e:
            start_model("timm/test_resnet", CLASSES, initial_checkpoint=str(tmp_path / name))
        assert "\n" not in str(e.value)


def test_a_remote_weights_file_is_fetched_once_into_the_node_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raywds.data import stores

    monkeypatch.setenv("RAYWDS_WEIGHTS_CACHE", str(tmp_path / "cache"))
    source = published(num_classes=7)
    save_file(source, str(tmp_path / "w.safetensors"))
    reads: list[str] = []

    def read(storage: stores.Storage, where: str, timeout_s: float = 30.0) -> bytes:
        reads.append(where)
        return (tmp_path / "w.safetensors").read_bytes()

    monkeypatch.setattr(stores.Storage, "read", read)
    for _ in range(2):
        loaded = initial("http://weights.example/w.safetensors")
        assert torch.equal(loaded.state["fc.weight"], source["fc.weight"])
    assert reads == ["http://weights.example/w.safetensors"]


def test_preprocessing_defaults_are_imagenets_without_weights() -> None:
    assert preprocessing_of(sources.parse_model("demo")) is None
    assert IMAGENET.mean == (0.485, 0.456, 0.406) and IMAGENET.crop_pct == 0.875


@pytest.mark.slow
def test_raywds_train_fine_tunes_from_a_hub_cache_offline(shards: Path, tmp_path: Path) -> None:
    """The CLI, in a fresh process with HF_HOME and HF_HUB_OFFLINE=1 set before anything imports
    huggingface_hub: the weights' preprocessing is the run's, and the checkpoint records them."""
    path = hubcache.put(tmp_path / "hf", REPO, published())
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "raywds", "train", "--data", str(shards), "--model", REPO, "--pretrained"]
        + [
            "--epochs",
            "1",
            "--batch-size",
            "16",
            "--image-size",
            "32",
            "--loader-workers",
            "1",
            "--out",
            str(tmp_path / "run"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert (
        "the classifier fc replaced: 1000 classes in the weights, 10 in the data, newly initialised"
        in run.stderr + run.stdout
    )
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["weights"]["source"] == f"timm {REPO}"
    assert state["weights"]["sha256"] == __import__("hashlib").sha256(path.read_bytes()).hexdigest()
    assert state["config"]["loader"]["mean"] == "0.5,0.5,0.5" and state["config"]["loader"]["crop_pct"] == 0.95
