"""Shard servers, for real, on loopback: nginx in a real Docker engine (an image built here
with `docker import`), the local nginx binary, and the embedded server."""

from __future__ import annotations

import hashlib
import http.client
import os
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds
from support import docker_nginx

from raywds.data.manifest import read_manifest
from raywds.errors import ServerError
from raywds.serve import LABEL, LABEL_VALUE, ShardServer, advertised_host, docker_client, free_port, stray_containers

HAVE_NGINX = docker_nginx.nginx_binary() is not None
IN_CI = bool(os.environ.get("CI"))
RAYWDS = Path(sys.executable).parent / "raywds"


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The private Docker engine that .ci/run starts, named by RAYWDS_TEST_DOCKER_HOST (kept out of
    DOCKER_HOST so that no other test's `auto` server asks an engine to pull an image)."""
    where = os.environ.get("RAYWDS_TEST_DOCKER_HOST")
    if not where:
        if IN_CI:
            pytest.fail("CI must run the Docker tests: .ci/run starts a dockerd and sets RAYWDS_TEST_DOCKER_HOST")
        pytest.skip(
            "no test Docker engine: .ci/run starts a private dockerd; or set RAYWDS_TEST_DOCKER_HOST=unix:///path/docker.sock"
        )
    monkeypatch.setenv("DOCKER_HOST", where)
    try:
        client = docker_client()
    except ServerError as e:
        if IN_CI:
            pytest.fail(f"CI must reach a Docker engine (.ci/run starts one): {e}")
        pytest.skip(f"{e}; .ci/run starts a private dockerd, or set DOCKER_HOST")
    if not HAVE_NGINX:
        pytest.skip("no nginx binary to build the test image from (apt-get install nginx-light)")
    yield client
    for c in client.containers.list(all=True, filters={"label": f"{LABEL}={LABEL_VALUE}"}):
        c.remove(force=True)


def serve(request: pytest.FixtureRequest, root: Path) -> Iterator[ShardServer]:
    """A running server of the backend `request.param` on 127.0.0.1."""
    options: dict[str, Any] = {}
    if request.param == "docker":
        options["image"] = docker_nginx.build(request.getfixturevalue("engine"))
    elif request.param == "nginx" and not HAVE_NGINX and not IN_CI:
        pytest.skip("no nginx binary (CI installs it)")
    with ShardServer(root, backend=request.param, host="127.0.0.1", **options) as running:
        assert running.backend == request.param
        yield running


@pytest.fixture(params=["docker", "nginx", "embedded"])
def server(request: pytest.FixtureRequest, shards: Path) -> Iterator[ShardServer]:
    """A running server of each backend on 127.0.0.1."""
    yield from serve(request, shards)


HIDDEN = [".raywds-convert.json", ".raywds-done.jsonl", ".imagenet-train-000000.tar.tmp", "sub/.part", ".git/config"]


@pytest.fixture(scope="module")
def with_hidden(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shards next to the hidden files a converter at work leaves: its state, its journal, a
    shard being written, and a dot folder."""
    root = tmp_path_factory.mktemp("hidden") / "served"
    shutil.copytree(shards, root)
    for name in HIDDEN:
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_text("not for clients")
    (root / "sub" / "visible.txt").write_text("for clients")
    return root


@pytest.fixture(params=["docker", "nginx", "embedded"])
def hidden_server(request: pytest.FixtureRequest, with_hidden: Path) -> Iterator[ShardServer]:
    yield from serve(request, with_hidden)


def fetch(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, dict(response.headers), response.read()


def test_serves_every_shard_byte_for_byte(server: ShardServer, shards: Path) -> None:
    assert server.url.startswith("http://127.0.0.1:")
    for name in sorted(p.name for p in shards.iterdir() if not p.name.startswith(".")):
        assert fetch(f"{server.url}/{name}")[2] == (shards / name).read_bytes(), name
    manifest = read_manifest(server.url)
    assert manifest.num_samples("train") == 120
    assert len(list(wds.WebDataset([manifest.url(s) for s in manifest.shards("val")], shardshuffle=False))) == 50


def test_head_ranges_and_404(server: ShardServer, shards: Path) -> None:
    name = read_manifest(str(shards)).shards("train")[0].name
    data = (shards / name).read_bytes()
    status, headers, body = fetch(f"{server.url}/{name}", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) == len(data)
    status, headers, body = fetch(f"{server.url}/{name}", {"Range": "bytes=512-1535"})
    assert status == 206 and body == data[512:1536] and headers["Content-Range"] == f"bytes 512-1535/{len(data)}"
    assert fetch(f"{server.url}/{name}", {"Range": f"bytes={len(data) - 100}-"})[2] == data[-100:]
    for missing in ("imagenet-train-999999.tar", "", "no/such/dir/"):
        with pytest.raises(urllib.error.HTTPError, match="404"):
            fetch(f"{server.url}/{missing}")


def test_a_stopped_server_is_gone(shards: Path) -> None:
    with ShardServer(shards, backend="embedded") as server:
        url = server.url
    with pytest.raises(urllib.error.URLError):
        fetch(f"{url}/manifest.json")


@pytest.mark.parametrize("backend", ["nginx", "embedded"])
def test_start_and_stop_without_a_with_block(shards: Path, backend: str) -> None:
    """For a notebook, where a `with` cannot span cells: start() returns the running server,
    stop() ends it and may be called again, and a stopped server starts again."""
    if backend == "nginx" and not HAVE_NGINX and not IN_CI:
        pytest.skip("no nginx binary (CI installs it)")
    server = ShardServer(shards, backend=backend)
    assert server.start() is server and server.backend == backend
    url = server.url
    assert fetch(f"{url}/manifest.json")[2] == (shards / "manifest.json").read_bytes()
    with pytest.raises(ServerError, match=r"already running; stop\(\) it before starting it again"):
        server.start()
    server.stop()
    with pytest.raises(urllib.error.URLError, match="Connection refused"):
        fetch(f"{url}/manifest.json")
    server.stop()
    try:
        assert fetch(f"{server.start().url}/manifest.json")[0] == 200
    finally:
        server.stop()


def test_the_url_names_the_advertised_host(shards: Path) -> None:
    """The Ray launcher passes the node IP that Ray reports; the server listens everywhere."""
    with ShardServer(shards, backend="embedded", host="0.0.0.0", advertise="10.1.2.3") as server:
        assert server.url == f"http://10.1.2.3:{server.port}"
        assert fetch(f"http://127.0.0.1:{server.port}/manifest.json")[0] == 200


def test_importing_the_servers_loads_neither_ray_nor_docker() -> None:
    """Ray stays with the launcher and the Docker SDK with the docker backend: importing
    raywds.serve, or finding the host to advertise, loads neither."""
    code = (
        "import sys, raywds.serve; raywds.serve.advertised_host('0.0.0.0'); "
        "print(sorted({'ray', 'docker'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_32_clients_stream_every_shard_and_every_byte_checks_out(server: ShardServer, shards: Path) -> None:
    manifest = read_manifest(str(shards))
    expected = {s.name: s.sha256 for split in ("train", "val") for s in manifest.shards(split)}
    bad: list[str] = []

    def client(i: int) -> None:
        names = sorted(expected)
        for name in names[i % len(names) :] + names[: i % len(names)]:  # each client its own order
            try:
                digest = hashlib.sha256(fetch(f"{server.url}/{name}")[2]).hexdigest()
            except OSError as e:
                bad.append(f"client {i} {name}: {e}")
                continue
            if digest != expected[name]:
                bad.append(f"client {i} {name}: sha256 {digest}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and bad == []
    assert fetch(f"{server.url}/manifest.json")[0] == 200, "the server is still up"


@pytest.fixture(params=["docker", "nginx"])
def nginx_server(request: pytest.FixtureRequest, shards: Path) -> Iterator[ShardServer]:
    yield from serve(request, shards)


def test_nginx_keeps_3000_streams_open_at_once(nginx_server: ShardServer, shards: Path) -> None:
    """Thousands of ranks' loader workers each hold a connection: 3,000 open at once, each in
    the middle of its request (which nginx cannot close to make room, as it may an idle one),
    then each answered. nginx's old 2 x 1,024 connections left the rest waiting to connect."""
    streams = 3000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if min(hard, 8192) < streams + 200:
        pytest.skip(f"this process may open only {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    name = read_manifest(str(shards)).shards("train")[0].name
    host, port = nginx_server.url.removeprefix("http://").rsplit(":", 1)
    opened: list[socket.socket] = []
    try:
        for _ in range(streams):  # a connection nginx cannot take waits in the listen queue, then times out
            sock = socket.create_connection((host, int(port)), timeout=5)
            opened.append(sock)
            sock.sendall(f"GET /{name} HTTP/1.1\r\nHost: {host}\r\nRange: bytes=0-511\r\n".encode())
        for sock in opened:
            sock.sendall(b"\r\n")  # the request's end
        answered = sum(1 for sock in opened if sock.recv(64).startswith(b"HTTP/1.1 206"))
    finally:
        for sock in opened:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert answered == streams, f"{streams - answered} of {streams} streams got no answer"


def folder_with_links(shards: Path, root: Path, links: dict[str, str]) -> Path:
    """ROOT/served: a copy of `shards` with `links` (name: target) in it, beside ROOT/secret.txt."""
    (root / "secret.txt").write_text("not for clients")
    served = root / "served"
    shutil.copytree(shards, served)
    for name, target in links.items():
        (served / name).symlink_to(target)
    return served


@pytest.fixture(scope="module")
def confined(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shard folder holding a symlink that leads out of it, next to a secret."""
    root = tmp_path_factory.mktemp("confined")
    served = folder_with_links(shards, root, {"escape.txt": str(root / "secret.txt")})
    (served / "sub").mkdir()
    return served


def raw_get(url: str, path: str) -> int:
    """The status for a request path sent exactly as written (urllib would normalise `..`)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", path)
    status = conn.getresponse().status
    conn.close()
    return status


@pytest.mark.parametrize(
    "path",
    [
        "/../secret.txt",
        "/%2e%2e/secret.txt",
        "/sub/%2E%2E/%2e%2e/secret.txt",
        "//etc/passwd",
        "/%2Fetc%2Fpasswd",
        "/escape.txt",
        "/sub/",
        "/",
    ],
)
def test_embedded_server_never_leaves_its_folder(confined: Path, path: str) -> None:
    with ShardServer(confined, backend="embedded") as server:
        assert raw_get(server.url, path) == 404
        assert raw_get(server.url, "/manifest.json") == 200


LINKS = {
    "leak.tar": "/etc/passwd",  # absolute, out of the folder
    "secret.tar": "../secret.txt",  # relative, out of the folder
    "inside.tar": "imagenet-train-000000.tar",  # a shard of the folder itself
    "linked": "/etc",  # a folder out of it
}


@pytest.fixture(scope="module")
def linked(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shard folder holding symlinks: out of it, to a secret beside it, and to one of its own shards."""
    return folder_with_links(shards, tmp_path_factory.mktemp("linked"), LINKS)


@pytest.fixture(params=["docker", "nginx", "embedded"])
def linked_server(request: pytest.FixtureRequest, linked: Path) -> Iterator[ShardServer]:
    yield from serve(request, linked)


def test_no_backend_follows_a_symlink(linked_server: ShardServer) -> None:
    """Not the host's /etc/passwd (Docker: the container's), not a secret beside the folder, and
    not a link to a shard of its own, so that every backend serves the same files."""
    url = linked_server.url
    for path in ("/leak.tar", "/secret.tar", "/inside.tar", "/linked/passwd"):
        assert raw_get(url, path) == 404, path
    assert raw_get(url, "/imagenet-train-000000.tar") == 200 and raw_get(url, "/manifest.json") == 200


def test_no_backend_serves_hidden_files(hidden_server: ShardServer) -> None:
    """The converter's state, journal and half-written shards start with a dot: 404, as if
    absent, however the dot is spelled."""
    url = hidden_server.url
    for name in HIDDEN:
        for spelled in (name, name.replace(".", "%2e", 1), name.replace(".", "%2E", 1)):
            assert raw_get(url, f"/{spelled}") == 404, spelled
    assert raw_get(url, "/sub/visible.txt") == 200 and raw_get(url, "/manifest.json") == 200


def test_embedded_server_streams_in_chunks(tmp_path: Path, shards: Path) -> None:
    shutil.copytree(shards, tmp_path / "s")
    big = tmp_path / "s" / "big.tar"
    big.write_bytes(os.urandom(5 << 20))
    with ShardServer(tmp_path / "s", backend="embedded") as server:
        with urllib.request.urlopen(f"{server.url}/big.tar", timeout=10) as response:
            assert response.read(1000) == big.read_bytes()[:1000]  # the first bytes come before the whole file is read


def read_to_eof(sock: socket.socket) -> bytes:
    got = bytearray()
    while chunk := sock.recv(1 << 16):
        got += chunk
    return bytes(got)


@pytest.mark.timeout(60)
def test_embedded_server_hangs_up_on_idle_clients_and_bounds_its_threads(shards: Path) -> None:
    """100 clients that connect and say nothing, or keep a connection open after one request,
    hold at most `num_threads` threads and are hung up on after `idle_timeout_s`; a client that
    asks for a shard meanwhile waits for a free thread, at most about that long, and is served."""
    manifest = (shards / "manifest.json").read_bytes()
    name = read_manifest(str(shards)).shards("train")[0].name
    with ShardServer(shards, backend="embedded", idle_timeout_s=1.0, num_threads=64) as server:
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(100)]
        try:
            for sock in idle[:10]:  # keep-alive: one request, then silence
                sock.sendall(b"GET /manifest.json HTTP/1.1\r\nHost: x\r\n\r\n")
            peak = 0
            for _ in range(10):
                peak = max(peak, threading.active_count() - before)
                time.sleep(0.05)
            assert 0 < peak <= 64, f"{peak} threads for 100 idle connections"
            started = time.monotonic()
            assert fetch(f"{server.url}/{name}")[2] == (shards / name).read_bytes(), (
                "a shard is served while 100 clients idle"
            )
            for i, sock in enumerate(idle):
                answer = read_to_eof(sock)  # b"" once the server hangs up; TimeoutError after 10 s if it never does
                if i < 10:
                    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(manifest), answer[:200]
                else:
                    assert answer == b""
            assert time.monotonic() - started < 6, "idle clients are hung up on after about 1 s per wave of 64"
        finally:
            for sock in idle:
                sock.close()
        assert fetch(f"{server.url}/{name}")[2] == (shards / name).read_bytes(), "and served after"
        deadline = time.monotonic() + 5
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= before, "every connection's thread has ended"


@pytest.mark.timeout(60)
def test_embedded_server_stops_at_once_with_every_thread_busy(shards: Path) -> None:
    """Its accept loop, waiting for a free thread, does not hold up the end of the `with` block."""
    before = {t.ident for t in threading.enumerate()}
    with ShardServer(shards, backend="embedded", idle_timeout_s=30.0, num_threads=2) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(4)]
        deadline = time.monotonic() + 10  # until both its threads hold a connection: the accept loop waits
        while len([t for t in threading.enumerate() if t.ident not in before and "process_request" in t.name]) < 2:
            assert time.monotonic() < deadline, "the server never had both threads busy"
            time.sleep(0.01)
        started = time.monotonic()
    assert time.monotonic() - started < 3
    for sock in idle:
        sock.close()


@pytest.mark.timeout(60)
def test_embedded_server_does_not_cut_a_slow_but_steady_download(tmp_path: Path, shards: Path) -> None:
    """The idle timeout bounds each wait to read or write, not a request: a client that takes
    about 2.5 s over a 32 MB shard, with pauses shorter than the timeout, gets every byte."""
    shutil.copytree(shards, tmp_path / "s")
    data = os.urandom(32 << 20)
    (tmp_path / "s" / "big.tar").write_bytes(data)
    with ShardServer(tmp_path / "s", backend="embedded", idle_timeout_s=1.0) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /big.tar HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            got = bytearray()
            started = time.monotonic()
            paused = False
            while chunk := sock.recv(1 << 20):
                got += chunk
                if not paused and len(got) > 16 << 20:
                    time.sleep(0.6)  # one pause shorter than the timeout, mid-shard
                    paused = True
                time.sleep(max(0.0, started + len(got) / (16 << 20) - time.monotonic()))  # 16 MB/s
            elapsed = time.monotonic() - started
    head, _, body = bytes(got).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and len(body) == len(data), (
        f"{head[:100]!r}: {len(body)} of {len(data)} bytes"
    )
    assert body == data
    assert elapsed > 2.0, f"the download took {elapsed:.1f} s, not longer than twice the timeout"


def test_auto_skips_an_unreachable_engine_with_one_line(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with ShardServer(shards) as server:
        assert server.backend == ("nginx" if HAVE_NGINX else "embedded")
        assert server.skipped == ["docker: no Docker engine at unix:///nonexistent/docker.sock (no such socket)"]
        assert fetch(f"{server.url}/manifest.json")[2] == (shards / "manifest.json").read_bytes()


def test_asked_for_by_name_an_unavailable_backend_says_why(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(ServerError, match=r"no Docker engine at unix:///nonexistent/docker.sock \(no such socket\)"):
        with ShardServer(shards, backend="docker"):
            pass
    monkeypatch.setenv("PATH", "/nonexistent")
    if not Path("/usr/sbin/nginx").exists():
        with pytest.raises(ServerError, match=r"no nginx binary on PATH; install it \(apt-get install nginx-light\)"):
            with ShardServer(shards, backend="nginx"):
                pass


def test_auto_prefers_docker_when_an_engine_answers(engine: Any, shards: Path) -> None:
    with ShardServer(shards, image=docker_nginx.build(engine), no_pull=True) as server:
        assert server.backend == "docker" and server.skipped == []
        (container,) = engine.containers.list(filters={"label": f"{LABEL}={LABEL_VALUE}"})
        assert container.labels["raywds.pid"] == str(os.getpid()) and container.attrs["HostConfig"]["AutoRemove"]
        mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
        assert (
            mounts["/usr/share/nginx/html"]["Source"] == str(shards) and mounts["/usr/share/nginx/html"]["RW"] is False
        )
    assert engine.containers.list(all=True, filters={"label": f"{LABEL}={LABEL_VALUE}"}) == []


def test_docker_failure_shows_the_container_log(engine: Any, shards: Path) -> None:
    port = free_port("127.0.0.1")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(ServerError, match=r"(?s)shard server exited before answering .*Address already in use"):
            with ShardServer(shards, backend="docker", port=port, image=docker_nginx.build(engine)):
                pass


def test_docker_without_the_image_says_to_give_one(engine: Any, shards: Path) -> None:
    with pytest.raises(
        ServerError,
        match=r"image raywds-no-such-image:1 is not here and pulling is off; give a local nginx image with --image",
    ):
        with ShardServer(shards, backend="docker", image="raywds-no-such-image:1", no_pull=True):
            pass


def test_many_servers_on_one_machine_do_not_collide(engine: Any, shards: Path) -> None:
    image = docker_nginx.build(engine)
    with (
        ShardServer(shards, backend="docker", image=image) as a,
        ShardServer(shards, backend="docker", image=image) as b,
    ):
        with ShardServer(shards, backend="embedded") as c:
            assert len({a.port, b.port, c.port}) == 3
            for s in (a, b, c):
                assert fetch(f"{s.url}/manifest.json")[0] == 200


def test_strays_of_a_crashed_process_are_removed_and_stop_all_removes_the_rest(engine: Any, shards: Path) -> None:
    image = docker_nginx.build(engine)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    labels = {LABEL: LABEL_VALUE, "raywds.pid": dead, "raywds.host": socket.gethostname()}
    stray = engine.containers.create(image, command=["/usr/sbin/nginx", "-v"], labels=labels)  # as a crash leaves it
    assert [c.id for c in stray_containers(engine, everyone=False)] == [stray.id]
    with ShardServer(shards, backend="docker", image=image):
        ids = [c.id for c in engine.containers.list(all=True, filters={"label": f"{LABEL}={LABEL_VALUE}"})]
        assert stray.id not in ids and len(ids) == 1, "starting a server cleared the crashed process's container"
        out = subprocess.run([str(RAYWDS), "serve", "--stop-all"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "raywds: removed 1 shard-server container(s)"
    assert engine.containers.list(all=True, filters={"label": f"{LABEL}={LABEL_VALUE}"}) == []


def test_the_advertised_url_names_the_node_unless_loopback() -> None:
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("0.0.0.0", "head.cluster") == "head.cluster"
    assert advertised_host("0.0.0.0") not in ("0.0.0.0", "")


def test_serve_prints_the_url_and_brace_patterns(shards: Path) -> None:
    proc = subprocess.Popen(
        [str(RAYWDS), "serve", str(shards), "--local", "--port", "0", "--backend", "embedded"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert (
            first.startswith(f"raywds: serving {shards} at http://127.0.0.1:")
            and "(embedded, listening on 127.0.0.1:" in first
        )
        url = first.split(" at ")[1].split(" ")[0]
        lines = [proc.stdout.readline().strip() for _ in range(2)]
        assert lines == [
            f"train: {url}/imagenet-train-{{000000..000007}}.tar",
            f"val: {url}/imagenet-val-{{000000..000003}}.tar",
        ]
        assert fetch(f"{url}/manifest.json")[0] == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_missing_directory_or_manifest_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ServerError, match=r"shard directory .*absent does not exist"):
        ShardServer(tmp_path / "absent")
    with pytest.raises(ServerError, match=r"no manifest.json in .*; serve a folder written by `raywds convert`"):
        ShardServer(tmp_path)


def test_embedded_limits_out_of_range_are_refused(shards: Path) -> None:
    with pytest.raises(ServerError, match=r"idle_timeout_s=0 must be above 0; the default is 30 s"):
        ShardServer(shards, idle_timeout_s=0)
    with pytest.raises(ServerError, match=r"num_threads=0 must be at least 1; the default is 64"):
        ShardServer(shards, num_threads=0)


def test_embedded_server_takes_a_client_hanging_up_mid_shard_quietly(
    tmp_path: Path, shards: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A loader that stops mid-shard (the end of a resample epoch) hangs up while the server is
    still sending: no traceback on stderr, and the server goes on serving."""
    shutil.copytree(shards, tmp_path / "s")
    (tmp_path / "s" / "big.tar").write_bytes(os.urandom(32 << 20))
    with ShardServer(tmp_path / "s", backend="embedded") as server:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )  # reset on close
                sock.sendall(b"GET /big.tar HTTP/1.1\r\nHost: x\r\n\r\n")
                assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        with urllib.request.urlopen(server.url + "/big.tar") as response:
            assert len(response.read()) == 32 << 20, "the server still serves whole shards"
    err = capfd.readouterr().err
    assert "Traceback" not in err and "-" * 40 not in err, err[-2000:]
