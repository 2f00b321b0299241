"""The operator's Deployer on Serve: each alias is an application of its own, named after
the Shoal app that started it, with no HTTP route (the ingress reaches it by handle)."""

import logging
from typing import Any

import ray
from ray import serve

from deployments.config import ModelDeploymentConfig
from deployments.model_deployment import model_deployment, serve_name

logger = logging.getLogger("ray.serve")


class ServeDeployer:
    def __init__(self, app_name: str, registry: Any) -> None:
        self.app_name = app_name
        self.registry = registry  # the EngineRegistry's handle: the alias reports there too

    def app_for(self, alias: str) -> str:
        return f"{self.app_name}--{serve_name(alias)}"

    def deploy(self, config: ModelDeploymentConfig) -> None:
        """Returns once the alias's replicas are running; raises if Serve gives up."""
        serve.run(
            model_deployment(config, self.registry),
            name=self.app_for(config.name),
            route_prefix=None,
        )

    def remove(self, alias: str) -> None:
        serve.delete(self.app_for(alias))

    def is_running(self, alias: str) -> bool:
        app = serve.status().applications.get(self.app_for(alias))
        return app is not None and app.status == "RUNNING"

    def teardown(self, apps: list[str], own: str) -> None:
        """Delete `apps` and this app from outside them (the caller is one of their
        replicas), then Serve itself if nothing else runs on it. Returns at once."""
        Teardown.options(lifetime="detached", num_cpus=0).remote().run.remote(apps, own)


@ray.remote(num_cpus=0)
class Teardown:
    """Deletes the applications from outside them (the operator is one of their replicas),
    then leaves."""

    def run(self, apps: list[str], own: str) -> None:
        for app in [*apps, own]:
            try:
                serve.delete(app)
            except Exception as exc:
                logger.warning("teardown: deleting %s failed: %r", app, exc)
        if not serve.status().applications:
            serve.shutdown()
        ray.actor.exit_actor()
