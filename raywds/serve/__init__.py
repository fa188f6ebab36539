"""Serve a shard folder over HTTP: nginx in Docker, the local nginx, or an embedded server."""

from raywds.serve.backend import NETWORKS
from raywds.serve.docker import LABEL, LABEL_VALUE, docker_client, stop_all, stray_containers
from raywds.serve.net import advertised_host, free_port
from raywds.serve.server import BACKENDS, ServerOptions, ShardServer

__all__ = [
    "BACKENDS",
    "LABEL",
    "LABEL_VALUE",
    "NETWORKS",
    "ServerOptions",
    "ShardServer",
    "advertised_host",
    "docker_client",
    "free_port",
    "stop_all",
    "stray_containers",
]
