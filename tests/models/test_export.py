"""`raywds export`: an export that load_trained reads back to the same model, model.json's account of
it, the folder written whole or not at all, an ONNX file run by the real onnxruntime on the run's
validation images (and refused with one wrong weight), timm's own loaders on a timm model's export,
and one line for each bad input."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
import timm
import torch
from onnx import numpy_helper
from support.runs import small_config

import raywds
from raywds.cli.main import main
from raywds.data.manifest import read_manifest
from raywds.errors import ConfigError, StorageError
from raywds.launch.local import run_local
from raywds.loader.loader import val_loader
from raywds.models import export as export_module
from raywds.models.export import export_model
from raywds.models.onnxfile import (
    EXAMPLE_BATCH,
    TOLERANCE,
    CheckData,
    CheckImages,
    check_config,
    check_manifest,
    check_onnx,
    validation_images,
)
from raywds.models.trained import Inputs, Trained, load_trained
from raywds.runs.checkpoint import load_checkpoint
from raywds.train.compute import Compute
from raywds.train.config import TrainConfig
from raywds.world import World

CLI_LINE = "raywds: exported demo (10 classes) to {out}: model.safetensors, model_ema.safetensors, model.json"


@pytest.fixture(scope="module")
def run(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One epoch of the demo model, with an --model-ema average beside its weights."""
    out = tmp_path_factory.mktemp("export") / "run"
    run_local(small_config(shards, epochs=1, model_ema=True, out=str(out)))
    return out


@pytest.fixture(scope="module")
def with_onnx(run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The run exported with --onnx, checked on the run's own val split (50 images); what it printed."""
    out = tmp_path_factory.mktemp("onnx") / "export"
    return out, export_model(str(run), out, onnx=CheckImages()).lines()


@pytest.fixture
def raywds_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    def ran(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["export", *args])
        said = capsys.readouterr()
        return code, said.out, said.err

    return ran


def images(seed: int = 0, batch: int = 5) -> torch.Tensor:
    return torch.randn(batch, 3, 28, 28, generator=torch.Generator().manual_seed(seed))


def test_an_export_reads_back_as_the_same_model(run: Path, tmp_path: Path, raywds_cli: Callable[..., tuple]) -> None:
    out = tmp_path / "exports" / "demo"
    code, said, _ = raywds_cli(str(run), "--out", str(out))
    assert (code, said) == (0, CLI_LINE.format(out=out) + "\n")
    trained, again = load_trained(str(run)), load_trained(str(out))
    assert again.ema is not None and trained.ema is not None
    with torch.no_grad():
        assert torch.equal(again.model(images()), trained.model(images()))
        assert torch.equal(again.ema(images()), trained.ema(images()))
        assert not torch.equal(again.ema(images()), again.model(images()))  # the average, not the weights twice
    assert (again.name, again.classes, again.inputs, again.config) == (
        trained.name,
        trained.classes,
        trained.inputs,
        trained.config,
    )
    assert sorted(p.name for p in tmp_path.joinpath("exports").iterdir()) == ["demo"]  # no temp folder left
    for file in out.iterdir():
        assert file.stat().st_mode & 0o044 == 0o044 & ~_umask(), f"{file.name} is readable as the umask allows"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_model_json_says_what_the_model_is_and_where_it_came_from(run: Path, tmp_path: Path) -> None:
    export_model(str(run / "best"), tmp_path / "best")
    meta = json.loads((tmp_path / "best" / "model.json").read_text())
    state = load_checkpoint(str(run / "best"))
    epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"epoch"' in line]
    numbers = {k: v for k, v in epochs[-1].items() if k.startswith("val_") or k in ("epoch", "step")}
    assert numbers["val_top1"] == epochs[-1]["val_top1"] and "val_top1_ema" in numbers
    assert meta["format"] == "raywds-export" and meta["version"] == 1 and meta["raywds"] == raywds.__version__
    assert meta["model"] == "demo" and meta["ema"] is False
    assert meta["classes"] == read_manifest(str(state["config"]["data"]["data"])).classes == state["classes"]
    assert meta["inputs"] == Inputs(32, 28, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)).to_dict()
    assert meta["config"] == state["config"] and meta["weights"] == state["weights"] == {"model": "demo"}
    assert meta["run"] == {
        "path": str(run),
        "checkpoint": str(run / "best" / "checkpoint.pt"),
        "validation": {"last": numbers, "best": numbers},  # one epoch: the last is the best
    }
    assert sorted(meta["files"]) == ["model.safetensors", "model_ema.safetensors"]
    for name, said in meta["files"].items():
        data = (tmp_path / "best" / name).read_bytes()
        assert said == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def test_ema_exports_the_average_as_the_weights(run: Path, tmp_path: Path, raywds_cli: Callable[..., tuple]) -> None:
    out = tmp_path / "ema"
    assert raywds_cli(str(run), "--out", str(out), "--ema")[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "model.safetensors"]
    again, average = load_trained(str(out)), load_trained(str(run)).ema
    assert again.ema is None and json.loads((out / "model.json").read_text())["ema"] is True
    assert average is not None
    with torch.no_grad():
        assert torch.equal(again.model(images()), average(images()))
    assert raywds_cli(str(out), "--out", str(tmp_path / "twice"), "--ema")[1:] == (
        "",
        f"raywds: error: --ema: export {out} holds no --model-ema average beside its weights; export without --ema\n",
    )


