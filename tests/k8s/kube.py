"""The k8s/ manifests as the tests see them: loaded documents, Ray pods labelled as KubeRay
labels them, KubeRay's CRD schemas (strict, as the API server applies them) and a model of
NetworkPolicy ingress rules. No cluster needed.

The CRDs are KubeRay's (ray.io_rayservices.yaml, ray.io_rayclusters.yaml), read from
$SHOAL_KUBERAY_CRDS, else the project's shared/kuberay beside this checkout. The tests
that need them are skipped (with `requires_crds`) where neither exists.
"""

import os
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
CRDS = Path(
    os.environ.get("SHOAL_KUBERAY_CRDS")
    or next(
        (
            p
            for p in (ROOT.parent / "shared" / "kuberay", Path("/work/shared/kuberay"))
            if p.is_dir()
        ),
        ROOT.parent / "shared" / "kuberay",
    )
)
requires_crds = pytest.mark.skipif(
    not CRDS.is_dir(), reason=f"KubeRay CRDs not found at {CRDS} (set SHOAL_KUBERAY_CRDS)"
)
RAY_KINDS = {"RayService", "RayCluster"}
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

Doc = dict[str, Any]


@cache
def manifests() -> tuple[tuple[str, Doc], ...]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.load_all(path.read_text(), Loader=_Loader):
            if doc is not None:
                docs.append((path.name, doc))
    return tuple(docs)


