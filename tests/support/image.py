"""The repository's Dockerfile built as the tests use it, with no image registry to pull from.

The Dockerfile's BASE is an image with Python, torch and torchvision. Here that base is made
locally: `debootstrap` a minimal Debian into a folder, put into it the torch and torchvision
this environment runs, from the wheels `./run-venv` already has in uv's cache (linked, not
downloaded again), `docker import` the folder, then build the Dockerfile on it with host
networking. The machine's CA settings (SSL_CERT_FILE and the like, where a proxy re-signs
HTTPS) go into the base as a company's base image carries its CA.

    tag = image(client)      # built once; later calls (and runs) find it by its tag

Containers are labelled LABEL, so `remove_containers` removes exactly the tests' own, by id.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
MIRROR = os.environ.get("RAYWDS_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE = f"raywds-test-base:{SUITE}-torch{metadata.version('torch').split('+')[0]}"
IMAGE = "raywds-test:latest"
LABEL = "raywds-test-image"
CA_VARIABLES = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE")
CA_PATH = "/usr/local/share/raywds-test/ca.crt"
"""Where the machine's CA bundle goes in the base: outside /etc/ssl/certs, which the
Dockerfile's ca-certificates package writes anew."""


def _run(args: list[str], what: str, timeout: float) -> None:
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{what} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def debian_root(folder: Path) -> Path:
    """A minimal Debian with Python 3 and pip in `folder` (debootstrap, about a minute)."""
    _run(
        ["debootstrap", "--variant=minbase", "--include=python3,python3-pip", SUITE, str(folder), MIRROR],
        "debootstrap",
        timeout=900,
    )
    return folder


def add_torch(root: Path) -> None:
    """torch and torchvision, the versions this environment runs, into the root's site-packages,
    from uv's cache (the closure pinned to what this environment holds, so nothing new downloads)."""
    site = subprocess.run(
        [
            "chroot",
            str(root),
            "python3",
            "-c",
            "import site, sys; print(site.getsitepackages()[0], *sys.version_info[:2])",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    if site[1:] != [str(v) for v in sys.version_info[:2]]:
        raise RuntimeError(f"Debian {SUITE} has Python {'.'.join(site[1:])}, this environment {sys.version_info[:2]}")
    uv = Path(sys.executable).parent / "uv"
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as pins:
        freeze = subprocess.run(
            [str(uv), "pip", "freeze", "--python", sys.executable], capture_output=True, text=True, check=True
        )
        pins.write("\n".join(line for line in freeze.stdout.splitlines() if "==" in line))  # not raywds itself
        pins.flush()
        wanted = [f"torch=={metadata.version('torch')}", f"torchvision=={metadata.version('torchvision')}"]
        _run(
            [
                str(uv),
                "pip",
                "install",
                "-q",
                "--compile-bytecode",
                "--python",
                sys.executable,
                "--target",
                f"{root}{site[0]}",
                "-c",
                pins.name,
                *wanted,
            ],
            "uv pip install torch into the base",
            timeout=900,
        )


def import_base(client: Any, root: Path) -> None:
    """`docker import` of the folder as BASE, with the machine's CA settings."""
    changes = []
    bundle = next((os.environ[v] for v in CA_VARIABLES if os.environ.get(v)), None)
    if bundle:
        (root / CA_PATH.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(bundle, root / CA_PATH.lstrip("/"))
        changes = [f"ENV {v}={CA_PATH}" for v in CA_VARIABLES]
    repository, tag = BASE.split(":")
    tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
    try:
        client.api.import_image_from_stream(tar.stdout, repository=repository, tag=tag, changes=changes)
    finally:
        tar.stdout.close()  # type: ignore[union-attr]
        if tar.wait(timeout=600) != 0:
            raise RuntimeError(f"tar of {root} exited {tar.returncode}")


def has(client: Any, name: str) -> bool:
    import docker

    try:
        client.images.get(name)
    except docker.errors.ImageNotFound:
        return False
    return True


def cannot_build(client: Any) -> str | None:
    """Why the base cannot be made here (the engine lacks it too), or None."""
    if has(client, BASE):
        return None
    if os.geteuid() != 0:
        return "the image's base needs root (debootstrap, chroot)"
    if shutil.which("debootstrap") is None:
        return "no debootstrap to make the image's base (apt-get install debootstrap)"
    return None


def image(client: Any) -> dict[str, float]:
    """Build BASE (unless the engine has it) and IMAGE from the Dockerfile; seconds each step took."""
    took: dict[str, float] = {}
    if not has(client, BASE):
        with tempfile.TemporaryDirectory(prefix="raywds-debian-") as folder:
            started = time.monotonic()
            root = debian_root(Path(folder) / "root")
            took["debootstrap"] = time.monotonic() - started
            add_torch(root)
            took["torch"] = time.monotonic() - started - sum(took.values())
            import_base(client, root)
            took["import"] = time.monotonic() - started - sum(took.values())
    started = time.monotonic()
    client.images.build(
        path=str(ROOT), tag=IMAGE, buildargs={"BASE": BASE}, network_mode="host", rm=True, forcerm=True, pull=False
    )
    took["build"] = time.monotonic() - started
    return took


def remove_containers(client: Any) -> None:
    """Every container the tests started (labelled LABEL), removed by id, running or not."""
    for container in client.containers.list(all=True, filters={"label": LABEL}):
        container.remove(force=True)
