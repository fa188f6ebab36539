"""Mutation testing of the code that carries raywds's promise of exactness: the planner
(raywds/plan/), the epoch keeper (raywds/train/epoch.py), the loop's accumulation and
validation sums (raywds/train/loop.py) and the loader's deal of shards to its workers.

    .venv/bin/python tools/mutation.py                       # every target, one after another
    .venv/bin/python tools/mutation.py epoch loop            # some of them
    .venv/bin/python tools/mutation.py --list                # the targets, their functions and tests

Each target is run by mutmut 3 (`[tool.mutmut]` in pyproject.toml) in a scratch copy of the tree,
build/mutation/ (git-ignored), made afresh for each target: mutmut writes its mutants into the
copy's mutants/, so nothing under raywds/ is rewritten, however a run ends. Only the target's fast
tests run (no Ray, no whole runs), each mutant against the tests that call the function it changed.
For each target it prints the mutants killed (a failing test, or a timeout) out of those that
are not equivalent, and each survivor's diff; EQUIVALENT names the survivors that no test can
kill, each with why. Exits 1 when a target kills fewer than 90% of its non-equivalent mutants.
The numbers and the equivalent mutants: docs/testing.md#mutation-testing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = ROOT / "build" / "mutation"
MUTMUT = Path(sys.executable).parent / "mutmut"
GOAL = 0.9
"""The share of non-equivalent mutants each target must kill."""


@dataclass(frozen=True)
class Target:
    """Modules mutated in one mutmut run, against the same tests; each module is counted apart."""

    modules: dict[str, tuple[str, ...]]
    """Each module's path and the functions mutated in it (`name`, or `Class.method`; all when empty)."""
    tests: tuple[str, ...]

    def patterns(self, path: str) -> list[str]:
        """mutmut's names of the module's mutants (`x_name__mutmut_3`, `xǁClassǁmethod__mutmut_3`)."""
        module = path.removesuffix(".py").replace("/", ".")
        return [f"{module}.{mangled(f)}__mutmut_*" for f in self.modules[path]] or [f"{module}.*"]


def mangled(function: str) -> str:
    cls, _, name = function.rpartition(".")
    return f"xǁ{cls}ǁ{name}" if cls else f"x_{function}"


def function_of(mutant: str) -> str:
    """`raywds.plan.split.xǁSplitǁplan__mutmut_7` -> `Split.plan`."""
    name = mutant.rsplit(".", 1)[1].rsplit("__mutmut_", 1)[0]
    return name.removeprefix("xǁ").replace("ǁ", ".") if name.startswith("xǁ") else name.removeprefix("x_")


PLAN = ("checks", "epoch", "modes", "position", "render", "resample", "seeds", "split")
TARGETS = {
    "plan": Target(
        {f"raywds/plan/{name}.py": () for name in PLAN},
        (
            "tests/plan/test_deal.py",
            "tests/plan/test_nodes.py",
            "tests/plan/test_plan.py",
            "tests/plan/test_scale.py",
            "tests/plan/test_survivors_position.py",
            "tests/plan/test_survivors_render.py",
            "tests/plan/test_survivors_resample.py",
            "tests/plan/test_survivors_split.py",
            "tests/plan/test_verdicts.py",
            "tests/train/test_keeper.py",
        ),
    ),
    "epoch": Target({"raywds/train/epoch.py": ()}, ("tests/train/test_keeper.py",)),
    "loop": Target(
        {"raywds/train/loop.py": ("EpochResult.add", "_one_batch", "_in_step", "_no_sync", "evaluate")},
        ("tests/train/test_loop.py",),
    ),
    "deal": Target(
        {
            "raywds/loader/loader.py": ("drawn", "split_slots"),
            "raywds/loader/stages.py": ("_worker", "worker_urls", "unconsumed"),
        },
        ("tests/loader/test_deal_workers.py",),
    ),
}

