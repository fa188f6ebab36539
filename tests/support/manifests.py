"""The Kubernetes manifests in deploy/kubernetes/ rendered as `envsubst` renders them with
values.env, and the command lines in them that the image tests run (tests/deploy/test_image.py):
what those tests run is read from the manifests, so the manifests cannot drift from what is tested."""

from __future__ import annotations

import shlex
import string
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def values(**overrides: str) -> dict[str, str]:
    """values.env as `set -a; . values.env` reads it (NAME=VALUE lines, comments and blanks
    skipped), with `overrides`."""
    pairs = (line.split("=", 1) for line in (DEPLOY / "values.env").read_text().splitlines())
    read = {k.strip(): v.strip() for k, v in (p for p in pairs if len(p) == 2) if not k.lstrip().startswith("#")}
    unknown = set(overrides) - set(read)
    assert not unknown, f"values.env has no {sorted(unknown)}"
    return read | overrides


def render(name: str, with_values: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The manifest's documents with every ${NAME} replaced; a name the values lack is an error
    (envsubst would put an empty string there)."""
    text = string.Template((DEPLOY / name).read_text()).substitute(with_values or values())
    return [doc for doc in yaml.safe_load_all(text) if doc]


def rayjob_entrypoint(with_values: dict[str, str]) -> list[str]:
    """The RayJob's entrypoint, split as a shell splits it (KubeRay hands it to `ray job submit`)."""
    return shlex.split(render("rayjob.yaml", with_values)[0]["spec"]["entrypoint"])


def shard_server_command(with_values: dict[str, str]) -> list[str]:
    """The shard server Deployment's container command and arguments."""
    deployment = next(d for d in render("shard-server.yaml", with_values) if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return [*container["command"], *container.get("args", [])]


def torchrun_command(with_values: dict[str, str]) -> list[str]:
    """The PyTorchJob Master's container command and arguments."""
    spec = render("pytorchjob.yaml", with_values)[0]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    return [*spec["containers"][0]["command"], *spec["containers"][0].get("args", [])]
