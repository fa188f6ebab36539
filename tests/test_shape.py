"""The package's shape, as docs/modules.md promises it: small modules, short functions, and
mode names compared only where config text is parsed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "raywds"
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 60


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_300_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_function_is_over_60_lines() -> None:
    long = {}
    for path in modules():
        where = str(path.relative_to(PACKAGE.parent))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{where}:{node.name}"] = length
    assert long == {}


def test_mode_names_appear_only_where_config_text_is_parsed() -> None:
    """A mode is an object (raywds.plan.modes); its name is text only in the config, the mode
    registry, the seed tags and help text."""
    allowed = {"raywds/config.py", "raywds/plan/resample.py", "raywds/plan/split.py", "raywds/plan/seeds.py"}
    found = {
        f"{p.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
        for p in modules()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"""["'](split|resample)["']""", line) and str(p.relative_to(PACKAGE.parent)) not in allowed
    }
    assert found == set()
