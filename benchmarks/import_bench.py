"""How long a fresh process takes to import what every raywds process imports, with the
venv's bytecode (what `./run-venv` compiles at install) and compiled from source (what every
process pays when there is no bytecode and PYTHONDONTWRITEBYTECODE keeps it from being cached).

    ./run-venv && .venv/bin/python benchmarks/import_bench.py [--rounds 3]

"From source" points Python at an empty bytecode cache (`-X pycache_prefix`) that it may not
write to. The two are interleaved and the median of `rounds` is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

IMPORTS = "import torch, torchvision, ray.train.torch, webdataset"


def seconds(extra: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *extra, "-c", IMPORTS], check=True, env=env)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    with tempfile.TemporaryDirectory() as empty:
        runs: dict[str, list[float]] = {"bytecode": [], "from source": []}
        for _ in range(args.rounds):
            runs["bytecode"].append(seconds([], env))
            runs["from source"].append(seconds(["-X", f"pycache_prefix={empty}"], env))
    median = {name: statistics.median(values) for name, values in runs.items()}
    print(f"`{IMPORTS}` in a fresh process, median of {args.rounds}:")
    for name, value in median.items():
        print(f"  {name:12s} {value:5.1f} s  (rounds: {', '.join(f'{v:.1f}' for v in runs[name])})")
    print(f"  from source / bytecode: {median['from source'] / median['bytecode']:.1f}x")


if __name__ == "__main__":
    main()
