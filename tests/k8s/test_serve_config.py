"""k8s/rayservice.yaml's serveConfigV2: it parses as Serve's deploy schema, its import path is
Shoal's application builder, its args validate and build the same deployments as the default
app, what they ask for fits the worker pods, and the API keys come from the Secret's file that
`config_path` names. Built as Serve builds it, without Ray."""

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s.kube import (
    app_args,
    cluster,
    cpus,
    gpus,
    manifests,
    ray_container,
    rayservice,
    serve_config,
    worker_group,
)

# What the shoal-config Secret's config.yaml holds (docs/operating.md: "Deploying on Kubernetes").
SECRET_CONFIG = {
    "api_keys": ["k8s-test-key-1", "k8s-test-key-2"],
    "database": {"url": "postgresql+psycopg://shoal:pw@postgres:5432/shoal"},
}


def _args_with_secret(tmp_path: Path) -> dict[str, Any]:
    """serveConfigV2's args with config_path pointed at a local copy of the Secret's file
    (the pods mount it at config_path)."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(SECRET_CONFIG))
    return {**app_args(), "config_path": str(path)}


@pytest.fixture(scope="module")
def built_apps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The application serveConfigV2 deploys and the default one, built as Serve builds them
    (args through the builder's annotation), without starting Ray."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app as serve_build_app

    from deployments.builder import build_app
    from deployments.config import AppConfig

    (application,) = serve_config()["applications"]
    args = _args_with_secret(tmp_path_factory.mktemp("shoal-config"))
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SHOAL_CONFIG", raising=False)
        builder = import_attr(application["import_path"])
        app = call_user_app_builder_with_args_if_necessary(builder, args)
    return {
        "builder": builder,
        "k8s": serve_build_app(app, name="shoal"),
        "default": serve_build_app(build_app(AppConfig()), name="default"),
    }


def _kind(deployment_name: str) -> str:
    return deployment_name.split(":")[0]  # ModelServer:<model name> -> ModelServer


def test_serve_config_parses_with_serves_schema() -> None:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config())
    (application,) = schema.applications
    assert application.import_path == "app:graph"
    assert application.route_prefix == "/"


def test_import_path_is_the_application_builder(built_apps: dict[str, Any]) -> None:
    from deployments.builder import graph

    assert built_apps["builder"] is graph


def test_args_are_app_args() -> None:
    from deployments.config import AppArgs

    args = AppArgs.model_validate(app_args())
    (model,) = args.models
    assert "/" in model.engine.model  # a Hub repo id
    assert model.engine.dtype == "bfloat16"


def test_bad_args_are_rejected_like_serve_would() -> None:
    from pydantic import ValidationError
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from deployments.builder import graph

    args = copy.deepcopy(app_args())
    args["models"][0]["engine"]["modle"] = args["models"][0]["engine"].pop("model")
    with pytest.raises(ValidationError):
        call_user_app_builder_with_args_if_necessary(graph, args)


def test_deployments_are_those_of_the_default_app(built_apps: dict[str, Any]) -> None:
    k8s, default = built_apps["k8s"], built_apps["default"]
    names = {d.name for d in k8s.deployments}
    assert {_kind(n) for n in names} == {_kind(d.name) for d in default.deployments}
    assert {n for n in names if n.startswith("ModelServer:")} == {
        f"ModelServer:{m['name']}" for m in app_args()["models"]
    }
    assert k8s.ingress_deployment_name == default.ingress_deployment_name


def _model_servers(built_apps: dict[str, Any]) -> list[tuple[dict[str, Any], Any]]:
    """Each model's args with its built ModelServer deployment."""
    by_name = {d.name: d for d in built_apps["k8s"].deployments}
    return [(m, by_name[f"ModelServer:{m['name']}"]) for m in app_args()["models"]]


def test_a_replica_fits_a_worker_pod_and_gpus_divide(built_apps: dict[str, Any]) -> None:
    pod_gpus = gpus(ray_container(worker_group()))
    assert pod_gpus >= 1
    assert worker_group()["rayStartParams"]["num-gpus"] == str(pod_gpus)
    for m, d in _model_servers(built_apps):
        tp = m["engine"].get("tensor_parallel_size", 1)
        assert m["num_gpus"] == tp, "one GPU per tensor-parallel shard"
        assert pod_gpus % tp == 0, "a pod holds whole replicas (STRICT_PACK on one node)"
        bundles = d._replica_config.placement_group_bundles or [d.ray_actor_options]
        assert sum(b.get("GPU", b.get("num_gpus", 0)) for b in bundles) == tp


