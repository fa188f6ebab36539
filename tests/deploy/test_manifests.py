"""The Kubernetes manifests in deploy/kubernetes/, rendered with values.env as `envsubst` renders them,
checked against the schemas the API server would check them with: KubeRay's RayJob and RayCluster
CRDs (KubeRay v1.7.0) and Kubeflow's PyTorchJob CRD (Training Operator v1.9.0), kept in crds/
(see crds/SOURCES), and the core kinds against Kubernetes 1.34's (the kubernetes-validate package).
No Kubernetes cluster runs here: this is what can be checked without one.

Unknown fields are errors, as `kubectl apply` makes them (server-side field validation is Strict
by default): each CRD object schema is closed unless it says it keeps unknown fields."""

from __future__ import annotations

import functools
import gzip
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support.manifests import DEPLOY, rayjob_entrypoint, render, shard_server_command, torchrun_command, values

CRDS = Path(__file__).parent / "crds"
KUBERNETES = "1.34"
CUSTOM = {
    ("ray.io/v1", "RayJob"): "ray.io_rayjobs.yaml.gz",
    ("ray.io/v1", "RayCluster"): "ray.io_rayclusters.yaml.gz",
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.yaml.gz",
}
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))


def closed(schema: Any) -> Any:
    """`schema` with every object that lists its properties closed to others, as the API server's
    strict field validation treats it."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        keeps = schema.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in schema and "additionalProperties" not in schema and not keeps:
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


@functools.cache
def crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """The CRD's schema as a validator, built once (jsonschema.validate would check the 1 MB schema
    itself again at every call)."""
    return jsonschema.Draft7Validator(crd_schema(api_version, kind))


def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: the CRDs are 0.6-1.4 MB
    crd = yaml.load(gzip.decompress((CRDS / CUSTOM[(api_version, kind)]).read_bytes()), Loader=loader)
    version = api_version.split("/")[1]
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    schema = closed(served["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # checked as ObjectMeta below, not by the CRD
    return schema


def check(doc: dict[str, Any]) -> None:
    """Raise on the first way `doc` breaks its kind's schema."""
    key = (doc["apiVersion"], doc["kind"])
    if key in CUSTOM:
        crd_validator(*key).validate(doc)
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}, KUBERNETES, strict=True
        )  # its metadata, as ObjectMeta
    else:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_every_manifest_is_there_and_every_value_it_uses_is_set() -> None:
    assert [p.name for p in MANIFESTS] == ["pytorchjob.yaml", "raycluster.yaml", "rayjob.yaml", "shard-server.yaml"]
    used = {m for p in MANIFESTS for m in re.findall(r"\$\{(\w+)\}", p.read_text())}
    assert used == set(values()), "values.env sets exactly what the manifests use"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_a_manifest_is_valid_for_its_kind(path: Path) -> None:
    docs = render(path.name)
    assert docs
    for doc in docs:
        check(doc)


@pytest.mark.parametrize(
    "path, where, field",
    [
        ("rayjob.yaml", lambda d: d["spec"], "entrypointt"),
        ("rayjob.yaml", lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"], "volume"),
        ("raycluster.yaml", lambda d: d["spec"]["headGroupSpec"], "rayStartParam"),
        ("pytorchjob.yaml", lambda d: d["spec"], "nprocsPerNode"),
        ("shard-server.yaml", lambda d: d["spec"]["template"]["spec"], "container"),
    ],
)
def test_a_misspelt_field_is_refused(path: str, where: Any, field: str) -> None:
    doc = render(path)[0]
    where(doc)[field] = "x"
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        check(doc)


def test_a_wrong_type_is_refused() -> None:
    doc = render("rayjob.yaml")[0]
    doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        check(doc)


def test_the_ray_workers_get_their_gpus_and_shared_memory() -> None:
    for name in ("rayjob.yaml", "raycluster.yaml"):
        doc = render(name)[0]
        cluster = doc["spec"].get("rayClusterSpec", doc["spec"])
        pod = cluster["workerGroupSpecs"][0]["template"]["spec"]
        container = pod["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == values()["GPUS_PER_WORKER"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": values()["SHM_SIZE"]}} in pod["volumes"]


@pytest.mark.parametrize(
    "command, expect",
    [
        (rayjob_entrypoint, ["raywds", "ray"]),
        (shard_server_command, ["raywds", "serve"]),
        (torchrun_command, ["torchrun", "-m", "raywds", "train"]),
    ],
    ids=["rayjob", "shard-server", "pytorchjob"],
)
def test_each_command_line_in_the_manifests_is_one_raywds_accepts(command: Any, expect: list[str]) -> None:
    """raywds's own parser takes each command line the manifests hold, with every value set; the
    image tests (test_image.py) run the RayJob's and the shard server's lines read from the same
    manifests, so what `kubectl apply` runs is what the tests ran."""
    from raywds.cli.main import build_parser

    args = command(values())
    assert args[: len(expect)] == expect
    parsed = build_parser().parse_args(args[len(expect) - 1 :])  # from the subcommand on
    if expect[-1] == "serve":
        assert (parsed.shards, parsed.port, parsed.advertise) == ("/shards", 8080, "raywds-shards")
    else:
        assert (parsed.data, parsed.mode, parsed.epochs) == (values()["DATA"], "split", int(values()["EPOCHS"]))


def test_the_image_tests_run_the_manifests_own_command_lines() -> None:
    """test_image.py takes the RayJob entrypoint and the shard server's command from the manifests."""
    source = (Path(__file__).parent / "test_image.py").read_text()
    assert "entrypoint = rayjob_entrypoint(test_values)" in source
    assert "server = shard_server_command(test_values)" in source
