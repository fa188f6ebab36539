"""The package's shape, as docs/modules.md promises it: modules of one noun, short functions,
no import circle, mode names compared only where config text is parsed, and no parsed
command line below the CLI."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "raywds"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_500_lines() -> None:
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
    allowed = {"raywds/plan/modes.py", "raywds/plan/resample.py", "raywds/plan/split.py", "raywds/plan/seeds.py"}
    found = {
        f"{p.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
        for p in modules()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"""["'](split|resample)["']""", line) and str(p.relative_to(PACKAGE.parent)) not in allowed
    }
    assert found == set()


VARIANTS = {"decode", "data_plane", "network", "backend"}
"""Settings whose value names a variant: each is parsed once into what owns the difference
(raywds.loader.decodings's DECODINGS, raywds.launch.ray_train's PLACES, raywds.serve's NETWORKS and
its backends' start functions). Modes have their own check above."""


def _named(node: ast.expr) -> str | None:
    """`x`, `a.x` or `a["x"]` -> "x"."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return str(node.slice.value)
    return None


def _text(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(_text(e) for e in node.elts)


def test_variants_are_never_compared_as_text() -> None:
    """No `cfg.decode == "device"`, `data_plane == "loader"` or `spec.network == "host"`: the
    branch belongs to the variant's object. (It found twelve such comparisons in six modules.)"""
    found = set()
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if any(_named(s) in VARIANTS for s in sides) and any(_text(s) for s in sides):
                found.add(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert found == set()


def test_no_test_imports_conftest() -> None:
    """Fixtures live in tests/conftest.py, which pytest loads; what tests share besides fixtures
    is the tests/support package, imported by name."""
    tests = PACKAGE.parent / "tests"
    found = {
        f"{p.relative_to(tests)}:{i}: {line.strip()}"
        for p in sorted(tests.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.match(r"\s*(from|import) (tests\.)?conftest\b", line)
    }
    assert found == set()


@pytest.mark.slow
def test_the_ray_driver_and_the_region_decoder_do_not_import_torchvision() -> None:
    """Importing torchvision takes 1.5-2.5 s on these machines (its ops import torch's compiler).
    The Ray driver never decodes, a loader worker's fork server preloads the loader, and the
    region decoder resizes with torch alone: none of them may pay it (docs/performance.md)."""
    import subprocess
    import sys

    from support.runs import need_jpeg_extension

    need_jpeg_extension()
    script = (
        "import io, sys, PIL.Image\n"
        "import raywds.launch.ray_train, raywds.launch.raydata, raywds.loader.loader\n"
        "from raywds.loader.crops import train_crop\n"
        "out = io.BytesIO(); PIL.Image.new('RGB', (320, 240), 'red').save(out, format='JPEG')\n"
        "assert train_crop(out.getvalue(), 64, (0.08, 1.0)).shape == (3, 64, 64)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchvision'))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def _imports(path: Path) -> set[str]:
    """The raywds modules `path` imports, anywhere in it: at the top, inside functions and under
    `if TYPE_CHECKING:` alike (a circle of annotations is still a circle for the reader)."""
    name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("raywds")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("raywds"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").is_file() else node.module)
    return {m for m in found if m != name}


def test_no_import_circle_anywhere_in_the_package() -> None:
    """No module reaches itself through imports, type-only ones included. import-linter checks
    the parts' siblings at run time; this is every module, annotations too (lightning's
    DataModule and its callback imported each other)."""
    graph = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): _imports(p)
        for p in modules()
    }
    circles, state = [], dict.fromkeys(graph, 0)

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif state.get(nxt) == 0:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if state[start] == 0:
            visit(start, [start])
    assert circles == []


def test_exactness_is_read_only_where_epochs_are_planned_and_kept() -> None:
    """`mode.exact` decides how an epoch is dealt (plan/), read (loader/) and kept
    (train/epoch.py); everywhere else asks the epoch's keeper (it was read in 17 places)."""
    allowed = ("raywds/plan/", "raywds/loader/", "raywds/train/epoch.py")
    found = {
        f"{where}:{node.lineno}: {ast.unparse(node)}"
        for p in modules()
        if not (where := str(p.relative_to(PACKAGE.parent))).startswith(allowed)
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "exact"
    }
    assert found == set()


def test_nothing_below_the_command_line_sees_its_parsed_flags() -> None:
    """Each command builds its typed options from the parsed flags once (raywds.cli.main, with
    raywds.cli.flags); nothing else takes an `argparse.Namespace`, not even the commands (which
    read 86 of its attributes by hand once, renaming some on the way)."""
    allowed = {"raywds/cli/main.py", "raywds/cli/flags.py"}
    found = {
        f"{where}:{i}: {line.strip()}"
        for p in modules()
        if (where := str(p.relative_to(PACKAGE.parent))) not in allowed
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "Namespace" in line
    }
    assert found == set()
