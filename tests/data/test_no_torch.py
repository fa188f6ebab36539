"""raywds.data, the planning that reads its manifests, and the command line import neither torch
nor webdataset (which imports torch): about 2 s and 400 MB in every process that converts,
verifies or plans, each convert worker included, and in every `raywds --help`. Checked in a
fresh interpreter, over every module the packages hold, so a new module is covered without a
change here."""

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


def loaded_by(packages: list[str]) -> list[str]:
    """The raywds modules a fresh interpreter holds after importing every module of `packages`."""
    script = IMPORT_ALL + "print(json.dumps(sorted(m for m in sys.modules if m.startswith('raywds'))))"
    run = subprocess.run([sys.executable, "-c", script, "[]", *packages], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_data_imports_neither_torch_nor_webdataset() -> None:
    imported, culprits = import_in_fresh_interpreter(["raywds.data"])
    assert DATA_MODULES <= set(imported), f"walked only {imported}"
    assert culprits == {}, f"importing these modules brought in (module: by whom) {culprits}"


def test_plan_imports_neither_torch_nor_webdataset() -> None:
    imported, culprits = import_in_fresh_interpreter(["raywds.data", "raywds.plan"])
    assert DATA_MODULES | {"raywds.plan", "raywds.plan.position"} <= set(imported), f"walked only {imported}"
    assert culprits == {}, f"importing these modules brought in (module: by whom) {culprits}"


def test_the_command_line_imports_neither_torch_nor_webdataset() -> None:
    """The parser, every command's options and the sections they are made of (the training config's
    included): a command imports torch when it runs, not before. The loader's section once imported
    its decoders to check --decode against --auto-augment, and `raywds convert` paid 2.4 s for it."""
    imported, culprits = import_in_fresh_interpreter(["raywds.cli"])
    assert {"raywds.cli.main", "raywds.cli.commands", "raywds.cli.options", "raywds.cli.flags"} <= set(imported)
    assert {"raywds.train.config", "raywds.loader.settings"} <= set(loaded_by(["raywds.cli"])), "not what it checks"
    assert culprits == {}, f"importing these modules brought in (module: by whom) {culprits}"
