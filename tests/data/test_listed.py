"""`raywds convert http://HOST/tree/ OUT`: an image tree behind an HTTP server's directory listing,
followed folder by folder; nginx's JSON autoindex (sizes in it) and an HTML listing (Python's
http.server: sizes by HEAD) give the local converter's shards, byte for byte."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.gcsserver import free_port

from raywds.data.convert import ConvertOptions, convert
from raywds.data.listed import tree_at
from raywds.errors import DataError
from raywds.serve.nginx import nginx_binary, nginx_conf

OPTIONS = ConvertOptions(maxcount=40, seed=2)


@pytest.fixture(scope="module")
def spaced(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tree with one class folder and one file named with a space (quoted in their URLs)."""
    out = tmp_path_factory.mktemp("spaced") / "tree"
    shutil.copytree(tree, out)
    (out / "train" / "n90000001").rename(out / "train" / "n9 first")
    (out / "val" / "n90000001").rename(out / "val" / "n9 first")
    victim = sorted((out / "train" / "n9 first").glob("*.JPEG"))[0]
    victim.rename(victim.with_name("a photo.JPEG"))
    (out / "train" / "n9 first" / "notes.txt").write_text("not an image\n")
    return out


@pytest.fixture
def python_listing(spaced: Path) -> Iterator[str]:
    handler = functools.partial(QuietHandler, directory=str(spaced.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/tree/"
    server.shutdown()
    server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def nginx_listing(spaced: Path, tmp_path: Path) -> Iterator[str]:
    binary = nginx_binary()
    if binary is None:
        pytest.skip("no nginx here (.ci/run installs nginx-light)")
    port = free_port()
    conf = nginx_conf(
        root=str(spaced.parent), listen=f"127.0.0.1:{port}", run_dir=str(tmp_path), as_root=True,
        error_log=str(tmp_path / "error.log"),
    )  # fmt: skip
    conf = conf.replace("autoindex off;", "autoindex on; autoindex_format json;").replace(
        "try_files $uri =404;", "try_files $uri $uri/ =404;"
    )
    (tmp_path / "nginx.conf").write_text(conf)
    process = subprocess.Popen([binary, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")])
    url = f"http://127.0.0.1:{port}/tree/"
    try:
        for _ in range(100):
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    assert response.headers.get_content_type() == "application/json"
                    break
            except OSError:
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def same_as_local(tree: Path, url: str, tmp_path: Path) -> None:
    here, there = tmp_path / "from-folder", tmp_path / "from-http"
    convert(tree, here, OPTIONS)
    made = convert(tree_at(url), there, OPTIONS)
    assert made["source"] == url.rstrip("/")
    assert sorted(p.name for p in there.glob("*.tar")) == sorted(p.name for p in here.glob("*.tar"))
    for shard in here.glob("*.tar"):
        assert (there / shard.name).read_bytes() == shard.read_bytes(), shard.name
    ours = json.loads((here / "manifest.json").read_text())
    assert "n9 first" in ours["classes"] and ours["ignored"]["examples"] == ["train/n9 first/notes.txt"]
    for m in (ours, made):
        m.pop("source")
        m.pop("kept_from_earlier_run")
    assert made == {k: v for k, v in ours.items()}


def test_an_html_listing_gives_the_local_converters_shards(spaced: Path, python_listing: str, tmp_path: Path) -> None:
    same_as_local(spaced, python_listing, tmp_path)


def test_nginxs_json_listing_gives_the_local_converters_shards(
    spaced: Path, nginx_listing: str, tmp_path: Path
) -> None:
    same_as_local(spaced, nginx_listing, tmp_path)


def test_a_listing_that_is_not_there_is_one_line(python_listing: str) -> None:
    with pytest.raises(DataError, match=r"/nothing/: could not read its listing \(HTTPError: HTTP Error 404"):
        tree_at(python_listing + "nothing/")
