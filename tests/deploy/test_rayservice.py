"""deploy/rayservice-replicas.yaml: its Serve config is one Ray Serve accepts, its application
is kvray's, its args are settings ``kvray serve`` accepts, each replica's worker bundles fit in
one GPU pod and the worker group can grow to the most replicas autoscaling asks for, and the
gRPC Service reaches the head, where the ingress serves."""

from __future__ import annotations

import importlib

import msgspec
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.cli.flags import config_of_settings
from cluster.serve import app
from tests.deploy.manifests import DEPLOY, cluster_spec, rayservice_application

DOCUMENTS = list(yaml.safe_load_all((DEPLOY / "rayservice-replicas.yaml").read_text()))
(SERVICE,) = [d for d in DOCUMENTS if d["kind"] == "RayService"]
(GRPC,) = [d for d in DOCUMENTS if d["kind"] == "Service"]


def serve_config() -> ServeDeploySchema:
    return ServeDeploySchema.model_validate(yaml.safe_load(SERVICE["spec"]["serveConfigV2"]))


def kvray_application():
    return rayservice_application()


def kvray_config():
    return config_of_settings(kvray_application().args)


def test_serve_accepts_the_config_and_it_builds_kvray():
    application = kvray_application()
    module, _, name = application.import_path.partition(":")
    assert getattr(importlib.import_module(module), name) is app.application
    assert application.route_prefix == "/"
    assert serve_config().http_options.port == 8000


def test_the_args_are_kvray_serve_settings():
    config = kvray_config()
    assert config.model == "/models/model"
    assert config.uses_replicas and config.replica_range == (1, 4)
    assert config.routing_policy == "kv-aware"
    assert (config.host, config.port) == ("0.0.0.0", 50051)


def test_a_misspelt_setting_is_refused_by_name():
    args = {**kvray_application().args, "tensor-paralel-size": 2}
    with pytest.raises(ValueError, match=r"no such setting.*--tensor-paralel-size"):
        config_of_settings(args)


def test_each_replica_fits_one_gpu_pod_and_the_pods_cover_the_replicas():
    config = msgspec.structs.replace(kvray_config(), use_gpu=True)
    options = app.replica_options(config)
    assert config.placement_strategy == "STRICT_PACK"
    assert options["ray_actor_options"]["num_cpus"] == 0  # only the bundles reserve
    (group,) = cluster_spec(SERVICE)["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    limits = worker["resources"]["limits"]
    bundles = options["placement_group_bundles"]
    assert sum(b.get("GPU", 0) for b in bundles) == int(limits["nvidia.com/gpu"])
    assert sum(b["CPU"] for b in bundles) <= int(limits["cpu"])
    low, high = config.replica_range
    assert options["autoscaling_config"]["max_replicas"] == high
    assert group["minReplicas"] <= low and group["maxReplicas"] == high
    assert cluster_spec(SERVICE)["enableInTreeAutoscaling"] is True


def test_the_grpc_service_reaches_the_head_where_the_ingress_serves():
    head = cluster_spec(SERVICE)["headGroupSpec"]["template"]
    selector = dict(GRPC["spec"]["selector"])
    assert selector.pop("ray.io/node-type") == "head"
    assert selector.items() <= head["metadata"]["labels"].items()
    (ray_head,) = head["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in ray_head["ports"]}
    (grpc,) = GRPC["spec"]["ports"]
    assert ports[grpc["targetPort"]] == grpc["port"] == kvray_config().port
    assert ports["serve"] == serve_config().http_options.port
    assert head["metadata"]["annotations"]["prometheus.io/port"] == str(ports["serve"])


def test_the_api_key_comes_from_the_secret_on_every_pod():
    spec = cluster_spec(SERVICE)
    pods = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for pod in pods:
        (container,) = pod["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        reference = env["KVRAY_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert reference == {"name": "kvray-api-key", "key": "api_key"}
