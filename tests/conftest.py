"""Shared test data: a small demo tree and its shards, made by our own generator and converter."""

from __future__ import annotations

from pathlib import Path

import pytest

from raywds.convert import ConvertOptions, convert
from raywds.demo import DemoSpec, write_tree

SMALL = DemoSpec(num_train_per_class=12, num_val_per_class=5, image_side_px=32, seed=7)


@pytest.fixture(scope="session")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 classes, 120 train and 50 val JPEGs."""
    return write_tree(tmp_path_factory.mktemp("tree"), SMALL)


@pytest.fixture(scope="session")
def shards(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tree as shards of at most 16 samples: 8 train shards (7 x 16 + 8) and 4 val shards."""
    out = tmp_path_factory.mktemp("shards")
    convert(tree, out, ConvertOptions(maxcount=16, seed=3))
    return out
