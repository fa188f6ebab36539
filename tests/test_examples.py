"""What a reader copies, run as it is written, and the docs' map kept whole: the `>>>` examples in
the package's docstrings (stdlib doctest), the README's Python blocks, docs/README.md naming every
page of docs/, and every relative link in the Markdown pages leading to a file and a heading that
exist."""

from __future__ import annotations

import ast
import dataclasses
import doctest
import importlib
import inspect
import io
import re
import typing
from pathlib import Path

import pytest

import raywds

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "raywds"
DOCS = ROOT / "docs"


def modules_with_examples() -> list[str]:
    """The package's modules whose text holds a `>>>` example."""
    return sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in PACKAGE.rglob("*.py")
        if ">>>" in p.read_text()
    )


def test_the_docstring_examples_run_as_written() -> None:
    names = modules_with_examples()
    assert names, "no module of the package shows a `>>>` example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    attempted, report = {}, io.StringIO()
    for name in names:
        tests = doctest.DocTestFinder().find(importlib.import_module(name))
        attempted[name] = sum(runner.run(test, out=report.write).attempted for test in tests)
    assert runner.failures == 0, report.getvalue()
    assert [name for name, count in attempted.items() if count == 0] == [], "a `>>>` that doctest does not find"


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), re.M | re.S)


def test_the_readmes_python_runs_as_written(shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block runs in a folder where `runs/demo/shards` holds the tests' small shards (120 train
    samples); a block that trains on Ray is checked without a cluster (`on_ray_as_written`): the
    notebook's test runs the same call (tests/launch/test_lab.py)."""
    blocks = python_blocks(ROOT / "README.md")
    here = [block for block in blocks if "fit_on_ray" not in block]
    on_ray = [block for block in blocks if "fit_on_ray" in block]
    assert here and on_ray, f"{len(blocks)} python blocks in README.md"
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "shards").symlink_to(shards)
    monkeypatch.chdir(tmp_path)
    names: dict[str, typing.Any] = {}
    for block in here:
        exec(compile(block, "README.md", "exec"), names)
    # raywds.fit returns the last epoch's row, as the README says
    assert names["metrics"]["epoch"] == names["cfg"].epochs
    for block in on_ray:
        on_ray_as_written(block, names)


def on_ray_as_written(block: str, names: dict[str, typing.Any]) -> None:
    """Without a cluster: every `raywds.NAME` is public; each call of a public function takes its
    arguments (evaluated after the blocks before it, checked against its annotations); what it
    returns has each attribute read from it, and its metrics each key read from them, which the
    same loop returned in this process."""
    tree = ast.parse(block)
    returned: dict[str, type] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "raywds":
            assert node.attr in raywds.__all__, node.attr
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            if not (isinstance(call.func, ast.Attribute) and ast.unparse(call.func.value) == "raywds"):
                continue
            function = getattr(raywds, call.func.attr)

            def value(expr: ast.expr) -> typing.Any:
                return eval(compile(ast.Expression(expr), "README.md", "eval"), names)

            bound = inspect.signature(function).bind(
                *map(value, call.args), **{k.arg: value(k.value) for k in call.keywords if k.arg}
            )
            hints = typing.get_type_hints(function)
            for parameter, argument in bound.arguments.items():
                assert isinstance(argument, hints[parameter]), (parameter, argument)
            [target] = node.targets
            returned[ast.unparse(target)] = hints["return"]
    assert returned, "no call of a public function assigned"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in returned:
            kind = returned[ast.unparse(node.value)]
            assert node.attr in {f.name for f in dataclasses.fields(kind)}, f"{kind.__name__} has no {node.attr}"
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith(".metrics"):
            key = ast.literal_eval(node.slice)
            assert key in names["metrics"], f"no {key!r} in the metrics"


def github_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of `page` (outside code blocks)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{counts[slug]}" if slug in counts else slug)  # a repeated heading: -1, -2, ...
        counts[slug] = counts.get(slug, 0) + 1
    return anchors


def relative_links(page: Path) -> list[str]:
    """The links of `page` (outside code blocks) to files of the repository, anchors included."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return [link for link in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", link)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for link in relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in github_anchors(target):
            broken.append(f"{link} (no such heading)")
    return broken


def test_every_link_in_the_markdown_pages_leads_to_a_file_and_a_heading() -> None:
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]
    broken = {str(page.relative_to(ROOT)): found for page in pages if (found := broken_links(page))}
    assert broken == {}
    assert sum(len(relative_links(page)) for page in pages) > 100


def test_the_docs_home_gives_every_page_of_docs_one_line() -> None:
    """docs/README.md: a line for each page, the page its first link."""
    home = DOCS / "README.md"
    lines = re.findall(r"^- \[[^]]*\]\(([^)#]+)[^)]*\)", home.read_text(), re.M)
    pages = sorted(p.name for p in DOCS.glob("*.md") if p != home)
    assert sorted(line for line in lines if "/" not in line) == pages
