"""deploy/ manifests validate against the KubeRay CRDs and Kubernetes' schemas, follow the
serving conventions (GPU requests equal limits, /dev/shm in memory, token auth, only gRPC
exposed), run entrypoints kvray's own CLI accepts, keep each TP group in one pod, drain before
they are killed, and use the Ray version kvray pins."""

from __future__ import annotations

import argparse
import copy
import re
import shlex

import jsonschema
import kubernetes_validate
import pytest
import tomllib

from cluster.cli import build_parser
from tests.deploy.manifests import DEPLOY, ROOT, cluster_spec, containers, manifests, validate

DOCUMENTS = manifests()
RAY_OBJECTS = [(f, d) for f, d in DOCUMENTS if d["kind"] in ("RayCluster", "RayJob")]
# Every object that brings up a Ray cluster (a RayService's application is in its own tests).
RAY_CLUSTERS = [(f, d) for f, d in DOCUMENTS if d["kind"].startswith("Ray")]


def pinned_ray_version() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (pin,) = [d for d in project["project"]["dependencies"] if d.startswith("ray[")]
    return re.search(r"==\s*([\d.]+)", pin).group(1)


def ids(items):
    return [f"{name}:{doc['kind']}:{doc['metadata']['name']}" for name, doc in items]


def test_every_kind_is_present():
    kinds = {d["kind"] for _, d in DOCUMENTS}
    assert {
        "RayCluster",
        "RayJob",
        "RayService",
        "Service",
        "Secret",
        "PersistentVolumeClaim",
    } <= kinds


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


def commands_of(document: dict) -> list[str]:
    """The kvray command lines of one Ray object: a RayJob's entrypoint, containers' args."""
    commands = [document["spec"]["entrypoint"]] if document["kind"] == "RayJob" else []
    for container in containers(document):
        for arg in container.get("args", []):
            commands += [part.strip() for part in arg.split(";") if "kvray " in part]
    return commands


def kvray_commands() -> list[str]:
    return [c for _, document in RAY_OBJECTS for c in commands_of(document)]


def parse_kvray(command: str) -> argparse.Namespace:
    words = shlex.split(command.replace("exec ", "", 1))
    assert words[0] == "kvray", command
    return build_parser().parse_args(words[1:])  # exits (fails the test) on an unknown flag


def test_every_kvray_entrypoint_parses_with_the_cli():
    commands = kvray_commands()
    assert any(" serve " in f" {c} " for c in commands)
    assert any(" batch " in f" {c} " for c in commands)
    for command in commands:
        parse_kvray(command)


@pytest.mark.parametrize(("name", "document"), RAY_OBJECTS, ids=ids(RAY_OBJECTS))
def test_a_tp_group_fits_in_one_pod(name, document):
    """STRICT_PACK keeps every rank on one node, so some worker pod must hold all TP GPUs."""
    spec = cluster_spec(document)
    gpus_per_pod = [
        int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
        for group in spec["workerGroupSpecs"]
        for c in group["template"]["spec"]["containers"]
    ]
    commands = commands_of(document)
    assert commands
    for command in commands:
        args = parse_kvray(command)
        assert args.placement_strategy == "STRICT_PACK", command
        assert max(gpus_per_pod) >= args.tensor_parallel_size, (gpus_per_pod, command)


def pre_stop_sleep(container: dict) -> int:
    command = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    return int(re.fullmatch(r"/bin/sh -c sleep (\d+)", command).group(1))


def test_the_serving_head_drains_before_it_is_killed():
    """preStop sleep + --drain-timeout + a margin to stop the actors fit in the grace period,
    and Ray (head and workers) outlives the drain."""
    (cluster,) = [d for _, d in RAY_OBJECTS if d["kind"] == "RayCluster"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    (kvray,) = [c for c in head["containers"] if c["name"] == "kvray"]
    (command,) = commands_of(cluster)
    assert "--drain-timeout" in shlex.split(command)
    drained_by = pre_stop_sleep(kvray) + parse_kvray(command).drain_timeout
    assert pre_stop_sleep(kvray) > 0
    assert drained_by + 10 <= head["terminationGracePeriodSeconds"]
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for pod in (g["template"]["spec"] for g in groups):
        (ray,) = [c for c in pod["containers"] if c["name"].startswith("ray-")]
        assert drained_by + 5 <= pre_stop_sleep(ray) < pod["terminationGracePeriodSeconds"]


@pytest.mark.parametrize(("name", "document"), RAY_CLUSTERS, ids=ids(RAY_CLUSTERS))
def test_ray_version_images_auth_and_gpus(name, document):
    version = pinned_ray_version()
    spec = cluster_spec(document)
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


def test_the_service_exposes_the_apis_and_not_the_dashboard():
    (service,) = [d for _, d in DOCUMENTS if d["metadata"]["name"] == "kvray-grpc"]
    ports = [(p["name"], p["port"]) for p in service["spec"]["ports"]]
    assert ports == [("grpc", 50051), ("http", 8000)]
    (cluster,) = [d for _, d in DOCUMENTS if d["kind"] == "RayCluster"]
    head = cluster["spec"]["headGroupSpec"]["template"]
    assert head["metadata"]["annotations"]["prometheus.io/port"] == "8000"  # /metrics scraped
    serve_line = next(c for c in kvray_commands() if " serve " in f" {c} ")
    assert "--http-port 8000" in serve_line
    assert service["spec"]["selector"]["ray.io/node-type"] == "head"


def test_dockerfile_builds_on_the_pinned_ray_image():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{pinned_ray_version()}-py311-gpu" in dockerfile
