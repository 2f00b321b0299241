"""k8s/: the RayService against KubeRay's CRD schema (and broken copies against it, so the
check can fail), the Ray cluster's shape, the Services, Redis, the NetworkPolicies and the
pods' security settings (users, capabilities, service account tokens, secrets)."""

import copy
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import yaml

from tests.k8s.kube import (
    K8S,
    RAY_KINDS,
    ROOT,
    Doc,
    app_args,
    cluster,
    container_port,
    containers,
    crd_schema,
    head_labels,
    manifests,
    matches,
    mount_for,
    one,
    pod_specs,
    ray_container,
    rayservice,
    reachable,
    requires_crds,
    schema_errors,
    serve_config,
    volumes,
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
    # Redis (its config file and redis-cli) and the head read the same Secret.
    head_secret = ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    env = {e["name"]: e for e in redis["env"]}
    assert env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == head_secret
    secret = volumes("redis")["password"]["secret"]
    assert secret["secretName"] == head_secret["name"]
    assert [i["key"] for i in secret["items"]] == [head_secret["key"]]


def _redis_config_script() -> tuple[Doc, str]:
    (init,) = pod_specs()["redis"]["initContainers"]
    assert init["command"][:2] == ["sh", "-ec"]
    return init, init["command"][2]


def _words(container: Doc) -> list[str]:
    probes = [container.get(p, {}).get("exec", {}) for p in ("readinessProbe", "livenessProbe")]
    return [
        *container.get("command", []),
        *container.get("args", []),
        *(w for probe in probes for w in probe.get("command", [])),
    ]


def test_redis_password_is_on_no_command_line() -> None:
    """Not in redis-server's argv (ps, /proc/<pid>/cmdline, the pod spec), nor redis-cli's."""
    secret_env: set[str] = set()
    for c in containers("redis"):
        env = {
            e["name"]
            for e in c.get("env", [])
            if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "shoal-redis"
        }
        secret_env |= env
        words = " ".join(_words(c))
        # Kubernetes expands $(NAME) in command and args from the container's env.
        assert not {n for n in env if f"$({n})" in words}, f"{c['name']}: secret in argv"
        assert "requirepass" not in " ".join(c.get("args", [])), c["name"]
        assert not re.search(r"(^|\s)(-a|--pass|--requirepass)(\s|$)", words), c["name"]
    assert secret_env == {"REDISCLI_AUTH"}, "redis-cli reads it from its env, nothing else"
    # redis-server reads the file the init container writes, from a volume the two share.
    init, _ = _redis_config_script()
    (redis,) = pod_specs()["redis"]["containers"]
    assert redis["args"][0] == "redis-server"
    conf = redis["args"][1]
    mount = mount_for(redis, conf)
    assert mount and mount["readOnly"] is True
    assert "emptyDir" in volumes("redis")[mount["name"]]
    init_mount = mount_for(init, conf)
    assert init_mount and init_mount["name"] == mount["name"] and not init_mount.get("readOnly")
    assert "redis-cli ping" in " ".join(_words(redis))


def _decode_redis_string(text: str) -> bytes:
    """`requirepass "..."` as Redis's config parser (sdssplitargs) reads the \\xHH form the
    init container writes."""
    m = re.fullmatch(r'requirepass "((?:\\x[0-9a-f]{2})*)"\n', text)
    assert m, text
    return bytes.fromhex(m.group(1).replace("\\x", ""))


def _run_redis_config(tmp_path: Path, password: bytes) -> subprocess.CompletedProcess[str]:
    # The redis image's shell tools; every machine that runs the tests has them too.
    missing = [t for t in ("sh", "od", "tr", "sed") if not shutil.which(t)]
    assert not missing, f"the redis init script needs {missing}"
    init, script = _redis_config_script()
    secret_dir, conf_dir = tmp_path / "secret", tmp_path / "conf"
    secret_dir.mkdir()
    conf_dir.mkdir()
    (secret_dir / "password").write_bytes(password)
    for m in init["volumeMounts"]:
        local = secret_dir if m["name"] == "password" else conf_dir
        script = script.replace(m["mountPath"], str(local))
    return subprocess.run(["sh", "-ec", script], capture_output=True, text=True)


@pytest.mark.parametrize(
    "password",
    [b"0f3a9c" * 8, b'a "b" \\ c $(x) `y` %s \' ; #\n', bytes(range(1, 256)), b"ends-in-newline\n"],
)
def test_redis_config_holds_the_password_byte_for_byte(tmp_path: Path, password: bytes) -> None:
    """As KubeRay hands it to the head (REDIS_PASSWORD from the Secret, unchanged)."""
    run = _run_redis_config(tmp_path, password)
    assert run.returncode == 0, run.stderr
    (conf,) = (tmp_path / "conf").iterdir()
    assert _decode_redis_string(conf.read_text()) == password
    assert conf.stat().st_mode & 0o077 == 0, "only redis's user reads it"


def test_redis_config_refuses_an_empty_password(tmp_path: Path) -> None:
    """`requirepass ""` would turn authentication off: the pod must not start instead."""
    assert _run_redis_config(tmp_path, b"").returncode != 0


# ---------------------------------------------------------------- NetworkPolicy


OTHER_NS = {"kubernetes.io/metadata.name": "elsewhere"}
OPERATOR_NS_NAME = "kuberay-system"  # where docs/operating.md installs the KubeRay operator
OPERATOR_NS = {"kubernetes.io/metadata.name": OPERATOR_NS_NAME}
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
    assert reachable(pod, port, OPERATOR, OPERATOR_NS) == (port == 8265)


@pytest.mark.parametrize("target", ["head", "worker"])
def test_dashboard_is_open_only_to_the_operators_namespace(target: str) -> None:
    """Not to a pod that takes the operator's label in another namespace (or this one), nor
    to other pods of the operator's namespace."""
    pod = head_labels() if target == "head" else worker_labels()
    assert reachable(pod, 8265, OPERATOR, OPERATOR_NS)
    assert reachable(pod, 8265, head_labels())
    for source, ns in ((OPERATOR, OTHER_NS), (OPERATOR, None), (CLIENT, OPERATOR_NS)):
        assert not reachable(pod, 8265, source, ns)


def test_readme_installs_the_operator_where_the_policy_expects_it() -> None:
    guide = (ROOT / "docs" / "operating.md").read_text()
    section = guide.split("## Deploying on Kubernetes (KubeRay)", 1)[1].split("\n## ", 1)[0]
    (install,) = [line for line in section.splitlines() if "helm install kuberay-operator" in line]
    assert f"--namespace {OPERATOR_NS_NAME}" in install


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


# ---------------------------------------------------------------- pod security

# The images' own users: rayproject/ray's `ray` (uid 1000, group users = 100), redis's `redis`.
USERS = {"head": (1000, 100), "worker": (1000, 100), "redis": (999, 999)}
PODS = list(USERS)


@pytest.mark.parametrize("pod", PODS)
def test_pods_run_as_their_images_non_root_user(pod: str) -> None:
    sc = pod_specs()[pod]["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert (sc["runAsUser"], sc["runAsGroup"]) == USERS[pod]
    assert sc["fsGroup"] == USERS[pod][1], "mounted secrets and volumes belong to its group"
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}


@pytest.mark.parametrize("pod", PODS)
def test_containers_drop_every_privilege(pod: str) -> None:
    found = containers(pod)
    assert found
    for c in found:
        sc = c.get("securityContext") or {}
        assert sc.get("allowPrivilegeEscalation") is False, c["name"]
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], c["name"]
        assert not sc.get("capabilities", {}).get("add"), c["name"]
        assert not sc.get("privileged"), c["name"]
        assert sc.get("runAsNonRoot", True) is True and sc.get("runAsUser", 1) != 0, c["name"]


