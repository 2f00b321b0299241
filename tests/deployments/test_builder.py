"""The Serve application graph as built from typed args (no Ray started)."""

import pytest
from pydantic import ValidationError
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

import app
from app.builder import build_app
from app.config import AppArgs, AppConfig


def deployments(application) -> dict:
    from ray.serve._private.build_app import build_app as flatten

    return {d.name: d for d in flatten(application, name="x").deployments}


def test_graph_takes_typed_args_and_builds_the_default_graph():
    built = deployments(call_user_app_builder_with_args_if_necessary(app.graph, {}))
    assert set(built) == set(deployments(build_app(AppConfig())))
    assert {"Ingress", "Tokenizer", "EngineRegistry", "Embedder"} <= set(built)
    with pytest.raises(ValidationError):  # Serve validates the args against AppArgs
        call_user_app_builder_with_args_if_necessary(app.graph, {"models": [{"nme": "x"}]})


def test_autoscaling_and_shutdown_options_reach_the_model_deployment():
    args = {
        "embeddings": {"enabled": False},
        "models": [
            {
                "name": "m",
                "autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8},
                "graceful_shutdown_timeout_s": 12,
                "routing": {"max_imbalance": 3},
            }
        ],
    }
    model = deployments(call_user_app_builder_with_args_if_necessary(app.graph, args))[
        "ModelServer:m"
    ]
    auto = model._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 3, 8)
    assert model._deployment_config.graceful_shutdown_timeout_s == 12
    router = model._deployment_config.request_router_config
    assert router.request_router_kwargs["routing"]["max_imbalance"] == 3
    with pytest.raises(ValidationError):
        AppArgs.model_validate(
            {"models": [{"autoscaling": {"min_replicas": 3, "max_replicas": 2}}]}
        )


def test_args_override_the_config_file(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("max_tokens_default: 7\napi_keys: [k1]\n")
    resolved = AppArgs.model_validate({"config_path": str(path), "api_keys": ["k2"]}).resolve()
    assert (resolved.max_tokens_default, resolved.api_keys) == (7, ["k2"])
    monkeypatch.setenv("SHOAL_CONFIG", str(path))
    assert AppArgs().resolve().max_tokens_default == 7