def one(kind: str, name: str | None = None) -> Doc:
    found = [
        d
        for _, d in manifests()
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def rayservice() -> Doc:
    return one("RayService")


def cluster() -> Doc:
    return rayservice()["spec"]["rayClusterConfig"]


def worker_group() -> Doc:
    groups = cluster()["workerGroupSpecs"]
    assert len(groups) == 1, "one GPU worker group"
    return groups[0]


def ray_container(group: Doc) -> Doc:
    return group["template"]["spec"]["containers"][0]  # KubeRay: the Ray container is the first


def serve_config() -> Doc:
    return yaml.safe_load(rayservice()["spec"]["serveConfigV2"])


def app_args() -> Doc:
    (application,) = serve_config()["applications"]
    return application["args"]


def pod_labels(group: Doc, node_type: str, group_name: str) -> dict[str, str]:
    """A Ray pod's labels as KubeRay sets them (common/pod.go labelPod): the template's, plus
    its own. A RayService's cluster is named `<rayservice>-<5 random chars>`."""
    return {
        **group["template"].get("metadata", {}).get("labels", {}),
        "ray.io/is-ray-node": "yes",
        "ray.io/cluster": "shoal-x7k2q",
        "ray.io/node-type": node_type,
        "ray.io/group": group_name,
        "ray.io/serve": "true" if node_type == "worker" else "false",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }


def pod_specs() -> dict[str, Doc]:
    """The pod templates' specs of every pod k8s/ runs: the Ray head, the Ray workers and Redis."""
    return {
        "head": cluster()["headGroupSpec"]["template"]["spec"],
        "worker": worker_group()["template"]["spec"],
        "redis": one("Deployment", "shoal-redis")["spec"]["template"]["spec"],
    }


def containers(pod: str) -> list[Doc]:
    """A pod's init and app containers, for the head with the autoscaler sidecar as KubeRay
    adds it (common/pod.go: only its securityContext and volumeMounts come from
    autoscalerOptions). KubeRay's wait-gcs-ready init container copies the Ray container's
    securityContext and volumeMounts, and its Redis cleanup Job keeps the head's Ray container:
    both are covered by the Ray containers themselves."""
    spec = pod_specs()[pod]
    found = [*spec.get("initContainers", []), *spec["containers"]]
    if pod == "head" and cluster().get("enableInTreeAutoscaling"):
        options = cluster().get("autoscalerOptions", {})
        found.append(
            {
                "name": "autoscaler",
                "securityContext": options.get("securityContext"),
                "volumeMounts": options.get("volumeMounts", []),
            }
        )
    return found


def volumes(pod: str) -> dict[str, Doc]:
    return {v["name"]: v for v in pod_specs()[pod].get("volumes", [])}


def mount_for(container: Doc, path: str) -> Doc | None:
    """The volumeMount of `container` that holds `path` (the deepest one), if any."""
    holding = [
        m
        for m in container.get("volumeMounts", [])
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    return max(holding, key=lambda m: len(m["mountPath"]), default=None)


def head_labels() -> dict[str, str]:
    return pod_labels(cluster()["headGroupSpec"], "head", "headgroup")


def worker_labels() -> dict[str, str]:
    return pod_labels(worker_group(), "worker", worker_group()["groupName"])


def gpus(container: Doc) -> int:
    limits = container["resources"]["limits"]
    return int(limits.get("nvidia.com/gpu", 0))


def cpus(quantity: str | int) -> float:
    q = str(quantity)
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


# ---------------------------------------------------------------- CRD schemas


@cache
def crd_schema(api_version: str, kind: str) -> Doc:
    group, version = api_version.split("/")
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=_Loader)
        if crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind:
            (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
            return entry["schema"]["openAPIV3Schema"]
    raise AssertionError(f"no CRD for {kind} in {api_version} under {CRDS}")


def strict(schema: Doc) -> Doc:
    """The schema with unknown fields forbidden, as the API server's strict field validation
    (kubectl's default) treats them; plain JSON Schema would accept a misspelled field."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(out["additionalProperties"])
    if isinstance(out.get("items"), dict):
        out["items"] = strict(out["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [strict(s) for s in out[key]]
    return out


@cache
def validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    # OpenAPI v3's schema subset reads as Draft 7. x-kubernetes-* keys are ignored (their CEL
    # rules are not checked here); int-or-string fields are `anyOf: [integer, string]` with a
    # quantity pattern, which Draft 7 checks as is: "8Gi" and 1 pass, 0.5 does not.
    return jsonschema.Draft7Validator(strict(crd_schema(api_version, kind)))


def schema_errors(doc: Doc) -> list[str]:
    v = validator(doc["apiVersion"], doc["kind"])
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def container_port(container: Doc, target: int | str) -> int:
    if isinstance(target, int):
        return target
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == target]
    return port


# ---------------------------------------------------------------- NetworkPolicy

# The namespace the manifests are applied in (`kubectl apply -f k8s/` names none): any but the
# KubeRay operator's.
APP_NS = {"kubernetes.io/metadata.name": "shoal"}


def _peer_admits(peer: Doc, labels: dict[str, str], ns_labels: dict[str, str] | None) -> bool:
    """ns_labels None: the source is in the policy's own namespace (labelled APP_NS)."""
    assert "ipBlock" not in peer
    for sel in (peer.get("podSelector"), peer.get("namespaceSelector")):
        assert sel is None or set(sel) <= {"matchLabels"}, "only matchLabels is modelled"
    same_ns = ns_labels is None or ns_labels == APP_NS
    if "namespaceSelector" in peer:
        ns_ok = matches(peer["namespaceSelector"].get("matchLabels", {}), ns_labels or APP_NS)
    else:
        ns_ok = same_ns
    pod_sel = peer.get("podSelector", {}).get("matchLabels", {})
    return ns_ok and matches(pod_sel, labels)


def reachable(
    target: dict[str, str], port: int, source: dict[str, str], ns: dict[str, str] | None = None
) -> bool:
    """Whether a TCP connection from a pod labelled `source` (in a namespace labelled `ns`;
    None: the same namespace) to `port` of a pod labelled `target` is let in, by the
    NetworkPolicies in k8s/ (NetworkPolicy semantics: allowed unless some policy selects the
    target for Ingress; then allowed if any rule of any of them admits it)."""
    policies = [
        d
        for _, d in manifests()
        if d["kind"] == "NetworkPolicy"
        and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])
        and matches(d["spec"]["podSelector"].get("matchLabels", {}), target)
    ]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(
                p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in ports
            ):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_admits(p, source, ns) for p in peers):
                return True
    return False