EXACT = "if epoch.exact and (counted.duplicates or counted.missing or counted.samples != self.num_samples):"
DIVIDED = "(value / in_step if in_step > 1 else value).backward()"
ZEROED = "optimizer.zero_grad(set_to_none=True)"
SUMMED = "running = np.concatenate([[0], np.cumsum(consumed, dtype=np.int64)])"
FOLDED = "folded = sum(1 for n in plan.samples_per_rank if n > 1 and n % plan.batch_size == 1)"
DRAWS = "draws = bind(plan.mode.shards_for, plan, shards, rank=rank, seed=cfg.seed, epoch=epoch, reseed=reseed)"
EQUIVALENT: dict[str, str] = {
    f"EpochKeeper.check_exact: {EXACT} => {EXACT.replace('missing or', 'missing and')}": (
        "a tally's samples are the split's less the missing plus the repeats: with none repeated, "
        "some missing is a count that differs"
    ),
    f"EpochKeeper.check_exact: {EXACT} => {EXACT.replace('duplicates or', 'duplicates and')}": (
        "as above: repeats alone, or samples missing alone, make the count differ from the split's"
    ),
    f"_one_batch: {DIVIDED} => {DIVIDED.replace('in_step > 1', '(in_step > 1) or True')}": (
        "a loss divided by 1 is itself"
    ),
    f"_one_batch: {DIVIDED} => {DIVIDED.replace('in_step > 1', 'in_step >= 1')}": "a loss divided by 1 is itself",
    f"_one_batch: {ZEROED} => {ZEROED.replace('True', 'False')}": (
        "gradients zeroed, not dropped, before a step's backward passes add to them: the same sums; a "
        "parameter no backward reaches keeps no gradient either way"
    ),
    f"_one_batch: {ZEROED} => {ZEROED.replace('True', 'None')}": "None is false: as set_to_none=False",
    "remaining: s if not done else ShardInfo(s.name, s.num_samples - done, s.num_bytes, s.sha256) => s if (not done) "
    "and False else ShardInfo(s.name, s.num_samples - done, s.num_bytes, s.sha256)": (
        "a shard rebuilt with none done is a ShardInfo of the same fields: equal to it"
    ),
    "Mode.plan: seed: int = 0, => seed: int = 1,": "the base's defaults: its body only raises; each mode has its own",
    "Mode.plan: epoch: int = 0, => epoch: int = 1,": "the base's defaults: its body only raises; each mode has its own",
    "Mode.shards_for: reseed: int = 0, => reseed: int = 1,": "the base's defaults: its body only raises",
    "Resample.plan: seed: int = 0, => seed: int = 1,": "resample's plan draws nothing: the seed is the loader's",
    "Resample.plan: epoch: int = 0, => epoch: int = 1,": "resample's plan draws nothing: the epoch is the loader's",
    "Split.shards_for: reseed: int = 0, => reseed: int = 1,": "a split slot is dealt, not drawn: no reseed is read",
    f"drawn: {DRAWS} => {DRAWS.replace('shards_for, plan,', 'shards_for, None,')}": (
        "resample's draws read no plan (only resample has draws)"
    ),
    f"per_shard: {SUMMED} => {SUMMED.replace('np.int64', 'None')}": (
        "a cumulative sum of bools is in numpy's default integer, int64 on the 64-bit platforms raywds runs on"
    ),
    f"per_shard: {SUMMED} => {SUMMED.replace('dtype=np.int64', '')}": "as above: the default is int64",
    f"Split.findings: {FOLDED} => {FOLDED.replace('n > 1', 'n > 2')}": (
        "two samples never leave one spare: 2 % batch is 1 only for a batch of 1, where it is 0"
    ),
    'check_plan: log.warning("%s", finding.text) => log.warning(finding.text)': (
        "a log record with no arguments is not %-formatted: a % in the text is printed as it is"
    ),
}
"""Survivors no test can kill, by `function: removed line => added line` (whitespace collapsed),
each with why (docs/testing.md lists them)."""


def scratch_copy(target: Target, scratch: Path) -> Path:
    """A fresh copy of the package, its tests and pyproject.toml, with [tool.mutmut] narrowed to `target`."""
    if scratch.resolve() in (ROOT, *ROOT.parents) or (scratch / ".git").exists():
        sys.exit(f"--scratch {scratch} is the tree or holds it: give a folder of its own (e.g. build/mutation)")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("raywds", "tests"):
        shutil.copytree(ROOT / name, scratch / name, ignore=skip)
    text = (ROOT / "pyproject.toml").read_text()
    narrowed = (
        f"only_mutate = {quoted(list(target.modules))}\n"
        f"pytest_add_cli_args_test_selection = {quoted(list(target.tests))}\n"
    )
    text, found = re.subn(r"^only_mutate = .*\n", "", text, flags=re.M)
    text, also = re.subn(r"^pytest_add_cli_args_test_selection = .*\n", "", text, flags=re.M)
    assert found == also == 1, "[tool.mutmut] in pyproject.toml names only_mutate and the test selection"
    (scratch / "pyproject.toml").write_text(text.replace("[tool.mutmut]\n", "[tool.mutmut]\n" + narrowed))
    return scratch


