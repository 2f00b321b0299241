"""k8s/: the RayService against KubeRay's CRD schema (and broken copies against it, so the
check can fail), the Ray cluster's shape, the Services, Redis and the NetworkPolicies."""

import copy
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from tests.k8s.kube import (
    K8S,
    RAY_KINDS,
    Doc,
    cluster,
    container_port,
    crd_schema,
    head_labels,
    manifests,
    matches,
    one,
    ray_container,
    rayservice,
    reachable,
    requires_crds,
    schema_errors,
    worker_group,
    worker_labels,
)

# Ports of a Ray pod that only the cluster itself may reach (52365: the dashboard agent).
PRIVATE_PORTS = [6379, 8265, 10001, 8080, 52365]


def test_every_manifest_loads_and_names_its_kind() -> None:
    docs = manifests()
    kinds = {d["kind"] for _, d in docs}
    assert {"RayService", "Service", "NetworkPolicy", "Deployment"} <= kinds
    for name, doc in docs:
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name"), name


def _ray_docs() -> list[Doc]:
    return [d for _, d in manifests() if d["kind"] in RAY_KINDS]


@requires_crds
@pytest.mark.parametrize("index", range(len(_ray_docs())))
def test_ray_resources_validate_against_the_crd(index: int) -> None:
    assert _ray_docs(), "k8s/ has a RayService"
    assert schema_errors(_ray_docs()[index]) == []


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value

    return mutate


def _rename(path: str, old: str, new: str) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        node = doc
        for key in path.split("."):
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[new] = node.pop(old)

    return mutate


RC = "spec.rayClusterConfig"
WORKER = f"{RC}.workerGroupSpecs.0"
MUTATIONS = {
    "rayStartParams value not a string": _set(f"{RC}.headGroupSpec.rayStartParams.num-cpus", 0),
    "misspelled required field": _rename(WORKER, "maxReplicas", "maxReplica"),
    "misspelled optional field": _rename(RC, "enableInTreeAutoscaling", "enableInTreeAutoscaler"),
    "misspelled container field": _rename(
        f"{WORKER}.template.spec.containers.0", "readinessProbe", "readynessProbe"
    ),
    "minReplicas as a string": _set(f"{WORKER}.minReplicas", "1"),
    "fractional quantity as a number": _set(
        f"{WORKER}.template.spec.containers.0.resources.limits.cpu", 0.5
    ),
    "malformed quantity": _set(f"{WORKER}.template.spec.containers.0.resources.limits.cpu", "8x"),
    "unknown upscalingMode": _set(f"{RC}.autoscalerOptions.upscalingMode", "Fast"),
    "serveConfigV2 as a mapping": _set("spec.serveConfigV2", {"applications": []}),
    "missing headGroupSpec": lambda doc: doc["spec"]["rayClusterConfig"].pop("headGroupSpec"),
    "redisPassword as a plain string": _set(f"{RC}.gcsFaultToleranceOptions.redisPassword", "pw"),
}


@requires_crds
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_crd_validation_rejects_a_broken_copy(mutation: str) -> None:
    doc = copy.deepcopy(rayservice())
    MUTATIONS[mutation](doc)
    assert schema_errors(doc), f"{mutation} was accepted"


@requires_crds
def test_unknown_fields_need_the_strict_schema() -> None:
    """Plain JSON Schema lets a misspelled optional field through (the API server would reject
    it, or with loose validation drop it silently): that is what strict() is for."""
    doc = copy.deepcopy(rayservice())
    MUTATIONS["misspelled optional field"](doc)
    loose = jsonschema.Draft7Validator(crd_schema(doc["apiVersion"], doc["kind"]))
    assert list(loose.iter_errors(doc)) == []
    assert schema_errors(doc)


@requires_crds
def test_quantities_accept_what_kubernetes_accepts() -> None:
    doc = copy.deepcopy(rayservice())
    limits = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"][
        "containers"
    ][0]["resources"]["limits"]
    limits.update({"cpu": "7500m", "memory": "64G", "nvidia.com/gpu": 1})
    assert schema_errors(doc) == []


# ---------------------------------------------------------------- the Ray cluster


