"""What `raywds evaluate` must find, found by a plain loop: every sample of a split read straight
from the tars (tarfile, not raywds's reader), cropped as the model was validated, through the model
in one batch in one process; and the matrix of an evaluation's confusion.csv."""

from __future__ import annotations

import csv
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from raywds.loader.decodings import decoding
from raywds.models.trained import Trained


@dataclass
class Counted:
    """What a plain loop over every sample finds."""

    top1: int
    top5: int
    loss_sum: float
    confusion: np.ndarray


def tar_samples(folder: Path, names: list[str]) -> list[tuple[bytes, int]]:
    """(JPEG bytes, label) of every sample of the tars `names` in `folder` (`KEY.jpg`, `KEY.cls`)."""
    found = []
    for name in names:
        with tarfile.open(folder / name) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]
        for key in dict.fromkeys(member.split(".", 1)[0] for member in members):
            found.append((members[f"{key}.jpg"], int(members[f"{key}.cls"])))
    return found


def split_samples(shards: Path, split: str) -> list[tuple[bytes, int]]:
    """Every sample of the split the manifest beside the shards lists."""
    manifest = json.loads((shards / "manifest.json").read_text())
    return tar_samples(shards, [shard["name"] for shard in manifest["splits"][split]["shards"]])


def plain_loop(model: nn.Module, trained: Trained, samples: list[tuple[bytes, int]]) -> Counted:
    """Every sample through `model` in one batch: its centre crop and normalisation as `trained` says."""
    crop = decoding("cpu").val_crop(trained.inputs.crop, trained.inputs.resize)
    mean = torch.tensor([m * 255 for m in trained.inputs.mean]).view(1, 3, 1, 1)
    std = torch.tensor([s * 255 for s in trained.inputs.std]).view(1, 3, 1, 1)
    images = (torch.stack([crop(jpeg) for jpeg, _ in samples]).float() - mean) / std
    labels = torch.tensor([label for _, label in samples])
    with torch.no_grad():
        logits = model.eval()(images).float()
    top = logits.topk(5, dim=1).indices
    confusion = np.zeros((len(trained.classes),) * 2, dtype=np.int64)
    np.add.at(confusion, (labels.numpy(), top[:, 0].numpy()), 1)
    loss_sum = nn.functional.cross_entropy(logits, labels, reduction="none").double().sum().item()
    return Counted(int((top[:, 0] == labels).sum()), int((top == labels[:, None]).any(1).sum()), loss_sum, confusion)


def confusion_csv(path: Path) -> np.ndarray:
    """confusion.csv's counts (its first row and column name the classes)."""
    rows = list(csv.reader(path.open()))
    return np.array([[int(v) for v in row[1:]] for row in rows[1:]], dtype=np.int64)


def assert_same(folder: Path, counted: Counted, samples: int, *, key: str | None = None) -> dict:
    """An evaluation's folder against the plain loop: the counts and the matrix exactly, the loss to
    float rounding (`key`: the numbers metrics.json keeps under it, the EMA's beside the weights');
    its metrics.json."""
    metrics = json.loads((folder / "metrics.json").read_text())
    numbers = metrics[key] if key else metrics
    assert numbers["samples"] == samples == int(counted.confusion.sum())
    assert (numbers["correct_top1"], numbers["correct_top5"]) == (counted.top1, counted.top5)
    assert numbers["loss"] == pytest.approx(counted.loss_sum / samples, rel=1e-5)
    if key is None:
        assert np.array_equal(confusion_csv(folder / "confusion.csv"), counted.confusion)
    return metrics
