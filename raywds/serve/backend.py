"""What every shard-server backend (embedded.py, nginx.py, docker.py) is given and hands back.
A backend's `start(spec, cleanup)` starts serving, pushes how to undo each step onto `cleanup`
as it goes, and returns at once; ShardServer waits until it answers.

    running = embedded.start(spec, cleanup)   # then wait_ready(..., running.alive, ..., running.logs)
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from raywds.serve.net import ANY_HOST, free_port, hostport


class Network(Protocol):
    """Docker: how the nginx container is reached (`--network`)."""

    name: str

    def container(self, host: str, port: int) -> dict[str, Any]:
        """The Docker SDK's `containers.run` keywords."""
        ...

    def listen(self, host: str, port: int) -> str:
        """nginx's `listen` inside the container."""
        ...


class HostNetwork:
    """The container shares the host's network: nginx listens on the server's own address."""

    name = "host"

    def container(self, host: str, port: int) -> dict[str, Any]:
        return {"network_mode": "host"}

    def listen(self, host: str, port: int) -> str:
        return hostport(host, port)


class BridgeNetwork:
    """A bridge network: nginx listens on every address inside, the port published on the host's `host`."""

    name = "bridge"

    def container(self, host: str, port: int) -> dict[str, Any]:
        return {"ports": {f"{port}/tcp": (host, port)}}

    def listen(self, host: str, port: int) -> str:
        return f"0.0.0.0:{port}"


NETWORKS: dict[str, Network] = {n.name: n for n in (HostNetwork(), BridgeNetwork())}


@dataclass(frozen=True, kw_only=True)
class Spec:
    """A server as ShardServer was asked for it; each backend reads the fields it knows."""

    root: Path
    """The shard folder, resolved; served read-only."""
    host: str
    """The address to listen on; one of ANY_HOST for every interface."""
    port: int
    """The port to listen on; 0 for a free one."""
    image: str
    """Docker: the nginx image."""
    network: Network
    """Docker: how the container is reached (NETWORKS)."""
    no_pull: bool
    """Docker: never pull the image; use it only when it is here."""
    idle_timeout_s: float
    """Embedded: close a connection whose client sends or takes nothing this long."""
    num_threads: int
    """Embedded: serve at most this many connections at once."""

    def free_port(self) -> int:
        """`port`, or when 0 a free one (for backends that must name it in a config)."""
        return self.port or free_port(self.host if self.host not in ANY_HOST else "0.0.0.0")


@dataclass(frozen=True, kw_only=True)
class Running:
    """A backend that started: where it listens, whether it still runs, and its logs."""

    port: int
    alive: Callable[[], bool]
    logs: Callable[[], str]
    """The last part of its output, shown when it does not come up."""


Start = Callable[[Spec, contextlib.ExitStack], Running]


def run_dir(cleanup: contextlib.ExitStack) -> str:
    """A private temporary folder for a config, pid file and logs, removed on cleanup."""
    path = tempfile.mkdtemp(prefix="raywds-server-")
    cleanup.callback(shutil.rmtree, path, ignore_errors=True)
    return path
