"""deploy/ manifests validate against the KubeRay CRDs and Kubernetes' schemas, follow the
serving conventions (GPU requests equal limits, /dev/shm in memory, token auth, only gRPC
exposed), run entrypoints kvray's own CLI accepts, and use the Ray version kvray pins."""

from __future__ import annotations

import copy
import re
import shlex

import jsonschema
import kubernetes_validate
import pytest
import tomllib

from cluster.cli import build_parser
from tests.deploy.manifests import DEPLOY, ROOT, containers, manifests, validate

DOCUMENTS = manifests()
RAY_OBJECTS = [(f, d) for f, d in DOCUMENTS if d["kind"] in ("RayCluster", "RayJob")]


def pinned_ray_version() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (pin,) = [d for d in project["project"]["dependencies"] if d.startswith("ray[")]
    return re.search(r"==\s*([\d.]+)", pin).group(1)


def ids(items):
    return [f"{name}:{doc['kind']}:{doc['metadata']['name']}" for name, doc in items]


def test_every_kind_is_present():
    kinds = {d["kind"] for _, d in DOCUMENTS}
    assert {"RayCluster", "RayJob", "Service", "Secret", "PersistentVolumeClaim"} <= kinds


@pytest.mark.parametrize(("name", "document"), DOCUMENTS, ids=ids(DOCUMENTS))
def test_manifest_validates(name, document):
    validate(document)


def test_a_wrong_field_type_is_refused():
    _, cluster = next((f, d) for f, d in RAY_OBJECTS if d["kind"] == "RayCluster")
    broken = copy.deepcopy(cluster)
    broken["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError, match="'two' is not of type 'integer'"):
        validate(broken)
    _, service = next((f, d) for f, d in DOCUMENTS if d["kind"] == "Service")
    broken_service = copy.deepcopy(service)
    broken_service["spec"]["ports"][0]["port"] = "fifty"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken_service)


def kvray_commands() -> list[str]:
    commands = []
    for _, document in RAY_OBJECTS:
        if document["kind"] == "RayJob":
            commands.append(document["spec"]["entrypoint"])
        for container in containers(document):
            for arg in container.get("args", []):
                commands += [part.strip() for part in arg.split(";") if "kvray " in part]
    return commands


def test_every_kvray_entrypoint_parses_with_the_cli():
    commands = kvray_commands()
    assert any(" serve " in f" {c} " for c in commands)
    assert any(" batch " in f" {c} " for c in commands)
    parser = build_parser()
    for command in commands:
        words = shlex.split(command.replace("exec ", "", 1))
        assert words[0] == "kvray", command
        parser.parse_args(words[1:])  # exits (fails the test) on an unknown flag


@pytest.mark.parametrize(("name", "document"), RAY_OBJECTS, ids=ids(RAY_OBJECTS))
def test_ray_version_images_auth_and_gpus(name, document):
    version = pinned_ray_version()
    spec = document["spec"].get("rayClusterSpec", document["spec"])
    assert spec["rayVersion"] == version
    assert spec["authOptions"]["mode"] == "token"
    assert spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    for container in containers(document):
        assert f"ray{version}" in container["image"], container["image"]
    for group in spec["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        (worker,) = pod["containers"]
        resources = worker["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
        shm = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
    head_ports = {
        p["name"]: p["containerPort"] for c in containers(document)[:1] for p in c["ports"]
    }
    assert {"gcs-server", "dashboard", "client"} <= set(head_ports)


def test_the_service_exposes_grpc_and_not_the_dashboard():
    (service,) = [d for _, d in DOCUMENTS if d["kind"] == "Service"]
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("grpc", 50051)]
    assert service["spec"]["selector"]["ray.io/node-type"] == "head"


def test_dockerfile_builds_on_the_pinned_ray_image():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{pinned_ray_version()}-py311-gpu" in dockerfile
