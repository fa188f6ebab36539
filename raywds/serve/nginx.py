"""The nginx backends' config, and the local-binary backend: this host's nginx, run in the
foreground by this process with a config in a private temporary folder.

    with ShardServer("shards/", backend="nginx") as server: ...
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

from raywds.errors import ServerError
from raywds.serve.backend import Running, Spec, run_dir
from raywds.serve.net import hostport

CONNECTIONS = 8192
"""Connections each nginx worker process takes (one worker per core): 8 of them take the 32,768
streams of 4,096 ranks x 8 loader workers, about 3.5 MB each. Was 1,024, with 2 workers."""


def nginx_conf(*, root: str, listen: str, run_dir: str, as_root: bool, error_log: str) -> str:
    """One config for the local binary and the Docker image: foreground, no directory listing,
    nothing whose path has a part starting with a dot (a converter's state, journal and
    half-written shards); nginx decodes `%2e` before it matches locations. No symlink below the
    root is followed (`disable_symlinks on`): `if_not_owner` would let a link through whose owner
    owns its target too, such as root's link to /etc/passwd, and the shards are never links."""
    temp = "\n".join(
        f"    {kind}_temp_path {run_dir}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    # Workers read the shards as the user who started the server (root included): the shard
    # directory is often private to that user, e.g. under pytest's tmp_path.
    user = "user root root;\n" if as_root else ""
    # Sized for thousands of ranks' loader workers streaming at once (R x W connections): a worker
    # process per core, each taking up to CONNECTIONS, each holding a socket and a shard open.
    return f"""{user}daemon off;
worker_processes auto;
worker_rlimit_nofile {2 * CONNECTIONS + 64};
pid {run_dir}/nginx.pid;
error_log {error_log} warn;
events {{ worker_connections {CONNECTIONS}; multi_accept on; }}
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
        disable_symlinks on from=$document_root;
        location / {{ try_files $uri =404; }}
        location ~ /\\. {{ return 404; }}
    }}
}}
"""


def nginx_binary() -> str | None:
    """The nginx on PATH, else /usr/sbin/nginx (not on a normal user's PATH), else None."""
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


def start(spec: Spec, cleanup: contextlib.ExitStack) -> Running:
    """Run the local nginx binary on `spec.root` until `cleanup` closes."""
    binary = nginx_binary()
    if binary is None:
        raise ServerError("no nginx binary on PATH; install it (apt-get install nginx-light) or use --backend embedded")
    port = spec.free_port()
    folder = run_dir(cleanup)
    conf = Path(folder) / "nginx.conf"
    log = Path(folder) / "error.log"
    listen = hostport(spec.host or "0.0.0.0", port)
    conf.write_text(
        nginx_conf(root=str(spec.root), listen=listen, run_dir=folder, as_root=os.geteuid() == 0, error_log=str(log))
    )
    with log.open("ab") as stderr:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [binary, "-e", str(log), "-p", folder, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=stderr
        )

    @cleanup.callback
    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    return Running(port=port, alive=lambda: proc.poll() is None, logs=lambda: log.read_text(errors="replace")[-2000:])