@pytest.mark.parametrize("pod", PODS)
def test_root_filesystems_are_read_only(pod: str) -> None:
    """Each container writes only to volumes: Ray under /tmp (an emptyDir: Ray's sessions, logs
    and spilled objects, Python's and torch's temporary files), Redis under /data."""
    vols = volumes(pod)
    for c in containers(pod):
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
        for m in c.get("volumeMounts", []):
            assert m["name"] in vols, f"{c['name']} mounts the missing volume {m['name']}"
    if pod != "redis":
        for c in containers(pod):
            tmp = mount_for(c, "/tmp/ray")
            assert tmp and tmp["mountPath"] == "/tmp", c["name"]
            assert "emptyDir" in vols[tmp["name"]]
    else:
        (redis,) = pod_specs()["redis"]["containers"]
        data = redis["args"][redis["args"].index("--dir") + 1]
        assert "persistentVolumeClaim" in vols[mount_for(redis, data)["name"]]


@pytest.mark.parametrize("pod", PODS)
def test_no_pod_mounts_a_service_account_token(pod: str) -> None:
    assert pod_specs()[pod]["automountServiceAccountToken"] is False
    for c in containers(pod):
        if c["name"] == "autoscaler":
            continue
        token = mount_for(c, "/var/run/secrets/kubernetes.io/serviceaccount/token")
        assert token is None, f"{c['name']} mounts a token"


