"""raywds.data, and the planning that reads its manifests, import neither torch nor webdataset
(which imports torch): about 2 s and 400 MB in every process that converts, verifies or plans,
each convert worker included. Checked in a fresh interpreter, over every module the packages
hold, so a new module is covered without a change here."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["torch", "webdataset"]
DATA_MODULES = {f"raywds.data.{name}" for name in ("manifest", "layout", "convert", "tars", "verify", "demo")}

IMPORT_ALL = """
import importlib, json, pkgutil, sys
heavy, imported, culprits = json.loads(sys.argv[1]), [], {}
for package in sys.argv[2:]:
    path = importlib.import_module(package).__path__
    names = [package] + [m.name for m in pkgutil.walk_packages(path, package + ".")]
    for name in names:
        importlib.import_module(name)
        imported.append(name)
        for module in heavy:
            if module in sys.modules:
                culprits.setdefault(module, name)
print(json.dumps({"imported": imported, "culprits": culprits}))
"""


def import_in_fresh_interpreter(packages: list[str]) -> tuple[list[str], dict[str, str]]:
    """(modules imported, heavy module -> the first module whose import brought it in)."""
    run = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, json.dumps(HEAVY), *packages], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    return result["imported"], result["culprits"]


def test_data_imports_neither_torch_nor_webdataset() -> None:
    imported, culprits = import_in_fresh_interpreter(["raywds.data"])
    assert DATA_MODULES <= set(imported), f"walked only {imported}"
    assert culprits == {}, f"importing these modules brought in (module: by whom) {culprits}"


def test_plan_imports_neither_torch_nor_webdataset() -> None:
    imported, culprits = import_in_fresh_interpreter(["raywds.data", "raywds.plan"])
    assert DATA_MODULES | {"raywds.plan", "raywds.plan.position"} <= set(imported), f"walked only {imported}"
    assert culprits == {}, f"importing these modules brought in (module: by whom) {culprits}"
