"""The package's public names (raywds/__init__.py): what the README's Python example, the notebook and
the Lightning example use, loaded only when asked for; and docs/modules.md, the map of every module
and public name, kept true."""

from __future__ import annotations

import ast
import importlib
import json
import re
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


def test_the_notebook_uses_only_the_public_names() -> None:
    """notebooks/ray-demo.ipynb is the example a user copies: `import raywds` and its public names,
    and `raywds.serve` for the shard server; no module inside a part. (IPython's `!` lines are shell.)"""
    cells = json.loads((ROOT / "notebooks" / "ray-demo.ipynb").read_text())["cells"]
    code = "\n".join(
        line for c in cells if c["cell_type"] == "code" for line in "".join(c["source"]).splitlines() if line[:1] != "!"
    )
    modules, names = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("raywds"):
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules |= {a.name for a in node.names if a.name.startswith("raywds")}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "raywds":
            names.add(node.attr)
    assert modules == {"raywds", "raywds.serve"}
    assert names - set(raywds.__all__) == set()
    assert {"connect", "fit_on_ray", "follow", "resolve"} <= names


MAP = ROOT / "docs" / "modules.md"


def test_the_module_map_lists_the_public_names_and_where_each_is_from() -> None:
    """docs/modules.md's row for raywds/__init__.py: each public name, and `name` (`part.module.attr`)
    where it is defined under another name or module."""
    [row] = re.findall(r"^\| `raywds/__init__\.py` \| (.*) \|$", MAP.read_text(), re.M)
    listed = re.findall(r"`([A-Za-z_]\w*)`(?: \(`([\w.]+)`\))?", row)
    assert sorted(name for name, _ in listed) == sorted(raywds.__all__)
    for name, where in listed:
        if where:
            module, _, attr = f"raywds.{where}".rpartition(".")
            assert getattr(importlib.import_module(module), attr) is getattr(raywds, name), (name, where)


def test_the_module_map_lists_every_module_of_the_package() -> None:
    listed = set(re.findall(r"^\| `(raywds/[\w/]+\.(?:py|c))` \|", MAP.read_text(), re.M))
    present = {str(p.relative_to(ROOT)) for p in (ROOT / "raywds").rglob("*") if p.suffix in (".py", ".c")}
    assert {"missing from docs/modules.md": sorted(present - listed), "gone": sorted(listed - present)} == {
        "missing from docs/modules.md": [],
        "gone": [],
    }


def test_every_raywds_name_in_the_docs_exists() -> None:
    """`raywds.NAME` and `raywds.part.module.NAME` in the README, CONTRIBUTING.md and docs/: each a
    module, or a name one of them defines."""
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {m for page in pages for m in re.findall(r"(?<![\w/.-])raywds(?:\.[A-Za-z_]\w*)+", page.read_text())}
    assert "raywds.fit" in named and "raywds.serve" in named
    assert sorted(name for name in named if not found(name)) == []


def found(dotted: str) -> bool:
    """Whether `dotted` names a module, or what the longest module in it holds."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            held: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(held, attr):
                return False
            held = getattr(held, attr)
        return True
    return False
