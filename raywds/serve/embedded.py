"""The embedded backend: a threaded Python HTTP server for a shard folder, for hosts with neither
Docker nor nginx. GET and HEAD with byte ranges, nothing hidden, nothing outside the folder.

    with ShardServer("shards/", backend="embedded") as server: ...
"""

from __future__ import annotations

import contextlib
import email.utils
import http.server
import mimetypes
import os
import re
import socket
import sys
import threading
import urllib.parse
from pathlib import Path
from typing import Any

from raywds.errors import ServerError
from raywds.serve.backend import Running, Spec

CHUNK_BYTES = 256 << 10
IDLE_TIMEOUT_S = 30.0
NUM_THREADS = 64
STOP_POLL_S = 0.5
"""How often the accept loop looks whether stop() was called; stop() waits up to this long."""


class ShardHandler(http.server.BaseHTTPRequestHandler):
    """GET and HEAD of regular files under `root`, with byte ranges, streamed in chunks.
    No directory listing, nothing outside `root` (`..`, encoded or not, absolute paths), no
    symlink below it (as nginx's `disable_symlinks on`) and nothing hidden (a path part starting
    with a dot, encoded or not): all 404, as if absent, like every other file a client may not have. `timeout`
    bounds each wait for the client to send or take bytes."""

    root: Path
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def resolve(self) -> Path | None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        parts = [p for p in path.split("/") if p]
        if "\x00" in path or any(p.startswith(".") or "\\" in p for p in parts):
            return None
        target = self.root.joinpath(*parts)  # `root` is resolved and no part is `.` or `..`
        if os.path.realpath(target) != str(target) or not target.is_file():  # a symlink on the way
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


def start(spec: Spec, cleanup: contextlib.ExitStack) -> Running:
    """Serve `spec.root` from a thread of this process until `cleanup` closes."""
    handler = type("Handler", (ShardHandler,), {"root": spec.root, "timeout": spec.idle_timeout_s})
    try:
        httpd = (_Server6 if ":" in spec.host else _Server)((spec.host, spec.port), handler, spec.num_threads)
    except OSError as e:
        raise ServerError(f"embedded server cannot listen on {spec.host}:{spec.port}: {e}") from None
    thread = threading.Thread(target=httpd.serve_forever, args=(STOP_POLL_S,), name="raywds-shard-server", daemon=True)
    thread.start()

    @cleanup.callback
    def stop() -> None:
        httpd.closing.set()  # an accept loop waiting for a free thread gives up
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)

    return Running(port=int(httpd.server_address[1]), alive=thread.is_alive, logs=lambda: "(embedded server)")
