"""Serve a shard directory over HTTP: nginx in Docker, else the local nginx, else an embedded
Python server. It waits until `manifest.json` answers 200 and, if the server does not come up,
raises with its logs.

    with ShardServer("shards/", host="127.0.0.1") as server:   # backend="auto"
        print(server.url, server.backend)                       # http://127.0.0.1:41234 nginx
    server = ShardServer("shards/").start(); ...; server.stop()  # where a `with` does not fit
    ShardServer("shards/", ServerOptions(backend="embedded", port=8080))  # the options as one object

    raywds serve shards/ --port 8080            # all interfaces; the URL names this node's IP
    raywds serve shards/ --local                # loopback only
    raywds serve --stop-all                     # remove stray raywds containers
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from raywds.data.manifest import MANIFEST
from raywds.errors import ServerError
from raywds.fields import HOST, TEXT, flag
from raywds.serve import docker, embedded, nginx  # the backends (raywds.serve.docker, not the SDK)
from raywds.serve.backend import NETWORKS, Spec, Start
from raywds.serve.net import ANY_HOST, advertised_host, hostport, wait_ready

STARTS: dict[str, Start] = {"docker": docker.start, "nginx": nginx.start, "embedded": embedded.start}
"""Each backend's start function, in the order `auto` tries them."""
TRIES: dict[str, tuple[str, ...]] = {"auto": tuple(STARTS), **{name: (name,) for name in STARTS}}
"""Each `backend` setting and the backends it tries: `auto` each in turn, any other itself alone."""
BACKENDS = tuple(TRIES)


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """How a ShardServer serves: the backend, where it listens, and each backend's own settings.
    `raywds serve`'s flags are made from these (raywds.cli.options.ServeOptions)."""

    backend: str = field(default="auto", metadata=flag(choices=BACKENDS))
    """nginx in Docker, the local nginx, or the embedded Python server; auto tries them in that order."""
    host: str = field(default="127.0.0.1", metadata=flag(form=HOST))
    """Address to listen on (0.0.0.0: every interface, for multi-node jobs)."""
    port: int = field(default=0, metadata=flag(minimum=0, maximum=65_535))
    """Port (0 picks a free one)."""
    advertise: str | None = field(default=None, metadata=flag(form=HOST))
    """Host name or IP workers should use, put in the server's URL (say, the node IP Ray reports);
    default: this node's IP when listening on every interface, else the address listened on."""
    image: str = field(default=docker.DOCKER_IMAGE, metadata=flag(form=TEXT))
    """Docker image with nginx."""
    network: str = field(default="host", metadata=flag(choices=tuple(NETWORKS)))
    """Docker: host networking, or publish the port from a bridge network."""
    no_pull: bool = False
    """Docker: use only a local image, never pull one."""
    ready_timeout_s: float = 30.0
    """How long start() waits for manifest.json to answer 200."""
    idle_timeout_s: float = embedded.IDLE_TIMEOUT_S
    """Embedded: close a connection when its client sends or takes nothing this long (each wait,
    not the whole request). nginx keeps its own limits (60 s timeouts, 75 s keep-alive)."""
    num_threads: int = embedded.NUM_THREADS
    """Embedded: serve at most this many connections at once, the rest waiting in the listen
    backlog. nginx keeps its own limit (1024 connections per worker)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ServerError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if not self.idle_timeout_s > 0:
            raise ServerError(
                f"idle_timeout_s={self.idle_timeout_s} must be above 0; the default is {embedded.IDLE_TIMEOUT_S:.0f} s"
            )
        if self.num_threads < 1:
            raise ServerError(
                f"num_threads={self.num_threads} must be at least 1; the default is {embedded.NUM_THREADS}"
            )
        if self.network not in NETWORKS:
            raise ServerError(f"network {self.network!r} is not one of {', '.join(NETWORKS)}")


class ShardServer:
    """Serves `root` read-only at `self.url` from `start()` (or entering `with`) until `stop()`."""

    def __init__(self, root: str | Path, options: ServerOptions | None = None, **settings: Any) -> None:
        """Serve `root` as `options` say, with `settings` (ServerOptions fields by name) over them:
        `ShardServer(root, backend="embedded")`, or `ShardServer(root, options)` from a command's."""
        self.options = ServerOptions(**settings) if options is None else dataclasses.replace(options, **settings)
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ServerError(f"shard directory {self.root} does not exist; run `raywds convert` first")
        if not (self.root / MANIFEST).is_file():
            raise ServerError(f"no {MANIFEST} in {self.root}; serve a folder written by `raywds convert`")
        self.port = self.options.port
        """The port listened on once started; as asked (0: any free one) before."""
        self.backend = ""
        """The backend that serves (or served), once started."""
        self.skipped: list[str] = []
        """Why `auto` passed over backends, one line each."""
        self._running = False
        self._cleanup = contextlib.ExitStack()

    @property
    def host(self) -> str:
        """The address listened on."""
        return self.options.host

    @property
    def url(self) -> str:
        return f"http://{hostport(advertised_host(self.host, self.options.advertise), self.port)}"

    def _local_url(self, port: int) -> str:
        """Where this process checks readiness: loopback when listening everywhere."""
        return f"http://{hostport('127.0.0.1' if self.host in ANY_HOST else self.host, port)}/{MANIFEST}"

    def start(self) -> ShardServer:
        """Start the backend asked for, or for `auto` the first of docker, nginx and embedded
        that comes up; return once `manifest.json` answers 200."""
        if self._running:
            raise ServerError(f"the shard server at {self.url} is already running; stop() it before starting it again")
        self.skipped = []
        tries = TRIES[self.options.backend]
        if len(tries) == 1:  # asked for by name: its own error
            self._start(tries[0])
            return self
        for backend in tries:
            try:
                self._start(backend)
                return self
            except ServerError as e:
                self.skipped.append(f"{backend}: {str(e).splitlines()[0]}")
        raise ServerError("no shard server backend started:\n" + "\n".join(self.skipped))

    def _start(self, backend: str) -> None:
        options = self.options
        spec = Spec(
            root=self.root,
            host=options.host,
            port=options.port,
            image=options.image,
            network=NETWORKS[options.network],
            no_pull=options.no_pull,
            idle_timeout_s=options.idle_timeout_s,
            num_threads=options.num_threads,
        )
        with contextlib.ExitStack() as cleanup:  # undoes what started if it does not come up
            running = STARTS[backend](spec, cleanup)
            wait_ready(self._local_url(running.port), running.alive, options.ready_timeout_s, running.logs)
            self._cleanup = cleanup.pop_all()
        self.port, self.backend, self._running = running.port, backend, True

    def stop(self) -> None:
        """Stop serving and remove what the backend left (a container, a temporary folder);
        does nothing when not running."""
        self._cleanup.close()
        self._running = False

    def __enter__(self) -> ShardServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