def test_head_runs_no_work_and_serves_its_dashboard() -> None:
    head = cluster()["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert "nvidia.com/gpu" not in ray_container(head)["resources"]["limits"]


@pytest.mark.parametrize("group", ["head", "worker"])
def test_pods_request_what_they_limit(group: str) -> None:
    spec = cluster()["headGroupSpec"] if group == "head" else worker_group()
    res = ray_container(spec)["resources"]
    assert {"cpu", "memory"} <= set(res["requests"])
    assert res["requests"] == res["limits"], "Ray sizes itself from limits; requests match"


def test_autoscaler_and_gcs_fault_tolerance_are_on() -> None:
    c = cluster()
    assert c["enableInTreeAutoscaling"] is True
    assert c["autoscalerOptions"]
    ft = c["gcsFaultToleranceOptions"]
    assert ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert "redis-password" not in c["headGroupSpec"]["rayStartParams"]


def test_ray_version_is_the_images_and_the_tests() -> None:
    import ray

    version = cluster()["rayVersion"]
    assert version == ray.__version__
    base = re.search(r"ARG RAY_IMAGE=rayproject/ray:([\d.]+)-", (K8S / "Dockerfile").read_text())
    assert base and base.group(1) == version
    images = {
        ray_container(g)["image"]
        for g in [cluster()["headGroupSpec"], *cluster()["workerGroupSpecs"]]
    }
    assert len(images) == 1, "head and workers run the same image"


def _probe_text(probe: Doc) -> str:
    if "httpGet" in probe:
        return f"localhost:{probe['httpGet']['port']}{probe['httpGet']['path']}"
    return " ".join(probe["exec"]["command"])


def test_serving_pods_are_ready_only_when_the_app_answers() -> None:
    worker = ray_container(worker_group())
    ready = _probe_text(worker["readinessProbe"])
    assert "localhost:8000/health" in ready  # the ingress, through this pod's proxy
    assert "localhost:8000/-/healthz" in ready  # this pod's proxy, not draining
    # Liveness stays local to the pod: through the ingress, one failure would restart them all.
    assert ":8000" not in _probe_text(worker["livenessProbe"])
    # The head turns ready before the app exists (KubeRay deploys it then): no app probe there.
    head = ray_container(cluster()["headGroupSpec"])
    assert all(
        ":8000" not in _probe_text(head[p])
        for p in ("readinessProbe", "livenessProbe")
        if p in head
    )


# ---------------------------------------------------------------- Services and Redis


def test_service_exposes_only_port_8000_of_the_serving_workers() -> None:
    svc = one("Service", "shoal")
    assert [p["port"] for p in svc["spec"]["ports"]] == [8000]
    (port,) = svc["spec"]["ports"]
    assert container_port(ray_container(worker_group()), port["targetPort"]) == 8000
    selector = svc["spec"]["selector"]
    assert "ray.io/cluster" not in selector, "a RayService's cluster name is random"
    assert matches(selector, worker_labels())
    assert not matches(selector, head_labels())
    assert rayservice()["spec"]["excludeHeadPodFromServeSvc"] is True


def test_gcs_fault_tolerance_points_at_the_redis_service() -> None:
    ft = cluster()["gcsFaultToleranceOptions"]
    host, port = ft["redisAddress"].rsplit(":", 1)
    svc = one("Service", host)
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["port"] == int(port)
    deployment = one("Deployment", host)
    template = deployment["spec"]["template"]
    assert matches(deployment["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])
    assert matches(svc["spec"]["selector"], template["metadata"]["labels"])
    (redis,) = template["spec"]["containers"]
    assert container_port(redis, svc_port["targetPort"]) in [
        p["containerPort"] for p in redis["ports"]
    ]
    # Redis and the head read the same Secret.
    env = {e["name"]: e for e in redis["env"]}
    secret = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert secret == ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert "$(REDIS_PASSWORD)" in redis["args"][redis["args"].index("--requirepass") + 1]


# ---------------------------------------------------------------- NetworkPolicy


OTHER_NS = {"kubernetes.io/metadata.name": "elsewhere"}
OPERATOR = {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/instance": "kuberay"}
CLIENT = {"app": "client"}


def redis_labels() -> dict[str, str]:
    return one("Deployment", "shoal-redis")["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("target", ["head", "worker"])
def test_networkpolicy_opens_8000_to_anyone(target: str) -> None:
    pod = head_labels() if target == "head" else worker_labels()
    assert reachable(pod, 8000, CLIENT)
    assert reachable(pod, 8000, CLIENT, OTHER_NS)


@pytest.mark.parametrize("port", PRIVATE_PORTS)
@pytest.mark.parametrize("target", ["head", "worker"])
def test_networkpolicy_keeps_ray_ports_inside_the_cluster(target: str, port: int) -> None:
    pod = head_labels() if target == "head" else worker_labels()
    assert reachable(pod, port, head_labels())
    assert reachable(pod, port, worker_labels())
    assert not reachable(pod, port, CLIENT)
    assert not reachable(pod, port, CLIENT, OTHER_NS)
    assert not reachable(pod, port, worker_labels(), OTHER_NS)  # another Shoal's pods
    assert not reachable(pod, port, redis_labels())
    assert reachable(pod, port, OPERATOR, OTHER_NS) == (port == 8265)


def test_the_policy_does_not_depend_on_the_random_cluster_name() -> None:
    other_cluster = {**worker_labels(), "ray.io/cluster": "shoal-p9w4z"}
    assert reachable(head_labels(), 6379, other_cluster)
    assert not reachable(head_labels(), 6379, {**CLIENT, "ray.io/cluster": "shoal-x7k2q"})


def test_redis_takes_only_ray_pods() -> None:
    redis = redis_labels()
    cleanup = {**head_labels(), "ray.io/node-type": "redis-cleanup"}  # KubeRay's cleanup Job
    for source in (head_labels(), worker_labels(), cleanup):
        assert reachable(redis, 6379, source)
    for source, ns in ((CLIENT, None), (CLIENT, OTHER_NS), (OPERATOR, OTHER_NS)):
        assert not reachable(redis, 6379, source, ns)
