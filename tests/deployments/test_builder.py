"""The Serve application graph as built from typed args (no Ray started)."""

import os
from pathlib import Path

import pytest
from pydantic import ValidationError
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

import app
from deployments.builder import build_app
from deployments.config import AppArgs, AppConfig


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


def test_a_database_given_as_args_overrides_the_files_older_spelling(tmp_path):
    """A file from before the one `database` setting (`assistants.database_path`) and a
    `database` given as args: the args win, as over the newer spelling (before: refused
    as the database set twice). Both spellings in one place stay refused."""
    path = tmp_path / "c.yaml"
    path.write_text(f"assistants:\n  database_path: {tmp_path / 'old.sqlite3'}\n")
    given = {"config_path": str(path), "database": {"url": "sqlite:///new.sqlite3"}}
    assert AppArgs.model_validate(given).resolve().database.url == "sqlite:///new.sqlite3"
    file_only = AppArgs.model_validate({"config_path": str(path)}).resolve()
    assert file_only.database.path == str(tmp_path / "old.sqlite3")
    with pytest.raises(ValueError, match="set the database once"):
        AppArgs.model_validate(
            {"assistants": {"database_path": "a.sqlite3"}, "database": {"path": "b.sqlite3"}}
        )


def ray_cpus(application) -> float:
    """The CPUs Ray must find free to start every replica the application begins with."""
    total = 0.0
    for d in deployments(application).values():
        config, replica = d._deployment_config, d._replica_config
        count = config.num_replicas
        if config.autoscaling_config is not None:
            auto = config.autoscaling_config
            count = max(auto.min_replicas, auto.initial_replicas or 0)
        bundles = replica.placement_group_bundles
        per_replica = (
            sum(b.get("CPU", 0) for b in bundles)
            if bundles
            else replica.ray_actor_options.get("num_cpus", 1)
        )
        total += count * per_replica
    return total


@pytest.mark.parametrize(
    "path",
    [None, *sorted(str(p) for p in (Path(__file__).parents[2] / "configs").glob("*.yaml"))],
    ids=lambda p: Path(p).name if p else "default",
)
def test_every_shipped_config_fits_two_cpus(path):
    """Shoal's promise: the default app and every config in configs/ start on a 2-core
    machine (Ray counts 2 CPUs there); a deployment that does not fit is never scheduled
    and the app never answers."""
    config = AppConfig() if path is None else AppConfig.from_yaml(path)
    assert ray_cpus(build_app(config)) <= 2.0, path


def test_several_ingress_replicas_need_one_shared_database():
    """Stored Responses are the app's whether or not Assistants are on."""
    with pytest.raises(ValidationError, match="database.url"):
        AppConfig.model_validate({"ingress_replicas": 2})
    with pytest.raises(ValidationError, match="database.url"):
        AppConfig.model_validate({"ingress_replicas": 2, "assistants": {"enabled": False}})
    shared = {"url": "postgresql+psycopg://u@db/shoal"}
    assert AppConfig.model_validate({"ingress_replicas": 2, "database": shared})


def test_one_database_setting_and_its_older_spelling():
    """`database` is the app's one database; `assistants.database_url` / `database_path`
    still mean it (from when Assistants alone had one), but not beside it."""
    new = AppConfig.model_validate({"database": {"url": "sqlite:////tmp/x.sqlite3"}})
    old = AppConfig.model_validate({"assistants": {"database_url": "sqlite:////tmp/x.sqlite3"}})
    assert new.database == old.database and new.database.sqlalchemy_url().endswith("x.sqlite3")
    path = AppConfig.model_validate({"assistants": {"enabled": False, "database_path": "/tmp/y"}})
    assert path.database.sqlalchemy_url() == "sqlite:////tmp/y" and not path.assistants.enabled
    with pytest.raises(ValidationError, match="set the database once"):
        AppConfig.model_validate(
            {"database": {"url": "sqlite://"}, "assistants": {"database_url": "sqlite://"}}
        )


def test_quiet_ray_defaults_fill_only_what_is_unset(monkeypatch):
    """What `serve run app:graph` gives the Ray it starts: the quieter timers, never over
    a value the user set, and nothing once this process is connected to a Ray."""
    import ray

    from deployments.quiet_ray import QUIET_DEFAULTS, quiet_ray_defaults

    for name in QUIET_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.2")
    chosen = quiet_ray_defaults()
    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in chosen
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.2"
    assert chosen == {
        k: v for k, v in QUIET_DEFAULTS.items() if k != "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
    }
    assert all(os.environ[k] == v for k, v in chosen.items())
    for name in chosen:
        monkeypatch.delenv(name)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert quiet_ray_defaults() == {} and not any(k in os.environ for k in chosen)


def test_the_conftest_lists_every_quiet_timer():
    """tests/conftest.py restores these after each test: it must know them all."""
    from deployments.quiet_ray import QUIET_DEFAULTS
    from tests.conftest import _QUIET

    assert set(_QUIET) == set(QUIET_DEFAULTS)
