"""How long a fresh process takes to import what every raywds process imports, with the
venv's bytecode (what `./run-venv` compiles at install) and compiled from source (what every
process pays when there is no bytecode and PYTHONDONTWRITEBYTECODE keeps it from being cached);
and how long `import ray` takes, the first thing every process Ray starts does, with and without
rfc3987-syntax (jsonschema's `iri` format check, which Jupyter's jupyter-events pulls in and
`./run-venv` leaves out).

    ./run-venv && .venv/bin/python benchmarks/import_bench.py [--rounds 3]

"From source" points Python at an empty bytecode cache (`-X pycache_prefix`) that it may not
write to. "With rfc3987-syntax" installs it (and lark) with uv into a temp folder put on
PYTHONPATH, as `pip install jupyterlab` would have put them in the venv. Each pair is
interleaved and the median of `rounds` is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMPORTS = "import torch, torchvision, ray.train.torch, webdataset"


def seconds(code: str, extra: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *extra, "-c", code], check=True, env=env)
    return time.perf_counter() - start


def compare(code: str, kinds: dict[str, tuple[list[str], dict[str, str]]], rounds: int) -> dict[str, float]:
    """Median seconds of `code` in a fresh process of each kind (its extra flags, its environment), interleaved."""
    runs: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(rounds):
        for name, (extra, env) in kinds.items():
            runs[name].append(seconds(code, extra, env))
    print(f"`{code}` in a fresh process, median of {rounds}:")
    median = {name: statistics.median(values) for name, values in runs.items()}
    for name, value in median.items():
        print(f"  {name:22s} {value:5.2f} s  (rounds: {', '.join(f'{v:.2f}' for v in runs[name])})")
    return median


def with_rfc3987(folder: Path) -> dict[str, str]:
    """An environment whose Python also finds rfc3987-syntax, installed into `folder`."""
    uv = Path(sys.executable).parent / "uv"
    subprocess.run(
        [str(uv), "pip", "install", "-q", "--target", str(folder), "--python", sys.executable, "rfc3987-syntax"],
        check=True,
    )
    return {**os.environ, "PYTHONPATH": str(folder)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    with tempfile.TemporaryDirectory() as empty:
        median = compare(
            IMPORTS, {"bytecode": ([], env), "from source": (["-X", f"pycache_prefix={empty}"], env)}, args.rounds
        )
    print(f"  from source / bytecode: {median['from source'] / median['bytecode']:.1f}x\n")
    with tempfile.TemporaryDirectory() as folder:
        no_args: list[str] = []
        kinds = {
            "as ./run-venv installs": (no_args, dict(os.environ)),
            "with rfc3987-syntax": (no_args, with_rfc3987(Path(folder))),
        }
        median = compare("import ray", kinds, args.rounds)
    print(f"  with / without: {median['with rfc3987-syntax'] / median['as ./run-venv installs']:.1f}x")


if __name__ == "__main__":
    main()