def test_an_export_in_out_is_replaced_only_with_force_and_nothing_else_ever(
    run: Path, tmp_path: Path, raywds_cli: Callable[..., tuple]
) -> None:
    out = tmp_path / "out"
    assert raywds_cli(str(run), "--out", str(out))[0] == 0
    assert raywds_cli(str(run), "--out", str(out), "--ema")[1:] == (
        "",
        f"raywds: error: --out {out} already holds an export: give another folder, or --force to replace it\n",
    )
    assert json.loads((out / "model.json").read_text())["ema"] is False  # untouched
    assert raywds_cli(str(run), "--out", str(out), "--ema", "--force")[0] == 0
    assert json.loads((out / "model.json").read_text())["ema"] is True and not (out / "model_ema.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old export gone, no temp folder left
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert raywds_cli(str(run), "--out", str(tmp_path / "mine"), "--force")[1:] == (
        "",
        f"raywds: error: --out {tmp_path / 'mine'} holds other files, not an export: give a new or empty folder\n",
    )
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    assert raywds_cli(str(run), "--out", str(tmp_path / "empty"))[0] == 0  # an empty folder is taken


def test_the_onnx_file_agrees_with_the_model_on_the_runs_validation_images(
    run: Path, with_onnx: tuple[Path, list[str]]
) -> None:
    out, said = with_onnx
    check = json.loads((out / "model.json").read_text())["onnx"]["check"]
    assert said[1] == (
        f"raywds: onnx: max |logit difference| {check['max_abs_diff']:.2g}, "
        "top-1 agreement 50/50 (1.000) on 50 validation images"
    )
    assert check["batch_sizes"] == [32, 18] and EXAMPLE_BATCH not in check["batch_sizes"]  # the dynamic axis ran
    assert check["passed"] and check["max_abs_diff"] <= TOLERANCE
    session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.shape for i in session.get_inputs()] == [["batch", 3, 28, 28]]
    trained = load_trained(str(out))
    manifest, cfg = _data(trained)
    batch = next(validation_images(manifest, cfg, 7))
    raw = next(iter(val_loader(manifest, cfg.loader(), World())))
    run_cfg = TrainConfig.from_dict(trained.config)
    assert torch.equal(batch, Compute.for_run(run_cfg, "cpu").inputs(raw.images, raw.labels)[0][:7])  # as training's
    for size in (1, 7):  # a batch of one too: predict's smallest
        got = session.run(None, {"images": batch[:size].numpy()})[0]
        with torch.no_grad():
            expected = trained.model(batch[:size]).numpy()
        assert got.shape == (size, 10) and np.abs(got - expected).max() < 1e-4


def _data(trained: Trained) -> tuple[Any, CheckData]:
    """The run's val split, as the check reads it."""
    check = check_config(trained, CheckImages())
    return check_manifest(check.source, given=False), check


