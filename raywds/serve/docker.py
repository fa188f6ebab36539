"""The Docker backend: nginx in a container of the Docker engine at DOCKER_HOST (or the default
socket), labelled so that containers a crashed process left behind can be found and removed.
The only module of raywds that imports the Docker SDK, and only when a function needs it.

    raywds serve --stop-all     # stop_all(): remove every raywds shard-server container
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

from raywds.errors import ServerError
from raywds.serve.backend import Running, Spec, run_dir
from raywds.serve.nginx import nginx_conf

DOCKER_IMAGE = "nginx:stable"
LABEL = "raywds"
LABEL_VALUE = "shard-server"
INSIDE = "/usr/share/nginx/html"
"""Where the container sees the shard folder."""

log = logging.getLogger(__name__)


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
    """The Docker SDK client for DOCKER_HOST or the default socket; ServerError if no engine answers
    (a short line where the engine's socket is not even there, as in a container or on a laptop
    without Docker)."""
    where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if where.startswith("unix://") and not Path(where.removeprefix("unix://")).exists():
        raise ServerError(f"no Docker engine at {where} (no such socket)")
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
    return [
        c
        for c in found
        if c.labels.get("raywds.host") == host and not _pid_alive(int(c.labels.get("raywds.pid", "0") or 0))
    ]


def stop_all() -> int:
    """Remove every raywds shard-server container; returns how many."""
    client = docker_client()
    containers = stray_containers(client, everyone=True)
    for c in containers:
        c.remove(force=True)
    return len(containers)


def _image_here(client: Any, image: str, no_pull: bool) -> None:
    """The image, pulled first when missing unless `no_pull`."""
    import docker.errors

    try:
        client.images.get(image)
        return
    except docker.errors.ImageNotFound:
        if no_pull:
            raise ServerError(
                f"image {image} is not here and pulling is off; give a local nginx image with --image"
            ) from None
    try:
        client.images.pull(image)
    except docker.errors.DockerException as e:
        raise ServerError(
            f"image {image} is not here and cannot be pulled ({str(e).splitlines()[0][:200]}); "
            "give a local nginx image with --image"
        ) from None


def _run(client: Any, spec: Spec, port: int, conf_dir: str) -> Any:
    """The nginx container, detached, removed when it stops; `conf_dir` holds its nginx.conf."""
    import docker.errors

    name = f"raywds-shards-{os.getpid()}-{port}-{uuid.uuid4().hex[:6]}"
    host = spec.host or "0.0.0.0"
    options = spec.network.container(host, port)
    try:
        return client.containers.run(
            spec.image,
            command=["nginx", "-e", "stderr", "-c", "/etc/raywds/nginx.conf"],
            name=name,
            detach=True,
            auto_remove=True,
            volumes={str(spec.root): {"bind": INSIDE, "mode": "ro"}, conf_dir: {"bind": "/etc/raywds", "mode": "ro"}},
            labels={
                LABEL: LABEL_VALUE,
                "raywds.pid": str(os.getpid()),
                "raywds.host": socket.gethostname(),
                "raywds.root": str(spec.root),
            },
            **options,
        )
    except docker.errors.DockerException as e:
        raise ServerError(f"cannot start a {spec.image} container: {e}") from None


def start(spec: Spec, cleanup: contextlib.ExitStack) -> Running:
    """Run nginx in a container of `spec.image` on `spec.root` until `cleanup` closes."""
    import docker.errors

    client = docker_client()
    for stray in stray_containers(client, everyone=False):  # left by a process that crashed
        log.info(
            "removing shard-server container %s, left by process %s that is gone",
            stray.name,
            stray.labels.get("raywds.pid"),
        )
        stray.remove(force=True)
    _image_here(client, spec.image, spec.no_pull)
    port = spec.free_port()
    conf_dir = run_dir(cleanup)
    listen = spec.network.listen(spec.host or "0.0.0.0", port)
    Path(conf_dir, "nginx.conf").write_text(
        nginx_conf(root=INSIDE, listen=listen, run_dir="/tmp", as_root=True, error_log="stderr")
    )
    container = _run(client, spec, port, conf_dir)
    logs = _Logs(container)

    @cleanup.callback
    def stop() -> None:
        try:
            container.remove(force=True)
        except docker.errors.DockerException:
            pass  # auto_remove got there first

    def alive() -> bool:
        try:
            container.reload()
        except docker.errors.NotFound:
            return False
        return bool(container.status in ("created", "running"))

    return Running(port=port, alive=alive, logs=logs.tail)
