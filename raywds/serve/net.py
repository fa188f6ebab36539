"""Addresses and readiness for the shard servers: a free port, the host to put in URLs, and a
poll until a URL answers 200.

    wait_ready(f"http://{hostport('127.0.0.1', port)}/manifest.json", alive, 30.0, logs)
"""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from raywds.errors import ServerError

ANY_HOST = ("0.0.0.0", "::", "")
"""Bind addresses meaning every interface."""


def free_port(host: str) -> int:
    """A port nothing listens on at `host` right now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def hostport(host: str, port: int) -> str:
    """host:port, with IPv6 addresses in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def node_ip() -> str:
    """This host's address as other hosts reach it: its name's address, else the source address
    of its default route, else 127.0.0.1. On Ray the launcher knows better and passes `advertise`."""
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


def wait_ready(url: str, alive: Callable[[], bool], timeout_s: float, logs: Callable[[], str]) -> None:
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
