"""A real MLflow tracking server for the tests: `mlflow server` on 127.0.0.1 with a sqlite store
and an artifact folder in a temp dir of its own, on a free port, stopped by its process group
(its own session: uvicorn's processes included), never by name.

    with mlflow_server(tmp) as server:
        env = server.env()                                  # MLFLOW_TRACKING_URI for a run
        server.client().search_runs(...)
        server.stop()                                       # a server gone mid-run
    with mlflow_server(tmp, port=server.port) as back:      # the same server back: its port, its runs

    with Gate(server.url) as gate:                          # a server gone and back in a moment
        env = {"MLFLOW_TRACKING_URI": gate.url}
        gate.shut()                                         # connections refused, the open ones cut
        gate.open()                                         # answering again, on the same port

Measured here (2 cores, MLflow 3.17): it answers /health 8-15 s after the start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
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

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

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
def mlflow_server(folder: Path, port: int | None = None) -> Iterator[MlflowServer]:
    """A server of the runs in `folder`, on `port` (default a free one): one stopped there starts
    again with the runs it had."""
    folder.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log = folder / "server.log"
    args = [str(MLFLOW), "server", "--host", HOST, "--port", str(port), "--workers", "1"]
    args += ["--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination", str(folder / "art")]
    with log.open("ab") as out:
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


class Gate:
    """A TCP forwarder to the server at `url`, on a port of its own, that can be shut (connections
    refused, the open ones cut, as a killed server's) and opened again on the same port: a tracking
    server gone and back in a moment, without the seconds a real one takes to start."""

    def __init__(self, url: str):
        target = urllib.parse.urlsplit(url)
        self.target = (target.hostname or HOST, target.port or 80)
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.accepting: threading.Thread | None = None
        self.open_now = False
        self.connections: list[socket.socket] = []
        self.lock = threading.Lock()

    def __enter__(self) -> Gate:
        self.open()
        return self

    def __exit__(self, *_: object) -> None:
        self.shut()

    def open(self) -> None:
        listener = socket.create_server((HOST, self.port))  # SO_REUSEADDR: the same port at once
        listener.settimeout(0.05)
        self.open_now = True
        self.accepting = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self.accepting.start()

    def shut(self) -> None:
        self.open_now = False
        if self.accepting is not None:
            self.accepting.join(10)  # the listener closed: connections refused from now on
            self.accepting = None
        with self.lock:
            connections, self.connections = self.connections, []
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def _accept(self, listener: socket.socket) -> None:
        with listener:
            while self.open_now:
                try:
                    client, _ = listener.accept()
                except TimeoutError:
                    continue
                client.settimeout(None)
                upstream = socket.create_connection(self.target)
                with self.lock:
                    self.connections += [client, upstream]
                for source, sink in ((client, upstream), (upstream, client)):
                    threading.Thread(target=_pump, args=(source, sink), daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)
