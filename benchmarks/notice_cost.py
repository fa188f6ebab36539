"""What asking for a notice costs a step (raywds.train.notice): every --notice-every steps, every
rank asks, and asking is a collective. Under Ray it is `ray.train.get_preemption_info()` (Ray
Train's own broadcast from rank 0, through its actors); under torchrun, SIGTERM's check is one
all_reduce of one number over the job's process group (gloo here). Both timed in the same run,
on 2 ranks of a private local Ray (its own temp dir and token), against an empty loop.

    .venv/bin/python benchmarks/notice_cost.py [--calls 200] [--workers 2]

Prints each one's median and 90th percentile in milliseconds, on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def per_worker(config: dict[str, Any]) -> dict[str, float]:
    import ray.train
    import torch
    import torch.distributed as dist

    def timed(fn: Any) -> list[float]:
        out = []
        for _ in range(config["calls"]):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1000)
        return out

    seen = torch.zeros(1, dtype=torch.float64)
    rows = {
        "empty": timed(lambda: None),
        "all_reduce (SIGTERM's check)": timed(lambda: dist.all_reduce(seen, op=dist.ReduceOp.MAX)),
        "get_preemption_info (Ray's)": timed(ray.train.get_preemption_info),
    }
    result = {}
    for name, times in rows.items():
        times.sort()
        result[f"{name} median"] = statistics.median(times)
        result[f"{name} p90"] = times[int(0.9 * len(times))]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if "RAYWDS_BENCH_TOKEN" not in os.environ:  # a token of our own, in the environment before Ray reads it
        fd, token = tempfile.mkstemp(prefix="rwnc-token-")
        os.write(fd, secrets.token_hex(32).encode())
        os.close(fd)
        env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token, "RAYWDS_BENCH_TOKEN": token}
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})
    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    with tempfile.TemporaryDirectory(prefix="rwnc-", dir="/tmp") as tmp:
        ray.init(address="local", include_dashboard=False, _temp_dir=str(Path(tmp) / "ray"), num_cpus=args.workers)
        try:

            def report_back(config: dict[str, Any]) -> None:
                result = per_worker(config)
                if ray.train.get_context().get_world_rank() == 0:  # the machine's own file system
                    Path(config["out"]).write_text(json.dumps(result))

            trainer = TorchTrainer(
                report_back,
                train_loop_config={"calls": args.calls, "out": str(Path(tmp) / "times.json")},
                scaling_config=ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": 1}),
                run_config=ray.train.RunConfig(storage_path=str(Path(tmp) / "runs"), name="notice"),
            )
            trainer.fit()
            reported = json.loads((Path(tmp) / "times.json").read_text())
        finally:
            ray.shutdown()
            Path(os.environ["RAYWDS_BENCH_TOKEN"]).unlink(missing_ok=True)
    print(f"{args.workers} ranks on one machine, {args.calls} calls each; rank 0's milliseconds a call:\n")
    print("| check | median ms | p90 ms |\n|---|---|---|")
    for name in ("empty", "all_reduce (SIGTERM's check)", "get_preemption_info (Ray's)"):
        print(f"| {name} | {reported[f'{name} median']:.3f} | {reported[f'{name} p90']:.3f} |")


if __name__ == "__main__":
    main()
