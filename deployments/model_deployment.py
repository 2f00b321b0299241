"""One model's replicas as a Serve deployment: its name, replica count, resources (a
placement group per replica under tensor parallelism) and request router. Used by
build_app for the configured models and by the operator for models started at run time."""

import hashlib
import re
from typing import Any

from ray.serve import Application, Deployment
from ray.serve.config import RequestRouterConfig

from deployments.affinity_router import AffinityRouter
from deployments.config import ModelDeploymentConfig


def serve_name(name: str) -> str:
    """A model's name as Serve may name a deployment or application ('/' is not allowed);
    a name that had to change gets its hash, so 'a/b' and 'a-b' stay apart."""
    safe = re.sub(r"[^A-Za-z0-9._:-]", "-", name)
    if safe == name:
        return name
    return f"{safe}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def model_deployment_name(name: str) -> str:
    return f"ModelServer:{serve_name(name)}"


def model_deployment(
    m: ModelDeploymentConfig, registry: Any, server: Deployment | None = None
) -> Application:
    """One model's replicas; `registry` is the EngineRegistry (bound, or a handle to it
    when the model is started at run time by the operator). `server`: the deployment the
    replicas run, ModelServer unless a benchmark gives its own."""
    if server is None:  # imported here: the engine's side, which the operator never loads
        from deployments.model_server import ModelServerDeployment

        server = ModelServerDeployment
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
                "move_wait_s": m.graceful_shutdown_timeout_s,
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
