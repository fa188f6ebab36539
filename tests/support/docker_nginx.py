"""A small nginx image built from this host's own nginx binary and the libraries `ldd` names,
loaded with `docker import` (no registry needed): what the Docker tests pass as --image."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

IMAGE = "raywds-test-nginx:local"


def nginx_binary() -> Path | None:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    return Path(found) if found else None


def rootfs(binary: Path) -> bytes:
    """A tar of the root filesystem: the binary, its libraries, and the few files nginx opens."""
    libs = re.findall(
        r"(/\S+\.so[\S]*)", subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(binary), arcname="usr/sbin/nginx")
        for lib in libs:
            tar.add(str(Path(lib).resolve()), arcname=lib.lstrip("/"))
        for path, text in {"etc/passwd": "root:x:0:0:root:/root:/bin/sh\n", "etc/group": "root:x:0:\n"}.items():
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for folder in ("tmp", "etc/raywds", "usr/share/nginx/html", "var/log/nginx"):
            info = tarfile.TarInfo(folder)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if folder == "tmp" else 0o755
            tar.addfile(info)
    return buf.getvalue()


def build(client: Any) -> str:
    """Import the image once per engine; returns its name."""
    if not client.images.list(name=IMAGE):
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("no nginx binary to build the test image from (apt-get install nginx-light)")
        repository, tag = IMAGE.split(":")
        client.api.import_image_from_data(rootfs(binary), repository=repository, tag=tag)
    return IMAGE
