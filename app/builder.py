"""build_app: the only place where deployments are bound into a Serve application."""

from typing import Any

from ray.serve import Application

from app.config import AppConfig


def build_app(config: AppConfig) -> Application:
    from deployments.embeddings import EmbedderDeployment
    from deployments.ingress import make_ingress
    from deployments.model_server import ModelServerDeployment
    from deployments.tokenizer import TokenizerDeployment

    tokenizer = TokenizerDeployment.options(
        max_ongoing_requests=config.tokenizer_max_ongoing_requests,
        ray_actor_options={"num_cpus": config.tokenizer_num_cpus},
    ).bind(config.models)
    models = {}
    for m in config.models:
        models[m.name] = ModelServerDeployment.options(
            name=f"ModelServer:{m.name}",
            num_replicas=m.num_replicas,
            max_ongoing_requests=m.max_ongoing_requests,
            max_queued_requests=m.max_queued_requests,
            ray_actor_options={"num_cpus": m.num_cpus, "num_gpus": m.num_gpus},
        ).bind(m)
    embedder = None
    if config.embeddings.enabled:
        embedder = EmbedderDeployment.options(
            max_ongoing_requests=config.embeddings.max_ongoing_requests,
            ray_actor_options={"num_cpus": config.embeddings.num_cpus},
        ).bind(config.embeddings)
    return (
        make_ingress(config)
        .options(
            num_replicas=config.ingress_replicas,
            max_ongoing_requests=config.ingress_max_ongoing_requests,
            ray_actor_options={"num_cpus": config.ingress_num_cpus},
        )
        .bind(tokenizer, models, embedder)
    )


def build_default_app() -> Application:
    """`serve run app:graph`: config from $SHOAL_CONFIG, else the defaults."""
    return build_app(AppConfig.from_env())


def app_builder(args: dict[str, Any]) -> Application:
    """`serve run app.builder:app_builder key=value` / serveConfigV2 `args`."""
    return build_app(AppConfig.from_args(args))
