"""Serve a shard directory over HTTP: nginx in Docker, else the local nginx, else an embedded
Python server. One context manager; it waits until `manifest.json` answers 200 and, if the
server does not come up, raises with its logs.

    with ShardServer("shards/", host="127.0.0.1") as server:   # backend="auto"
        print(server.url, server.backend)                       # http://127.0.0.1:41234 nginx

    raywds serve shards/ --port 8080            # all interfaces; the URL names this node's IP
    raywds serve shards/ --local                # loopback only
    raywds serve --stop-all                     # remove stray raywds containers
"""

from __future__ import annotations

import email.utils
import functools
import http.server
import mimetypes
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

from raywds.errors import ServerError
from raywds.shards import MANIFEST

BACKENDS = ("auto", "docker", "nginx", "embedded")
DOCKER_IMAGE = "nginx:stable"
LABEL = "raywds"
LABEL_VALUE = "shard-server"
CHUNK_BYTES = 256 << 10
IDLE_TIMEOUT_S = 30.0
NUM_THREADS = 64
ANY_HOST = ("0.0.0.0", "::", "")


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def node_ip() -> str:
    """This node's address as other nodes reach it: Ray's view when Ray runs, else the host's."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    try:
        address = socket.gethostbyname(socket.gethostname())
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    # Connecting a UDP socket sends nothing; it only asks the kernel which source address it would use.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1 (RFC 5737): never routed on the internet
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def advertised_host(bind_host: str, advertise: str | None = None) -> str:
    """The host in the URL handed to workers: `advertise` if given, the node IP when listening
    on every interface, else the address listened on."""
    if advertise:
        return advertise
    return node_ip() if bind_host in ANY_HOST else bind_host


def nginx_conf(*, root: str, listen: str, run_dir: str, as_root: bool, error_log: str) -> str:
    """One config for the local binary and the Docker image: foreground, no directory listing,
    nothing whose path has a part starting with a dot (a converter's state, journal and
    half-written shards); nginx decodes `%2e` before it matches locations."""
    temp = "\n".join(f"    {kind}_temp_path {run_dir}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    # Workers read the shards as the user who started the server (root included): the shard
    # directory is often private to that user, e.g. under pytest's tmp_path.
    user = "user root root;\n" if as_root else ""
    return f"""{user}daemon off;
