"""What a Jupyter kernel that started Ray costs to shut down: a real ipykernel (jupyter_client, as
Jupyter's server starts and stops kernels) starts a private local Ray cluster, then is asked to
shut down; the kernel's CPU seconds and wall time from the request to its exit, in turn:

  ray.init()                  Ray as a notebook starts it itself: ipykernel signals the cluster's
                              processes before `atexit`'s ray.shutdown() (the baseline)
  raywds ray_train.connect()  raywds's connect, which stops Ray as the kernel's shutdown begins
                              (raywds/launch/kernel.py)

    .venv/bin/python benchmarks/kernel_shutdown.py [--repeats 3]

Each kernel gets its own Jupyter and IPython dirs, a Ray temp dir and token of its own; a kernel
that has not exited after half of jupyter_client's 5 s wait gets SIGTERM, and SIGKILL at its end,
as Jupyter's server does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

STARTS = {
    "ray.init()": "import ray; ray.init()",
    "raywds ray_train.connect()": "import ray; from raywds.launch import ray_train; ray_train.connect(None)",
}


def cpu_seconds(process: Any) -> float | None:
    """A psutil process's user and system CPU seconds, or None once it is gone."""
    import psutil

    try:
        return sum(process.cpu_times()[:2])
    except psutil.NoSuchProcess:
        return None


def stop_leftovers(folder: str) -> None:
    """Kill, by PID, any process of the kernel's Ray cluster that outlived it (its temp dir in its command line)."""
    import psutil

    left = [p for p in psutil.process_iter(["cmdline"]) if folder in " ".join(p.info["cmdline"] or [])]
    for process in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(left, timeout=10)
    if left:
        print(f"  ({len(left)} process(es) of the kernel's Ray cluster outlived it; killed)", flush=True)


def shutdown_cost(start: str) -> tuple[float, float, int]:
    """(CPU s, wall s, exit status) of one kernel's shutdown after `start` ran in it."""
    from jupyter_client.manager import start_new_kernel

    with tempfile.TemporaryDirectory(prefix="rwk-") as folder:
        root = Path(folder)
        (root / "token").write_text(secrets.token_hex(16))
        env = {
            **{d: str(root / d.lower()) for d in ("JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR")},
            "RAY_ADDRESS": "local",
            "RAY_TMPDIR": str(root / "ray"),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(root / "token"),
        }
        os.environ.update(env)  # the kernel inherits this process's environment
        manager, client = start_new_kernel(kernel_name="python3", cwd=folder, startup_timeout=120)
        try:
            reply = client.execute_interactive(start, timeout=300, output_hook=lambda _: None)
            if reply["content"]["status"] != "ok":
                raise SystemExit(f"{start!r} failed in the kernel: {reply['content']}")
            client.stop_channels()
            import psutil

            process = manager.provisioner.process  # type: ignore[union-attr]
            kernel = psutil.Process(process.pid)
            before = cpu_seconds(kernel) or 0.0
            spent = [0.0]

            def sample() -> None:  # up to the kernel's exit
                while (now := cpu_seconds(kernel)) is not None:
                    spent[0] = now - before
                    time.sleep(0.05)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started = time.monotonic()
            manager.shutdown_kernel(now=False)  # a shutdown request, a wait, then SIGTERM
            wall = time.monotonic() - started
            sampler.join(5)
            return spent[0], wall, process.returncode
        finally:
            if manager.is_alive():
                manager.shutdown_kernel(now=True)
            stop_leftovers(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in STARTS}
    for _ in range(args.repeats):
        for name, start in STARTS.items():  # in turn, so both see the machine alike
            results[name].append(shutdown_cost(start))
    print(f"a kernel's shutdown after it started Ray (median of {args.repeats}; each: CPU s / wall s / exit status)")
    for name, runs in results.items():
        cpu, wall = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        each = ", ".join(f"{c:.2f}/{w:.1f}/{s}" for c, w, s in runs)
        print(f"  {name:28s} {cpu:6.2f} CPU s  {wall:5.1f} s   ({each})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