def test_only_the_autoscaler_gets_the_api_token() -> None:
    """It scales the worker group through the Kubernetes API, with the in-cluster credentials
    Ray's KubeRay node provider reads (token and ca.crt in the usual place); the Ray container,
    which runs the application, has none."""
    (autoscaler,) = [c for c in containers("head") if c["name"] == "autoscaler"]
    mount = mount_for(autoscaler, "/var/run/secrets/kubernetes.io/serviceaccount/token")
    assert mount and mount["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
    assert mount["readOnly"] is True
    sources = volumes("head")[mount["name"]]["projected"]["sources"]
    token = [s["serviceAccountToken"] for s in sources if "serviceAccountToken" in s]
    assert [t["path"] for t in token] == ["token"]
    ca = [s["configMap"] for s in sources if "configMap" in s]
    assert ca == [{"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}]
    (api,) = [s["downwardAPI"] for s in sources if "downwardAPI" in s]
    assert api["items"][0]["path"] == "namespace"
    assert mount_for(ray_container(cluster()["headGroupSpec"]), mount["mountPath"]) is None


@pytest.mark.parametrize("pod", ["head", "worker"])
def test_every_ray_pod_mounts_the_config_secret_at_config_path(pod: str) -> None:
    """Serve builds the application (and reads config_path) on whichever Ray pod it picks."""
    path = PurePosixPath(app_args()["config_path"])
    group = cluster()["headGroupSpec"] if pod == "head" else worker_group()
    mount = mount_for(ray_container(group), str(path))
    assert mount and mount["readOnly"] is True
    secret = volumes(pod)[mount["name"]]["secret"]
    assert secret["secretName"] == "shoal-config"
    assert not secret.get("optional"), "no Secret must mean no pod, not a server without keys"
    relative = str(path.relative_to(mount["mountPath"]))
    assert [i["path"] for i in secret["items"]] == [relative]
    assert [i["key"] for i in secret["items"]] == ["config.yaml"]
    assert secret["defaultMode"] & 0o007 == 0, "not world-readable"


# ---------------------------------------------------------------- where the app writes


def _app_config_on_a_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, secret: Doc, **args: Any
) -> Any:
    """The AppConfig as the application's replicas get it: serveConfigV2's args over the
    shoal-config file, with its runtime_env's variables set (Serve sets them for the build
    and for every replica)."""
    from deployments.config import AppArgs

    (application,) = serve_config()["applications"]
    for name, value in application["runtime_env"]["env_vars"].items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(secret))
    return AppArgs.model_validate({**app_args(), **args, "config_path": str(path)}).resolve()


@pytest.mark.parametrize("database", ["postgresql+psycopg://shoal:pw@postgres/shoal", None])
def test_every_path_the_app_writes_is_on_a_writable_volume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, database: str | None
) -> None:
    """The workers run every replica (the head takes none) on a read-only root: downloads,
    the operator's state, the app's SQLite file (when no database.url), converted
    tokenizers and the Hugging Face cache must each be on a volume mounted writable."""
    from deployments.database_config import operator_state_url

    secret = {"api_keys": ["k"], "database": {"url": database} if database else {}}
    # Without database.url only one ingress replica may run (each would have its own file).
    replicas = {} if database else {"ingress_replicas": 1}
    config = _app_config_on_a_worker(tmp_path, monkeypatch, secret, **replicas)
    worker = ray_container(worker_group())
    assert worker["securityContext"]["readOnlyRootFilesystem"] is True
    env = serve_config()["applications"][0]["runtime_env"]["env_vars"]
    models_dir = config.operator.models_dir
    state = config.operator.state_path or f"{models_dir}/.shoal-operator/state.sqlite3"
    written = {
        "models_dir": models_dir,
        "the operator's state": state,
        "the app's SQLite file": config.database.path,
        "converted tokenizers": env["SHOAL_CACHE_DIR"],
        "uploaded files": config.files.data_dir,
        "the Hugging Face cache": env["HF_HOME"],
    }
    if database:
        assert operator_state_url(config.database, models_dir, None) == database
    for what, path in written.items():
        assert PurePosixPath(path).is_absolute(), f"{what}: {path} (no home on a pod)"
        mount = mount_for(worker, path)
        assert mount, f"{what} ({path}) is on the read-only root"
        assert not mount.get("readOnly"), f"{what} ({path}) is on a read-only mount"
        assert mount["name"] in volumes("worker"), mount["name"]


@pytest.mark.parametrize("variable", ["SHOAL_MODELS_DIR", "SHOAL_DATA_DIR"])
def test_downloads_and_uploads_are_on_storage_every_worker_shares(variable: str) -> None:
    """The Operator downloads on one worker, an alias's replica loads the files on any;
    an ingress replica takes an upload on one worker, any ingress's ingestor indexes it."""
    (application,) = serve_config()["applications"]
    models_dir = application["runtime_env"]["env_vars"][variable]
    mount = mount_for(ray_container(worker_group()), models_dir)
    assert mount and mount["mountPath"] == models_dir
    claim_name = volumes("worker")[mount["name"]]["persistentVolumeClaim"]["claimName"]
    claim = one("PersistentVolumeClaim", claim_name)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"]