worker_processes 2;
pid {run_dir}/nginx.pid;
error_log {error_log} warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
{temp}
    types {{ application/x-tar tar; application/json json; }}
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    server {{
        listen {listen};
        root {root};
        autoindex off;
        location / {{ try_files $uri =404; }}
        location ~ /\\. {{ return 404; }}
    }}
}}
"""


def wait_ready(url: str, alive: Any, timeout_s: float, logs: Any) -> None:
    """Poll `url` until it answers 200; raise with the backend's logs if it dies or times out."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if not alive():
            raise ServerError(f"shard server exited before answering {url}:\n{logs()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(0.1)
    raise ServerError(f"shard server did not answer {url} within {timeout_s:.0f} s ({last}):\n{logs()}")


class ShardHandler(http.server.BaseHTTPRequestHandler):
    """GET and HEAD of regular files under `root`, with byte ranges, streamed in chunks.
    No directory listing, nothing outside `root` (`..`, encoded or not, absolute paths and
    symlinks that lead out) and nothing hidden (a path part starting with a dot, encoded or
    not): all 404, as if absent, like every other file a client may not have. `timeout`
    bounds each wait for the client to send or take bytes."""

    root: Path
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        pass

    def resolve(self) -> Path | None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        parts = [p for p in path.split("/") if p]
        if "\x00" in path or any(p.startswith(".") or "\\" in p for p in parts):
            return None
        target = Path(os.path.realpath(self.root.joinpath(*parts)))
        if not target.is_relative_to(self.root) or not target.is_file():
            return None
        return target

    def send_plain(self, status: int, text: str, extra: dict[str, str] | None = None) -> None:
        body = text.encode()
        self.send_response(status)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        target = self.resolve()
        if target is None:
            self.send_plain(404, "not found\n")
            return
        size = target.stat().st_size
        start, end = 0, size - 1
        status = 200
        wanted = self.headers.get("Range")
        if wanted:
            match = re.fullmatch(r"bytes=(\d*)-(\d*)", wanted.strip())
            if match is None or match.groups() == ("", ""):
                self.send_plain(416, "bad range\n", {"Content-Range": f"bytes */{size}"})
                return
            first, last = match.groups()
            if first:
                start, end = int(first), min(int(last), size - 1) if last else size - 1
            else:
                start, end = max(size - int(last), 0), size - 1
            if start >= size or start > end:
                self.send_plain(416, "range not satisfiable\n", {"Content-Range": f"bytes */{size}"})
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", mimetypes.guess_type(target.name)[0] or "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Last-Modified", email.utils.formatdate(target.stat().st_mtime, usegmt=True))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        with target.open("rb") as f:
            f.seek(start)
            left = end - start + 1
            while left:
                chunk = f.read(min(CHUNK_BYTES, left))
                if not chunk:
                    break
                self.send_all(chunk)
                left -= len(chunk)

    def send_all(self, data: bytes) -> None:
        """`sendall`, but the timeout bounds each wait for the client to take bytes, not the
        whole chunk: a slow client that keeps reading is never cut."""
        view = memoryview(data)
        while view:
            view = view[self.connection.send(view) :]


class _Server(http.server.ThreadingHTTPServer):
    """One thread per connection, at most `num_threads` at once. The accept loop waits for a
    free thread, so further clients wait in the listen backlog (connected, their request
    unread) until an earlier one finishes or idles out, rather than being refused: a loader
    that finds every thread busy is served a little later, where a refusal would cost it a
    retry with backoff, and several refusals a skipped shard."""

    daemon_threads = True
    request_queue_size = 1024  # the listen backlog (the kernel caps it at net.core.somaxconn)

    def __init__(self, address: tuple[str, int], handler: type[ShardHandler], num_threads: int):
        self.free = threading.BoundedSemaphore(num_threads)
        self.closing = threading.Event()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        while not self.free.acquire(timeout=0.1):
            if self.closing.is_set():
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.free.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.free.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up mid-shard (a loader at the end of its epoch) or stops taking
        bytes for the idle timeout is not an error: socketserver would print a traceback to
        stderr for each one."""
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError, TimeoutError)):
            return
        super().handle_error(request, client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Logs:
    """A container's output, collected by a thread as it comes, so it outlives auto_remove."""

    def __init__(self, container: Any):
        self.text = ""
        self.thread = threading.Thread(target=self._follow, args=(container,), daemon=True)
        self.thread.start()

    def _follow(self, container: Any) -> None:
        try:
            for chunk in container.logs(stream=True, follow=True):
                self.text += chunk.decode(errors="replace")
        except Exception:  # noqa: BLE001 - the container went away; keep what we have
            pass

    def tail(self) -> str:
        self.thread.join(timeout=1)
        return self.text[-3000:] or "(no output from the container)"


def docker_client() -> Any:
    """The Docker SDK client for DOCKER_HOST or the default socket; ServerError if no engine answers."""
    try:
        import docker

        client = docker.from_env()
        client.ping()
        return client
    except Exception as e:  # noqa: BLE001 - any failure to reach an engine means "no docker"
        raise ServerError(f"no Docker engine answers ({type(e).__name__}: {e})") from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stray_containers(client: Any, *, everyone: bool) -> list[Any]:
    """raywds shard-server containers: all of them, or those whose owning process on this host is gone."""
    found = client.containers.list(all=True, filters={"label": f"{LABEL}={LABEL_VALUE}"})
    if everyone:
        return list(found)
    host = socket.gethostname()
    return [c for c in found if c.labels.get("raywds.host") == host and not _pid_alive(int(c.labels.get("raywds.pid", "0") or 0))]


def stop_all() -> int:
    """Remove every raywds shard-server container; returns how many."""
    client = docker_client()
    containers = stray_containers(client, everyone=True)
    for c in containers:
        c.remove(force=True)
    return len(containers)


class ShardServer:
    """A context manager that serves `root` read-only at `self.url` until exit."""

    def __init__(
        self, root: str | Path, *, backend: str = "auto", host: str = "127.0.0.1", port: int = 0,
        advertise: str | None = None, image: str = DOCKER_IMAGE, network: str = "host", pull: bool = True,
        ready_timeout_s: float = 30.0, idle_timeout_s: float = IDLE_TIMEOUT_S, num_threads: int = NUM_THREADS,
    ):  # fmt: skip
        """`idle_timeout_s` and `num_threads` are the embedded backend's: a connection is closed
        when its client sends or takes nothing for `idle_timeout_s` (each wait, not the whole
        request), and at most `num_threads` connections are served at once, the rest waiting
        in the listen backlog. nginx keeps its own limits (its default 60 s timeouts and 75 s
        keep-alive, 1024 connections per worker)."""
        if backend not in BACKENDS:
            raise ServerError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if not idle_timeout_s > 0:
            raise ServerError(f"idle_timeout_s={idle_timeout_s} must be above 0; the default is {IDLE_TIMEOUT_S:.0f} s")
        if num_threads < 1:
            raise ServerError(f"num_threads={num_threads} must be at least 1; the default is {NUM_THREADS}")
        if network not in ("host", "bridge"):
            raise ServerError(f"network {network!r} is not host or bridge")
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ServerError(f"shard directory {self.root} does not exist; run `raywds convert` first")
        if not (self.root / MANIFEST).is_file():
            raise ServerError(f"no {MANIFEST} in {self.root}; serve a folder written by `raywds convert`")
        self.requested = backend
        self.host = host
        self.port = port
        self.advertise = advertise
        self.image = image
        self.network = network
        self.pull = pull
        self.ready_timeout_s = ready_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.num_threads = num_threads
        self.backend = ""
        self.skipped: list[str] = []
        """Why `auto` passed over backends, one line each."""
        self._stop: list[Any] = []

    @property
    def url(self) -> str:
        return f"http://{self._listen(advertised_host(self.host, self.advertise), self.port)}"

    @property
    def _local_url(self) -> str:
        """Where this process checks readiness: loopback when listening everywhere."""
        return f"http://{self._listen('127.0.0.1' if self.host in ANY_HOST else self.host, self.port)}/{MANIFEST}"

    def __enter__(self) -> ShardServer:
        if self.requested != "auto":
            self._start(self.requested)
            return self
        for backend in ("docker", "nginx", "embedded"):
            try:
                self._start(backend)
                return self
            except ServerError as e:
                self.skipped.append(f"{backend}: {str(e).splitlines()[0]}")
        raise ServerError("no shard server backend started:\n" + "\n".join(self.skipped))

    def _start(self, backend: str) -> None:
        try:
            getattr(self, f"_start_{backend}")()
            self.backend = backend
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]) -> None:
        self.close()

    def close(self) -> None:
        while self._stop:
            self._stop.pop()()

    def _run_dir(self) -> str:
        run_dir = tempfile.mkdtemp(prefix="raywds-server-")
        self._stop.append(functools.partial(shutil.rmtree, run_dir, ignore_errors=True))
        return run_dir

    @staticmethod
    def _listen(host: str, port: int) -> str:
        """host:port, with IPv6 addresses in brackets."""
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _start_nginx(self) -> None:
        binary = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
        if binary is None:
            raise ServerError("no nginx binary on PATH; install it (apt-get install nginx-light) or use --backend embedded")
        port = self.port or free_port(self.host if self.host not in ANY_HOST else "0.0.0.0")
        run_dir = self._run_dir()
        conf = Path(run_dir) / "nginx.conf"
        log = Path(run_dir) / "error.log"
        conf.write_text(nginx_conf(root=str(self.root), listen=self._listen(self.host or "0.0.0.0", port), run_dir=run_dir, as_root=os.geteuid() == 0, error_log=str(log)))
        proc = subprocess.Popen(
            [binary, "-e", str(log), "-p", run_dir, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=open(log, "ab")  # noqa: SIM115
        )

        def stop() -> None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

        self._stop.append(stop)
        self.port = port
        wait_ready(self._local_url, lambda: proc.poll() is None, self.ready_timeout_s, lambda: log.read_text(errors="replace")[-2000:])

    def _start_embedded(self) -> None:
        handler = type("Handler", (ShardHandler,), {"root": self.root, "timeout": self.idle_timeout_s})
        try:
            httpd = (_Server6 if ":" in self.host else _Server)((self.host, self.port), handler, self.num_threads)
        except OSError as e:
            raise ServerError(f"embedded server cannot listen on {self.host}:{self.port}: {e}") from None
        self.port = int(httpd.server_address[1])
        thread = threading.Thread(target=httpd.serve_forever, name="raywds-shard-server", daemon=True)
        thread.start()

        def stop() -> None:
            httpd.closing.set()  # an accept loop waiting for a free thread gives up
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=10)

        self._stop.append(stop)
        wait_ready(self._local_url, thread.is_alive, self.ready_timeout_s, lambda: "(embedded server)")

    def _image_here(self, client: Any) -> None:
        """The image, pulled first when allowed and missing."""
        import docker.errors

        try:
            client.images.get(self.image)
            return
        except docker.errors.ImageNotFound:
            if not self.pull:
                raise ServerError(f"image {self.image} is not here and pulling is off; give a local nginx image with --image") from None
        try:
            client.images.pull(self.image)
        except docker.errors.DockerException as e:
            raise ServerError(f"image {self.image} is not here and cannot be pulled ({str(e).splitlines()[0][:200]}); give a local nginx image with --image") from None

    def _start_docker(self) -> None:
        import docker.errors

        client = docker_client()
        for stray in stray_containers(client, everyone=False):  # left by a process that crashed
            stray.remove(force=True)
        self._image_here(client)
        port = self.port or free_port(self.host if self.host not in ANY_HOST else "0.0.0.0")
        run_dir = self._run_dir()
        inside = "/usr/share/nginx/html"
        listen = self._listen(self.host or "0.0.0.0", port) if self.network == "host" else f"0.0.0.0:{port}"
        Path(run_dir, "nginx.conf").write_text(nginx_conf(root=inside, listen=listen, run_dir="/tmp", as_root=True, error_log="stderr"))
        name = f"raywds-shards-{os.getpid()}-{port}-{uuid.uuid4().hex[:6]}"
        options: dict[str, Any] = {"network_mode": "host"} if self.network == "host" else {"ports": {f"{port}/tcp": (self.host or "0.0.0.0", port)}}
        try:
            container = client.containers.run(
                self.image,
                command=["nginx", "-e", "stderr", "-c", "/etc/raywds/nginx.conf"],
                name=name,
                detach=True,
                auto_remove=True,
                volumes={str(self.root): {"bind": inside, "mode": "ro"}, run_dir: {"bind": "/etc/raywds", "mode": "ro"}},
                labels={LABEL: LABEL_VALUE, "raywds.pid": str(os.getpid()), "raywds.host": socket.gethostname(), "raywds.root": str(self.root)},
                **options,
            )
        except docker.errors.DockerException as e:
            raise ServerError(f"cannot start a {self.image} container: {e}") from None
        logs = _Logs(container)

        def stop() -> None:
            try:
                container.remove(force=True)
            except docker.errors.DockerException:
                pass  # auto_remove got there first

        self._stop.append(stop)

        def alive() -> bool:
            try:
                container.reload()
            except docker.errors.NotFound:
                return False
            return bool(container.status in ("created", "running"))

        self.port = port
        wait_ready(self._local_url, alive, self.ready_timeout_s, logs.tail)
