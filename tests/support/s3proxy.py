"""A reverse proxy in front of an S3 server that breaks chosen GETs on purpose: S3's throttling
answer (503 SlowDown), connections reset mid-body, and answers held back for seconds, as a busy or
flaky object store gives them.

    with S3Proxy(s3, path=r"\\.tar$") as proxy:
        proxy.slowdown_every = 3            # every 3rd GET of a .tar: 503 SlowDown, not forwarded
        proxy.reset_every = 2               # every 2nd: headers and 64 KiB of the body, then a TCP reset
        client = proxy.server.client()      # an S3Server whose endpoint is the proxy
        ...
        assert proxy.num_slowdowns == 1 and ("GET", "/bucket/a.tar", "bytes=0-99") in proxy.log

Every request goes upstream as the client sent it (method, path and query, headers with its Host,
body), so SigV4 signatures still verify; responses stream back as they come, Range answers (206)
included. The matching GETs are counted together, and the Nth is broken by whichever fault's count
divides N, SlowDown first. Standard library only; one thread per connection.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import logging
import re
import socket
import struct
import threading
import time
import urllib.parse
from types import TracebackType

from support.s3server import HOST, S3Server

CHUNK_BYTES = 64 * 1024
SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
)
UPSTREAM_TIMEOUT_S = 30.0
logger = logging.getLogger(__name__)


class S3Proxy:
    """The proxy, listening on 127.0.0.1 at a free port from construction until stop(). Set the
    fault attributes at any time; read the counters and the log once the requests returned."""

    def __init__(self, upstream: S3Server, path: str = r"\.tar$") -> None:
        self.upstream = upstream
        self.path = path
        """Regex (re.search) on the request's path, without its query: which GETs faults apply to."""
        self.slowdown_every = 0
        """Answer every Nth matching GET with 503 SlowDown without forwarding it; 0: never."""
        self.retry_after: str | None = "0"
        """The Retry-After header of a SlowDown answer; None: no header."""
        self.reset_every = 0
        """Reset the connection of every Nth matching GET after reset_after_bytes of its body; 0: never."""
        self.reset_after_bytes = 64 * 1024
        self.pause_s = 0.0
        """Hold each matching GET that no other fault takes this long before forwarding it; 0: never."""
        self.num_pauses = 0
        self.num_requests = 0
        self.num_matching_gets = 0
        self.num_slowdowns = 0
        self.num_resets = 0
        self.log: list[tuple[str, str, str | None]] = []
        """(method, path without query, Range header) of every request, in arrival order."""
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()
        self.httpd = http.server.ThreadingHTTPServer((HOST, 0), handler(self))
        self.httpd.daemon_threads = True
        self.endpoint = f"http://{HOST}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), name="s3proxy", daemon=True)
        self.thread.start()

    @property
    def server(self) -> S3Server:
        """The upstream server as clients see it through the proxy: same bucket and keys."""
        return dataclasses.replace(self.upstream, endpoint=self.endpoint)

    def fault(self, method: str, path: str, range_header: str | None) -> str | None:
        """Count a request and say which fault it gets: "slowdown", "reset", "pause" or None."""
        with self.lock:
            self.num_requests += 1
            self.log.append((method, path, range_header))
            if method != "GET" or not re.search(self.path, path):
                return None
            self.num_matching_gets += 1
            n = self.num_matching_gets
            if self.slowdown_every and n % self.slowdown_every == 0:
                self.num_slowdowns += 1
                return "slowdown"
            if self.reset_every and n % self.reset_every == 0:
                self.num_resets += 1
                return "reset"
            if self.pause_s:
                self.num_pauses += 1
                return "pause"
            return None

    def stop(self) -> None:
        """Stop listening and end the connections still open (clients keep theirs alive)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        with self.lock:
            open_now = list(self.connections)
        for conn in open_now:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.thread.join()

    def __enter__(self) -> S3Proxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()


def reset(conn: socket.socket, request: http.server.BaseHTTPRequestHandler) -> None:
    """Close `conn` with a TCP reset (SO_LINGER 0) once what was written reached the peer: a
    linger-0 close drops bytes still in the send queue, and the client is to get them all."""
    deadline = time.monotonic() + 5.0
    while unsent_bytes(conn) and time.monotonic() < deadline:
        time.sleep(0.005)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    request.close_connection = True
    request.rfile.close()  # a file object of the socket holds its descriptor open too
    conn.close()


def unsent_bytes(conn: socket.socket) -> int:
    """Bytes written to `conn` that the peer has not acknowledged (Linux's SIOCOUTQ); 0 elsewhere."""
    try:
        import fcntl
        import termios

        return struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (ImportError, OSError):
        return 0


def handler(proxy: S3Proxy) -> type[http.server.BaseHTTPRequestHandler]:
    """The request handler class of `proxy`."""
    upstream = urllib.parse.urlsplit(proxy.upstream.endpoint)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as botocore's pool expects
        timeout = 60  # an idle kept-alive connection's thread ends after this

        def setup(self) -> None:
            super().setup()
            with proxy.lock:
                proxy.connections.add(self.connection)

        def finish(self) -> None:
            with proxy.lock:
                proxy.connections.discard(self.connection)
            try:
                super().finish()
            except OSError:
                pass

        def log_message(self, format: str, *args: object) -> None:
            logger.debug("s3proxy: " + format, *args)

        def handle_one_request(self) -> None:
            try:
                super().handle_one_request()
            except (ConnectionError, TimeoutError, http.client.HTTPException) as e:
                logger.debug("s3proxy: %s", e)  # the client went away, or the server did
                self.close_connection = True

        def forward(self) -> None:
            path = urllib.parse.urlsplit(self.path).path
            fault = proxy.fault(self.command, path, self.headers.get("Range"))
            if fault == "slowdown":
                self.send_response_only(503, "Slow Down")
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(SLOWDOWN_BODY)))
                if proxy.retry_after is not None:
                    self.send_header("Retry-After", proxy.retry_after)
                self.end_headers()
                self.wfile.write(SLOWDOWN_BODY)
                return
            if fault == "pause":
                time.sleep(proxy.pause_s)
            upstream_conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=UPSTREAM_TIMEOUT_S)
            try:
                self.send_upstream(upstream_conn)
                response = upstream_conn.getresponse()
                self.send_response_only(response.status, response.reason)
                for name, value in response.getheaders():
                    self.send_header(name, value)  # Connection: close included, which ends ours too
                chunked = response.chunked  # http.client undoes the chunking; ours redoes it
                if response.length is None and not chunked and self.command != "HEAD":
                    self.send_header("Connection", "close")  # its end is the body's end
                self.end_headers()
                if fault == "reset":
                    self.wfile.write(response.read(proxy.reset_after_bytes))
                    reset(self.connection, self)
                    return
                while data := response.read1(CHUNK_BYTES):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
            finally:
                upstream_conn.close()

        def send_upstream(self, conn: http.client.HTTPConnection) -> None:
            """The request as it came: its target, every header in order (Host too), its body."""
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                conn.putheader(name, value)
            chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
            if chunked:
                conn.endheaders()
                while True:
                    size_line = self.rfile.readline()
                    size = int(size_line.split(b";", 1)[0], 16)
                    conn.send(size_line + self.rfile.read(size + 2) if size else size_line)
                    if not size:
                        while (line := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
                            conn.send(line)  # trailers
                        conn.send(b"\r\n")
                        return
            length = int(self.headers.get("Content-Length") or 0)
            conn.endheaders(self.rfile.read(length) if length else None)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = forward

    return Handler
