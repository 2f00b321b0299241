"""build_app: the only place where deployments are bound into a Serve application."""

from typing import Any

from ray.serve import Application

from app.config import AppConfig, ModelDeploymentConfig


def build_app(config: AppConfig) -> Application:
    from ray.serve.config import RequestRouterConfig

    from deployments.context_router import ContextAffinityRouter
    from deployments.embeddings import EmbedderDeployment
    from deployments.ingress import make_ingress
    from deployments.model_server import ModelServerDeployment
    from deployments.registry import RegistryDeployment
    from deployments.tokenizer import TokenizerDeployment

    registry = RegistryDeployment.options(
        ray_actor_options={"num_cpus": config.tokenizer_num_cpus / 4}
    ).bind()
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
            request_router_config=RequestRouterConfig(request_router_class=ContextAffinityRouter),
            **replica_resources(m),
        ).bind(m, registry)
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
        .bind(tokenizer, models, embedder, registry)
    )


def replica_resources(m: ModelDeploymentConfig) -> dict[str, Any]:
    """A replica's resources. With N tensor-parallel shards it asks for a placement group of
    N bundles, one per shard, on one node (STRICT_PACK): the replica itself and its engine
    (rank 0) in bundle 0, a ShardActor in each of the others. `num_cpus` and `num_gpus` are
    the whole replica's, split evenly over the bundles."""
    size = m.engine.tensor_parallel_size
    shard = {"num_cpus": m.num_cpus / size, "num_gpus": m.num_gpus / size}
    if size == 1:
        return {"ray_actor_options": shard}
    bundle = {"CPU": shard["num_cpus"]}
    if m.num_gpus:
        bundle["GPU"] = shard["num_gpus"]
    return {
        "ray_actor_options": shard,
        "placement_group_bundles": [dict(bundle) for _ in range(size)],
        "placement_group_strategy": "STRICT_PACK",
    }


def build_default_app() -> Application:
    """`serve run app:graph`: config from $SHOAL_CONFIG, else the defaults."""
    return build_app(AppConfig.from_env())


def app_builder(args: dict[str, Any]) -> Application:
    """`serve run app.builder:app_builder key=value` / serveConfigV2 `args`."""
    return build_app(AppConfig.from_args(args))
