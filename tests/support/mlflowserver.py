"""A real MLflow tracking server for the tests: `mlflow server` on 127.0.0.1 with a sqlite store
and an artifact folder in a temp dir of its own, on a free port, stopped by its process group
(its own session: uvicorn's processes included), never by name.

    with mlflow_server(tmp) as server:
        env = server.env()                                  # MLFLOW_TRACKING_URI for a run
        server.client().search_runs(...)
        server.stop()                                       # a server gone mid-run

Measured here (2 cores, MLflow 3.17): it answers /health 8-15 s after the start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from support.gcsserver import free_port

HOST = "127.0.0.1"
START_TIMEOUT_S = 120.0
MLFLOW = Path(sys.executable).parent / "mlflow"


@dataclasses.dataclass
class MlflowServer:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def env(self, experiment: str = "raywds-tests") -> dict[str, str]:
        return {"MLFLOW_TRACKING_URI": self.url, "MLFLOW_EXPERIMENT_NAME": experiment}

    def client(self) -> Any:
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.url)

    def runs(self, experiment: str = "raywds-tests") -> list[Any]:
        """Every run of `experiment`, oldest first."""
        client = self.client()
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return []
        return list(reversed(client.search_runs([found.experiment_id], max_results=100)))

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def mlflow_server(folder: Path) -> Iterator[MlflowServer]:
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = folder / "server.log"
    args = [str(MLFLOW), "server", "--host", HOST, "--port", str(port), "--workers", "1"]
    args += ["--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination", str(folder / "art")]
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=folder)
    server = MlflowServer(f"http://{HOST}:{port}", process, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(server.url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.3)
        yield server
    finally:
        server.stop()