def test_worker_group_bounds_follow_autoscaling(built_apps: dict[str, Any]) -> None:
    pod_gpus = gpus(ray_container(worker_group()))
    lo = hi = 0
    for m, d in _model_servers(built_apps):
        scaling = d._deployment_config.autoscaling_config
        assert scaling is not None, "model replicas are autoscaled"
        assert (scaling.min_replicas, scaling.max_replicas) == (
            m["autoscaling"]["min_replicas"],
            m["autoscaling"]["max_replicas"],
        )
        per_pod = pod_gpus // m["num_gpus"]
        lo += math.ceil(scaling.min_replicas / per_pod)
        hi += math.ceil(scaling.max_replicas / per_pod)
    group = worker_group()
    assert (group["minReplicas"], group["maxReplicas"]) == (max(lo, 1), hi)
    assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= hi


def test_cpu_deployments_fit_beside_a_model_replica(built_apps: dict[str, Any]) -> None:
    """The head has no CPUs for Ray, so the ingress, tokenizer, embedder and registry run on
    a GPU worker next to a model replica: all of them together must fit one pod."""
    assert cluster()["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    pod_cpus = cpus(ray_container(worker_group())["resources"]["limits"]["cpu"])
    light = sum(
        d.ray_actor_options.get("num_cpus", 1) * d._deployment_config.num_replicas
        for d in built_apps["k8s"].deployments
        if not d.name.startswith("ModelServer:")
    )
    largest = max(d.ray_actor_options["num_cpus"] for _, d in _model_servers(built_apps))
    assert largest + light <= pod_cpus


def test_secrets_stay_out_of_the_serve_config() -> None:
    text = rayservice()["spec"]["serveConfigV2"]
    assert "HF_TOKEN" not in text
    env = {e["name"]: e for e in ray_container(worker_group()).get("env", [])}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"]
    # A Secret manifest here would also overwrite the real one at each `kubectl apply -f k8s/`.
    assert not [d for _, d in manifests() if d["kind"] == "Secret"], "no credentials in the repo"


def test_api_keys_come_from_the_config_file(tmp_path: Path) -> None:
    """Fields in `args` override the file's, so `args` must not set api_keys (not even to [],
    which would turn auth off whatever the Secret says)."""
    from deployments.config import AppArgs

    args = app_args()
    assert "api_keys" not in args
    assert args["config_path"].startswith("/")
    config = AppArgs.model_validate(_args_with_secret(tmp_path)).resolve()
    assert config.api_keys == SECRET_CONFIG["api_keys"]
    (model,) = config.models
    assert model.name == args["models"][0]["name"], "args still set everything else"


def test_the_builder_reads_config_path(built_apps: dict[str, Any], tmp_path: Path) -> None:
    """Serve's builder path reads the file: a missing one fails the deploy instead of serving
    without keys."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    args = {**app_args(), "config_path": str(tmp_path / "missing.yaml")}
    with pytest.raises(FileNotFoundError):
        call_user_app_builder_with_args_if_necessary(built_apps["builder"], args)


def test_http_requests_have_a_time_limit() -> None:
    """The application's limit ends a request whatever its headers; Serve's proxy limit,
    which a client can lift, is a backstop just above it."""
    from ray.serve.schema import ServeDeploySchema

    from deployments.config import AppArgs

    serve_limit = ServeDeploySchema.model_validate(serve_config()).http_options.request_timeout_s
    # The Secret's file holds only api_keys: the args (or the default) set the limit.
    args = {k: v for k, v in app_args().items() if k != "config_path"}
    app_limit = AppArgs.model_validate(args).request_timeout_s
    assert app_limit is not None and 60 <= app_limit <= 3600
    assert serve_limit is not None and app_limit < serve_limit <= app_limit + 120


def test_hf_home_is_on_the_workers_cache_volume() -> None:
    (application,) = serve_config()["applications"]
    hf_home = application["runtime_env"]["env_vars"]["HF_HOME"]
    mounts = [m["mountPath"] for m in ray_container(worker_group())["volumeMounts"]]
    assert any(hf_home == m or hf_home.startswith(m.rstrip("/") + "/") for m in mounts)
