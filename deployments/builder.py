"""build_app: the only place where deployments are bound into a Serve application."""

from ray.serve import Application, Deployment

from deployments.config import AppArgs, AppConfig
from deployments.embeddings import EmbedderDeployment
from deployments.http.app import IngressDeployment
from deployments.model_deployment import model_deployment
from deployments.model_server import ModelServerDeployment
from deployments.operator.operator import OperatorDeployment
from deployments.quiet_ray import quiet_ray_defaults
from deployments.registry import RegistryDeployment
from deployments.serve_cli import drain_on_sigterm
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
    ).bind(
        config.models, config.trust_request_chat_template, config.template_sandbox, config.images
    )
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


def graph(args: AppArgs) -> Application:
    """`serve run app:graph [key=value ...]`, or `import_path: app:graph` with `args` in a
    Serve config file (KubeRay's serveConfigV2). Serve validates the args into AppArgs
    (the annotation tells it to); with none, the config is $SHOAL_CONFIG's or the defaults.
    `serve run` calls it before it starts Ray: the Ray it starts gets quieter timers,
    and SIGTERM (docker stop, systemd) drains the app as Ctrl-C does (serve_cli.py)."""
    quiet_ray_defaults()
    drain_on_sigterm()
    return build_app(args.resolve())
