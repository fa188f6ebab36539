"""Serve a shard directory over HTTP: nginx in Docker, else the local nginx, else an embedded
Python server. It waits until `manifest.json` answers 200 and, if the server does not come up,
raises with its logs.

    with ShardServer("shards/", host="127.0.0.1") as server:   # backend="auto"
        print(server.url, server.backend)                       # http://127.0.0.1:41234 nginx
    server = ShardServer("shards/").start(); ...; server.stop()  # where a `with` does not fit

    raywds serve shards/ --port 8080            # all interfaces; the URL names this node's IP
    raywds serve shards/ --local                # loopback only
    raywds serve --stop-all                     # remove stray raywds containers
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import TracebackType

from raywds.data.manifest import MANIFEST
from raywds.errors import ServerError
from raywds.serve import docker, embedded, nginx  # the backends (raywds.serve.docker, not the SDK)
from raywds.serve.backend import NETWORKS, Spec, Start
from raywds.serve.net import ANY_HOST, advertised_host, hostport, wait_ready

STARTS: dict[str, Start] = {"docker": docker.start, "nginx": nginx.start, "embedded": embedded.start}
"""Each backend's start function, in the order `auto` tries them."""
BACKENDS = ("auto", *STARTS)


class ShardServer:
    """Serves `root` read-only at `self.url` from `start()` (or entering `with`) until `stop()`."""

    def __init__(
        self,
        root: str | Path,
        *,
        backend: str = "auto",
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        image: str = docker.DOCKER_IMAGE,
        network: str = "host",
        pull: bool = True,
        ready_timeout_s: float = 30.0,
        idle_timeout_s: float = embedded.IDLE_TIMEOUT_S,
        num_threads: int = embedded.NUM_THREADS,
    ):
        """`advertise` is the host put in `url` (say, the node IP Ray reports); without it, a
        server on every interface advertises this host's address.

        `idle_timeout_s` and `num_threads` are the embedded backend's: a connection is closed
        when its client sends or takes nothing for `idle_timeout_s` (each wait, not the whole
        request), and at most `num_threads` connections are served at once, the rest waiting
        in the listen backlog. nginx keeps its own limits (its default 60 s timeouts and 75 s
        keep-alive, 1024 connections per worker)."""
        if backend not in BACKENDS:
            raise ServerError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if not idle_timeout_s > 0:
            raise ServerError(
                f"idle_timeout_s={idle_timeout_s} must be above 0; the default is {embedded.IDLE_TIMEOUT_S:.0f} s"
            )
        if num_threads < 1:
            raise ServerError(f"num_threads={num_threads} must be at least 1; the default is {embedded.NUM_THREADS}")
        if network not in NETWORKS:
            raise ServerError(f"network {network!r} is not one of {', '.join(NETWORKS)}")
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ServerError(f"shard directory {self.root} does not exist; run `raywds convert` first")
        if not (self.root / MANIFEST).is_file():
            raise ServerError(f"no {MANIFEST} in {self.root}; serve a folder written by `raywds convert`")
        self.requested = backend
        self.host = host
        self.port = port
        """The port listened on once started; as asked (0: any free one) before."""
        self.advertise = advertise
        self.image = image
        self.network = NETWORKS[network]
        self.pull = pull
        self.ready_timeout_s = ready_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.num_threads = num_threads
        self.backend = ""
        """The backend that serves (or served), once started."""
        self.skipped: list[str] = []
        """Why `auto` passed over backends, one line each."""
        self._asked_port = port
        self._running = False
        self._cleanup = contextlib.ExitStack()

    @property
    def url(self) -> str:
        return f"http://{hostport(advertised_host(self.host, self.advertise), self.port)}"

    def _local_url(self, port: int) -> str:
        """Where this process checks readiness: loopback when listening everywhere."""
        return f"http://{hostport('127.0.0.1' if self.host in ANY_HOST else self.host, port)}/{MANIFEST}"

    def start(self) -> ShardServer:
        """Start the backend asked for, or for `auto` the first of docker, nginx and embedded
        that comes up; return once `manifest.json` answers 200."""
        if self._running:
            raise ServerError(f"the shard server at {self.url} is already running; stop() it before starting it again")
        self.skipped = []
        if self.requested != "auto":
            self._start(self.requested)
            return self
        for backend in STARTS:
            try:
                self._start(backend)
                return self
            except ServerError as e:
                self.skipped.append(f"{backend}: {str(e).splitlines()[0]}")
        raise ServerError("no shard server backend started:\n" + "\n".join(self.skipped))

    def _start(self, backend: str) -> None:
        spec = Spec(
            root=self.root,
            host=self.host,
            port=self._asked_port,
            image=self.image,
            network=self.network,
            pull=self.pull,
            idle_timeout_s=self.idle_timeout_s,
            num_threads=self.num_threads,
        )
        with contextlib.ExitStack() as cleanup:  # undoes what started if it does not come up
            running = STARTS[backend](spec, cleanup)
            wait_ready(self._local_url(running.port), running.alive, self.ready_timeout_s, running.logs)
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