def quoted(items: list[str]) -> str:
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"


def mutmut(*args: str, where: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([str(MUTMUT), *args], cwd=where, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"mutmut {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def key_of(function: str, diff: str) -> str:
    """A mutant by its function and the line it changed: the same after mutmut renumbers."""
    lines = [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    removed = " ".join(" ".join(line[1:].split()) for line in lines if line.startswith("-"))
    added = " ".join(" ".join(line[1:].split()) for line in lines if line.startswith("+"))
    return f"{function}: {removed} => {added}"


@dataclass
class Outcome:
    """One module's mutants after a run."""

    path: str
    killed: int = 0
    survivors: list[tuple[str, str]] = field(default_factory=list)
    """(mutant and its status, its diff) of each survivor not judged equivalent."""
    equivalent: list[tuple[str, str]] = field(default_factory=list)
    """(key, why) of each survivor judged equivalent."""

    @property
    def total(self) -> int:
        return self.killed + len(self.survivors)

    @property
    def score(self) -> float:
        return self.killed / self.total if self.total else 1.0


def run(target: Target, jobs: int, scratch: Path) -> list[Outcome]:
    where = scratch_copy(target, scratch)
    patterns = [p for path in target.modules for p in target.patterns(path)]
    mutmut("run", "--max-children", str(jobs), *patterns, where=where)
    listed = mutmut("results", "--all", "true", where=where).splitlines()
    statuses = dict(line.strip().rsplit(": ", 1) for line in listed if ": " in line)
    outcomes = []
    for path in target.modules:
        outcome = Outcome(path)
        matches = [re.compile(glob(p)) for p in target.patterns(path)]
        mine = sorted((m for m in statuses if any(r.fullmatch(m) for r in matches)), key=natural)
        for mutant in mine:
            if statuses[mutant] in ("killed", "timeout"):
                outcome.killed += 1
                continue
            diff = mutmut("show", mutant, where=where)
            key = key_of(function_of(mutant), diff)
            if key in EQUIVALENT:
                outcome.equivalent.append((key, EQUIVALENT[key]))
            else:
                outcome.survivors.append((f"{mutant} ({statuses[mutant]})", diff))
        outcomes.append(outcome)
    return outcomes


def glob(pattern: str) -> str:
    return re.escape(pattern).replace(r"\*", ".*")


def natural(name: str) -> tuple[str, int]:
    stem, _, number = name.rpartition("__mutmut_")
    return stem, int(number) if number.isdigit() else 0


def report(outcome: Outcome) -> None:
    print(
        f"{outcome.path}: {outcome.killed} / {outcome.total} killed ({100 * outcome.score:.1f}%), "
        f"{len(outcome.equivalent)} equivalent apart",
        flush=True,
    )
    for mutant, diff in outcome.survivors:
        print(f"  survived: {mutant}\n" + "\n".join(f"    {line}" for line in diff.strip().splitlines()[1:]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("targets", nargs="*", help=f"of {', '.join(TARGETS)} (all when none)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants tested at once (default 1)")
    parser.add_argument("--list", action="store_true", help="print the targets and their tests, run nothing")
    parser.add_argument("--scratch", type=Path, default=SCRATCH, help=f"the copy to run in (default {SCRATCH})")
    args = parser.parse_args(argv)
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        parser.error(f"no target {', '.join(unknown)}: give one of {', '.join(TARGETS)}")
    chosen = args.targets or list(TARGETS)
    if args.list:
        for name in chosen:
            target = TARGETS[name]
            print(f"{name}: tests {' '.join(target.tests)}")
            for path, functions in target.modules.items():
                print(f"  {path}: {', '.join(functions) or 'every function'}")
        return 0
    outcomes = []
    for name in chosen:
        started = time.monotonic()
        done = run(TARGETS[name], args.jobs, args.scratch)
        print(f"{name}: {time.monotonic() - started:.0f} s", flush=True)
        for outcome in done:
            report(outcome)
        outcomes += done
    print("\n| module | killed / mutants | equivalent |\n| --- | --- | --- |")
    for o in outcomes:
        print(f"| `{o.path}` | {o.killed} / {o.total} ({100 * o.score:.0f}%) | {len(o.equivalent)} |")
    return 0 if all(o.score >= GOAL for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
