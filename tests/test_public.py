"""The package's public names (raywds/__init__.py): what the README's Python example and the
Lightning example use, loaded only when asked for."""

from __future__ import annotations

import ast
import subprocess
import sys
import types
from pathlib import Path

import raywds

ROOT = Path(__file__).resolve().parents[1]


def test_import_raywds_loads_neither_torch_nor_ray_nor_lightning() -> None:
    script = "import sys, raywds; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray', 'lightning'}))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-2000:]


def test_every_public_name_is_what_it_names_however_often_it_is_read() -> None:
    """No public name is also a subpackage's: once `raywds.train.trainer` is imported, Python sets
    `raywds.train` to the subpackage, so a public `raywds.train` function turned into a module on
    its second read. (It did: the public name is `fit`.)"""
    import raywds.launch.ray_train
    import raywds.train.trainer

    first = {name: getattr(raywds, name) for name in raywds.__all__}
    assert {name for name, value in first.items() if isinstance(value, types.ModuleType)} == set()
    assert {name: getattr(raywds, name) for name in raywds.__all__} == first
    assert not any((ROOT / "raywds" / name).exists() for name in raywds.__all__)


def test_the_lightning_example_uses_only_the_public_names() -> None:
    tree = ast.parse((ROOT / "examples" / "lightning_imagenet.py").read_text())
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("raywds."):
            inner.add(node.module)
        elif isinstance(node, ast.Import):
            inner |= {a.name for a in node.names if a.name.startswith("raywds.")}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "raywds":
            assert node.attr in raywds.__all__, node.attr
    assert inner == set()
