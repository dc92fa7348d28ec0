"""Loading deploy/ manifests and validating them offline: KubeRay objects against the CRD
schemas in ../shared/crds, core objects against Kubernetes' own schemas."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}
KUBERNETES_VERSION = "1.33"


def crd_directory() -> Path:
    """The project's shared CRD schemas when they sit beside the checkout, else the copy in
    deploy/crds (so a fresh clone validates too)."""
    shared = ROOT.parent / "shared" / "crds"
    return shared if shared.is_dir() else DEPLOY / "crds"


def manifests() -> list[tuple[str, dict]]:
    """(file name, object) for every document of every deploy/*.yaml."""
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                found.append((path.name, document))
    return found


def crd_schema(kind: str, version: str) -> dict:
    crd = yaml.safe_load((crd_directory() / CRD_FILES[kind]).read_text())
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return _openapi_to_jsonschema(entry["schema"]["openAPIV3Schema"])


def _openapi_to_jsonschema(node):
    """OpenAPI v3 schema -> JSON Schema: int-or-string fields accept both."""
    if isinstance(node, list):
        return [_openapi_to_jsonschema(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _openapi_to_jsonschema(value) for key, value in node.items()}
    if node.pop("x-kubernetes-int-or-string", False):
        node.pop("type", None)
        node.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    return node


def validate(document: dict) -> None:
    """Raise (jsonschema or kubernetes_validate ValidationError) unless ``document`` is valid."""
    kind = document["kind"]
    if kind in CRD_FILES:
        group_version = document["apiVersion"]
        assert group_version.startswith("ray.io/"), group_version
        schema = crd_schema(kind, group_version.split("/", 1)[1])
        jsonschema.validate(copy.deepcopy(document), schema)
    else:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def cluster_spec(document: dict) -> dict:
    """The RayCluster spec of a RayCluster, a RayJob or a RayService."""
    spec = document["spec"]
    return spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or spec


def containers(document: dict) -> list[dict]:
    cluster = cluster_spec(document)
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def rayservice_application(file: str = "rayservice-replicas.yaml"):
    """The one Serve application of the RayService in ``file``, as Ray Serve's own schema
    reads its ``serveConfigV2``."""
    from ray.serve.schema import ServeDeploySchema

    (service,) = [d for n, d in manifests() if n == file and d["kind"] == "RayService"]
    config = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    (application,) = config.applications
    return application
