"""build_app: the only place where deployments are bound into a Serve application."""

from typing import Any

from ray.serve import Application, Deployment
from ray.serve.config import RequestRouterConfig

from deployments.affinity_router import AffinityRouter
from deployments.config import AppArgs, AppConfig, ModelDeploymentConfig
from deployments.embeddings import EmbedderDeployment
from deployments.ingress_app import IngressDeployment
from deployments.model_server import ModelServerDeployment
from deployments.operator.operator import OperatorDeployment
from deployments.operator.serve_deployer import model_deployment_name
from deployments.registry import RegistryDeployment
from deployments.tokenizer import TokenizerDeployment


def build_app(config: AppConfig, model_server: Deployment = ModelServerDeployment) -> Application:
    """The application `config` describes. `model_server`: the deployment each model's
    replicas run; benchmarks give a ModelServer subclass over a stub engine
    (bench/stub_engine.py), `graph` never does."""
    registry = RegistryDeployment.options(
        ray_actor_options={"num_cpus": config.tokenizer_num_cpus / 4}
    ).bind()
    tokenizer = TokenizerDeployment.options(
        max_ongoing_requests=config.tokenizer_max_ongoing_requests,
        ray_actor_options={"num_cpus": config.tokenizer_num_cpus},
    ).bind(config.models)
    models = {m.name: model_deployment(m, registry, model_server) for m in config.models}
    embedder = None
    if config.embeddings.enabled:
        embedder = EmbedderDeployment.options(
            max_ongoing_requests=config.embeddings.max_ongoing_requests,
            ray_actor_options={"num_cpus": config.embeddings.num_cpus},
        ).bind(config.embeddings)
    operator = None
    if config.operator.enabled:
        operator = OperatorDeployment.options(
            # Each ingress replica holds a long poll here; every call only awaits I/O.
            max_ongoing_requests=1000,
            ray_actor_options={"num_cpus": config.tokenizer_num_cpus / 4},
        ).bind(config, registry)
    return IngressDeployment.options(
        num_replicas=config.ingress_replicas,
        max_ongoing_requests=config.ingress_max_ongoing_requests,
        # Streams pass through the ingress: a stopping ingress gives them as long as the
        # slowest model's replicas give theirs.
        graceful_shutdown_timeout_s=5 + max(m.graceful_shutdown_timeout_s for m in config.models),
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
    ).bind(config, tokenizer, models, embedder, registry, operator)


def model_deployment(
    m: ModelDeploymentConfig, registry: Any, server: Deployment = ModelServerDeployment
) -> Application:
    """One model's replicas; `registry` is the EngineRegistry (bound, or a handle to it
    when the model is started at run time by the operator)."""
    return server.options(
        name=model_deployment_name(m.name),
        **replica_count(m),
        max_ongoing_requests=m.max_ongoing_requests,
        max_queued_requests=m.max_queued_requests,
        graceful_shutdown_timeout_s=m.graceful_shutdown_timeout_s,
        # A drained replica exits within half a second rather than Serve's 2 s loop.
        graceful_shutdown_wait_loop_s=0.5,
        request_router_config=RequestRouterConfig(
            request_router_class=AffinityRouter,
            request_router_kwargs={
                "routing": m.routing.model_dump(),
                "block_size": m.engine.block_size,
            },
        ),
        **replica_resources(m),
    ).bind(m, registry)


def replica_count(m: ModelDeploymentConfig) -> dict[str, Any]:
    if m.autoscaling is None:
        return {"num_replicas": m.num_replicas}
    a = m.autoscaling
    return {
        "autoscaling_config": {
            "min_replicas": a.min_replicas,
            "initial_replicas": max(a.min_replicas, 1),
            "max_replicas": a.max_replicas,
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
            "look_back_period_s": a.look_back_period_s,
        },
    }


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


def graph(args: AppArgs) -> Application:
    """`serve run app:graph [key=value ...]`, or `import_path: app:graph` with `args` in a
    Serve config file (KubeRay's serveConfigV2). Serve validates the args into AppArgs
    (the annotation tells it to); with none, the config is $SHOAL_CONFIG's or the defaults."""
    return build_app(args.resolve())
