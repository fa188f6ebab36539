"""What Ray costs a training run: the same job under `torchrun --nproc-per-node 2 -m raywds
train` (the baseline) and `raywds ray --num-workers 2` on a fresh local Ray cluster, in turn.

    .venv/bin/python benchmarks/ray_cost.py [--epochs 2] [--repeats 2] [--two-nodes]

Both run the demo recipe on the demo shards, two CPU ranks over gloo, rank 0 writing a progress
row per step (`--log-every 0`, each row with its wall time). From those rows and the process's
start and end:
  to first step   process start -> rank 0's first step done (imports, cluster, workers, loaders)
  step time       median time between rank 0's consecutive steps, each epoch's first 3 left out
  after last step rank 0's last step -> the process has exited (validation, checkpoint, shutdown)
Ray runs on a private temp dir with a token of its own, and is stopped by its own driver.
--two-nodes (root, iproute2) also runs `raywds ray` on the tests' two-node cluster (two network
namespaces on this machine, tests/netnodes.py), a rank on each node, started once beforehand as
a user's cluster would be: on one machine that shows the cost of the network path, not speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from raywds.data.demo import prepare

BIN = Path(sys.executable).parent


def rows(metrics: Path) -> list[dict]:
    return [r for line in metrics.read_text().splitlines() if (r := json.loads(line)).get("kind") == "progress"]


def measure(command: list[str], metrics: Path, env: dict[str, str]) -> dict[str, float]:
    start = time.time()
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
    end = time.time()
    if out.returncode != 0:
        raise SystemExit(f"{command[0]} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    progress = rows(metrics)
    gaps = [
        b["time"] - a["time"]
        for a, b in zip(progress, progress[1:])
        if a["epoch"] == b["epoch"] and a["step_in_epoch"] >= 3
    ]
    return {
        "to_first_step_s": progress[0]["time"] - start,
        "step_s": statistics.median(gaps),
        "after_last_step_s": end - progress[-1]["time"],
        "total_s": end - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="keep the demo shards and runs here (default: a temp dir)")
    parser.add_argument("--two-nodes", action="store_true", help="also on a two-node cluster (root, iproute2)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="raywds-raycost-"))
    shards = prepare(work / "demo")
    job = ["--recipe", "demo", "--data", str(shards), "--epochs", str(args.epochs), "--log-every", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ray_tmp = Path(tempfile.mkdtemp(prefix="rwb-", dir="/tmp"))  # short: Ray's socket paths are limited
    token = ray_tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    ray_env = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_TMPDIR": str(ray_tmp)}
    ray_env.pop("RAY_ADDRESS", None)
    results: dict[str, list[dict[str, float]]] = {"torchrun": [], "ray": []}
    for i in range(args.repeats):
        out = work / f"torchrun-{i}"
        results["torchrun"].append(
            measure(
                [str(BIN / "torchrun"), "--nproc-per-node", "2", "-m", "raywds", "train", *job, "--out", str(out)],
                out / "metrics.jsonl",
                env,
            )
        )
        storage = work / f"ray-{i}"
        results["ray"].append(
            measure(
                [str(BIN / "raywds"), "ray", *job, "--num-workers", "2", "--storage-path", str(storage), "--name", "b"],
                storage / "b" / "metrics.jsonl",
                ray_env,
            )
        )
    if args.two_nodes:
        results["ray, 2 nodes"] = two_nodes(job, work, args.repeats, env)
    keys = ("to_first_step_s", "step_s", "after_last_step_s", "total_s")
    print(f"{args.epochs} epochs of the demo recipe, 2 CPU ranks, median of {args.repeats} runs each")
    print(f"{'':18}" + "".join(f"{name:>15}" for name in results) + f"{'ray/torchrun':>14}")
    for key in keys:
        medians = [statistics.median(r[key] for r in runs) for runs in results.values()]
        print(f"{key:18}" + "".join(f"{m:15.3f}" for m in medians) + f"{medians[1] / medians[0]:13.2f}x")
    if args.two_nodes:
        step = {name: statistics.median(r["step_s"] for r in runs) for name, runs in results.items()}
        print(f"step time, 2 nodes / 1 node under Ray: {step['ray, 2 nodes'] / step['ray']:.2f}x")
    print(json.dumps(results))


def two_nodes(job: list[str], work: Path, repeats: int, env: dict[str, str]) -> list[dict[str, float]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import netnodes  # the tests' two-node cluster

    runs = []
    with netnodes.two_nodes("rwb2-") as cluster:
        for i in range(repeats):
            storage = work / f"ray2-{i}"
            command = [str(BIN / "raywds"), "ray", "--address", cluster.gcs_address, *job]
            command += ["--num-workers", "2", "--storage-path", str(storage), "--name", "b"]
            runs.append(
                measure(
                    cluster.on_head(command), storage / "b" / "metrics.jsonl", {**cluster.env, "OMP_NUM_THREADS": "1"}
                )
            )
    return runs


if __name__ == "__main__":
    main()