def _one_weight_changed(path: Path, into: Path, name: str = "head.2.bias", by: float = 0.01) -> Path:
    """The ONNX file with element 0 of the initializer `name` moved by `by`."""
    model = onnx.load(str(path))
    (tensor,) = [t for t in model.graph.initializer if t.name == name]
    value = numpy_helper.to_array(tensor).copy()
    value.flat[0] += by
    tensor.CopyFrom(numpy_helper.from_array(value, name))
    onnx.save(model, str(into))
    return into


def test_the_check_refuses_an_onnx_file_with_one_wrong_weight(
    with_onnx: tuple[Path, list[str]], tmp_path: Path
) -> None:
    """One class's bias moved by 0.01: each image's logit for it is 0.01 off, ten times the tolerance."""
    out, _ = with_onnx
    trained = load_trained(str(out))
    good = check_onnx(out / "model.onnx", trained.model, validation_images(*_data(trained), 50))
    bad = check_onnx(
        _one_weight_changed(out / "model.onnx", tmp_path / "bad.onnx"),
        trained.model,
        validation_images(*_data(trained), 50),
    )
    assert good.passed and good.images == bad.images == 50
    assert not bad.passed and bad.max_diff == pytest.approx(0.01, rel=1e-3)


def test_an_export_whose_onnx_file_fails_the_check_keeps_it_aside_and_exits_1(
    run: Path,
    with_onnx: tuple[Path, list[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    raywds_cli: Callable[..., tuple],
) -> None:
    """An exporter that writes torch.onnx's file for this model with one weight wrong."""

    def faulty(model: torch.nn.Module, path: Path, crop: int) -> dict:
        _one_weight_changed(with_onnx[0] / "model.onnx", path, by=1.0)
        return {"opset": 20}

    monkeypatch.setattr(export_module, "write_onnx", faulty)
    out = tmp_path / "out"
    code, said, err = raywds_cli(str(run), "--out", str(out), "--onnx", "--check-images", "20")
    assert code == 1 and said == ""
    assert err.startswith("raywds: error: onnx: max |logit difference| 1, top-1 agreement ")
    assert err.endswith(
        f" on 20 validation images: over the tolerance (|difference| at most 0.001 and every top-1 the same), so the "
        f"file is {out}/model.onnx.rejected, not model.onnx, beside the rest of the export; torch.onnx "
        f"(torch {torch.__version__}) and onnxruntime ({onnxruntime.__version__}) do not compute this model: use "
        "model.safetensors, or another torch or onnxruntime\n"
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "model.json",
        "model.onnx.rejected",
        "model.safetensors",
        "model_ema.safetensors",
    ]
    meta = json.loads((out / "model.json").read_text())
    assert meta["onnx"]["file"] == "model.onnx.rejected" and meta["onnx"]["check"]["passed"] is False
    with torch.no_grad():
        assert torch.equal(load_trained(str(out)).model(images()), load_trained(str(run)).model(images()))


def test_onnx_data_that_cannot_be_read_is_one_line_before_anything_is_written(
    run: Path, tmp_path: Path, raywds_cli: Callable[..., tuple]
) -> None:
    code, _, err = raywds_cli(str(run), "--out", str(tmp_path / "out"), "--onnx", "--data", str(tmp_path / "none"))
    assert code == 1 and err.startswith("raywds: error: ") and str(tmp_path / "none") in err
    assert err.count("\n") == 1 and list(tmp_path.iterdir()) == []


def test_onnx_without_onnxruntime_says_how_to_install_it(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raywds_cli: Callable[..., tuple]
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now raises ImportError
    assert raywds_cli(str(run), "--out", str(tmp_path / "out"), "--onnx")[1:] == (
        "",
        "raywds: error: --onnx needs onnx, onnxruntime and onnxscript (onnxruntime is not installed): "
        "pip install 'raywds[onnx]'\n",
    )
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_export_is_one_line(run: Path, tmp_path: Path, raywds_cli: Callable[..., tuple]) -> None:
    good = tmp_path / "good"
    export_model(str(run), good)

    def damaged(name: str, change: Callable[[Path], None]) -> Path:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        change(folder)
        return folder

    def flip_last_byte(path: Path) -> None:  # inside the last tensor's data: safetensors still reads it
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))

    json_cut = damaged("json", lambda f: (f / "model.json").write_text('{"format": "raywds-export", "mod'))
    weights_cut = damaged("cut", lambda f: (f / "model.safetensors").write_bytes(b"\x10\x00"))
    flipped = damaged("flipped", lambda f: flip_last_byte(f / "model_ema.safetensors"))
    newer = damaged("newer", lambda f: _edit_json(f / "model.json", version=2))
    with pytest.raises(StorageError, match=rf"^export {json_cut}: model.json is damaged \(Unterminated string"):
        load_trained(str(json_cut))
    with pytest.raises(StorageError, match=rf"^export {weights_cut}: model.safetensors is damaged or missing \("):
        load_trained(str(weights_cut))
    with pytest.raises(
        StorageError,
        match=rf"^export {flipped}: model_ema.safetensors is damaged or missing "
        r"\(its sha256 is not the [0-9a-f]{12}\.\.\. model.json gives; export again\)$",
    ):
        load_trained(str(flipped))
    with pytest.raises(StorageError, match=r"is format version 2, and this raywds reads up to 1: upgrade raywds$"):
        load_trained(str(newer))
    code, _, err = raywds_cli(str(flipped), "--out", str(tmp_path / "again"))
    assert code == 1 and err.startswith(f"raywds: error: export {flipped}: model_ema.safetensors is damaged")
    assert err.count("\n") == 1 and not (tmp_path / "again").exists()


def _edit_json(path: Path, **values: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def test_a_model_that_is_not_a_raywds_run_is_one_line(
    with_onnx: tuple[Path, list[str]], tmp_path: Path, raywds_cli: Callable[..., tuple]
) -> None:
    model_is = "give a run folder, RUN/best, a checkpoint.pt or an export folder (model.json, model.safetensors)"
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"\xff\xd8")
    torch.save({"weights": torch.zeros(3)}, tmp_path / "other.pt")
    onnx_file = with_onnx[0] / "model.onnx"
    for model, line in [
        (
            tmp_path / "photos",
            f"{tmp_path / 'photos'} is not a raywds run, checkpoint or export: it holds neither "
            f"checkpoint.pt nor model.json; {model_is}",
        ),
        (
            tmp_path / "nowhere",
            f"{tmp_path / 'nowhere'} is not a raywds run, checkpoint or export: it does not exist; {model_is}",
        ),
        (onnx_file, f"{onnx_file} is an ONNX file, which raywds does not run: {model_is}"),
        (
            tmp_path / "other.pt",
            f"checkpoint {tmp_path / 'other.pt'} is not a raywds checkpoint (no model state in it)",
        ),
    ]:
        assert raywds_cli(str(model), "--out", str(tmp_path / "out"))[1:] == ("", f"raywds: error: {line}\n")
    with pytest.raises(ConfigError, match="is an ONNX file"):  # as evaluate and predict are given it
        load_trained(str(onnx_file))
    assert not (tmp_path / "out").exists()


def test_a_timm_models_export_loads_in_timm_with_the_same_logits(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = small_config(shards, model="timm/test_resnet", epochs=1, batches_per_epoch=2, out=str(tmp_path / "run"))
    run_local(cfg)
    out = tmp_path / "export"
    assert export_model(str(tmp_path / "run"), out).files == ["model.safetensors", "config.json", "model.json"]
    trained = load_trained(str(out))
    classes = trained.classes
    with torch.no_grad():
        expected = trained.model(images())
        overlay = dict(file=str(out / "model.safetensors"), num_classes=len(classes))
        by_file = timm.create_model("test_resnet", pretrained=True, pretrained_cfg_overlay=overlay, num_classes=10)
        by_folder = timm.create_model(f"local-dir:{out}", pretrained=True)
        assert torch.equal(by_file.eval()(images()), expected)
        assert torch.equal(by_folder.eval()(images()), expected)
    said = by_folder.pretrained_cfg
    assert said["label_names"] == classes and said["num_classes"] == len(classes)
    assert timm.data.resolve_data_config({}, model=by_folder) == {
        "input_size": (3, 28, 28),
        "interpolation": "bilinear",
        "mean": list(trained.inputs.mean),
        "std": list(trained.inputs.std),
        "crop_pct": 28 / 32,
        "crop_mode": "center",
    }
