"""Shard servers, for real: nginx and the embedded server serve shards byte for byte on loopback."""

from __future__ import annotations

import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import webdataset as wds

from raywds.errors import ServerError
from raywds.server import ShardServer
from raywds.shards import read_manifest

HAVE_NGINX = bool(shutil.which("nginx") or os.access("/usr/sbin/nginx", os.X_OK))


def backends() -> list:
    nginx = pytest.param("nginx", marks=pytest.mark.skipif(not HAVE_NGINX and not os.environ.get("CI"), reason="no nginx binary (CI installs it)"))
    return [nginx, "embedded"]


def fetch(url: str, headers: dict[str, str] | None = None) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
        return response.read()


@pytest.mark.parametrize("backend", backends())
def test_serves_every_shard_byte_for_byte(shards: Path, backend: str) -> None:
    with ShardServer(shards, backend=backend) as server:
        assert server.backend == backend
        assert server.url.startswith("http://127.0.0.1:")
        for name in sorted(p.name for p in shards.iterdir()):
            assert fetch(f"{server.url}/{name}") == (shards / name).read_bytes(), name
        manifest = read_manifest(server.url)
        assert manifest.num_samples("train") == 120
        samples = list(wds.WebDataset([manifest.url(s) for s in manifest.shards("val")], shardshuffle=False))
        assert len(samples) == 50
        with pytest.raises(urllib.error.HTTPError, match="404"):
            fetch(f"{server.url}/imagenet-train-999999.tar")
        url = server.url
    with pytest.raises(urllib.error.URLError):
        fetch(f"{url}/manifest.json")


@pytest.mark.skipif(not HAVE_NGINX and not os.environ.get("CI"), reason="no nginx binary (CI installs it)")
def test_nginx_serves_byte_ranges(shards: Path) -> None:
    name = read_manifest(str(shards)).shards("train")[0].name
    with ShardServer(shards, backend="nginx") as server:
        assert fetch(f"{server.url}/{name}", {"Range": "bytes=512-1535"}) == (shards / name).read_bytes()[512:1536]


def test_missing_shard_fails_loudly_through_webdataset(shards: Path) -> None:
    with ShardServer(shards, backend="embedded") as server:
        with pytest.raises(Exception, match="empty file|exit status|curl"):
            list(wds.WebDataset([f"{server.url}/imagenet-train-999999.tar"], shardshuffle=False))


def test_auto_falls_back_without_docker(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with ShardServer(shards) as server:
        assert server.backend == ("nginx" if HAVE_NGINX else "embedded")
        assert fetch(f"{server.url}/manifest.json") == (shards / "manifest.json").read_bytes()


def test_explicit_docker_without_engine_says_why(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(ServerError, match="no Docker engine answers"):
        with ShardServer(shards, backend="docker"):
            pass


def test_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ServerError, match=r"shard directory .*absent does not exist"):
        ShardServer(tmp_path / "absent")
