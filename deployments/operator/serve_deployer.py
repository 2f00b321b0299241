"""The operator's Deployer on Serve: each alias is an application of its own, named after
the Shoal app that started it, with no HTTP route (the ingress reaches it by handle).

Every call returns at once: a deploy hands the application to Serve's controller without
waiting for its replicas (an alias Serve cannot place would wait for ever, holding a
thread), and the operator polls `state` instead.
"""

import logging
import threading
import time
from typing import Any

import ray
from ray import serve

from deployments.config import ModelDeploymentConfig
from deployments.model_deployment import model_deployment

logger = logging.getLogger("ray.serve")
PICKLE_RETRIES = 5
# Every starting alias polls its state, each on its own clock: one status call to the
# controller answers all of them for this long (each alias called it twice a
# second, which queued a stop's own calls behind theirs on a busy machine).
STATUS_FRESH_S = 0.25


def app_suffix(alias: str) -> str:
    """An alias as a Serve application's name may spell it ('/' is not allowed), one to
    one: '_' is the escape ('_' -> '__', '/' -> '_s'), so 'x/y' and any other alias (the
    hashed 'x-y-<sha1[:8]>' that serve_name makes of it, say) never share an app."""
    return alias.replace("_", "__").replace("/", "_s")


class ServeDeployer:
    def __init__(self, app_name: str, registry: Any) -> None:
        self.app_name = app_name
        self.registry = registry  # the EngineRegistry's handle: the alias reports there too
        # Serve's deploy is not thread-safe: it registers modules for pickling by value
        # and unregisters them, process-wide (two at once: "not registered for pickle").
        self._deploying = threading.Lock()
        self._status_lock = threading.Lock()
        self._status: tuple[float, dict[str, Any]] = (0.0, {})

    def app_for(self, alias: str) -> str:
        return f"{self.app_name}--{app_suffix(alias)}"

    def deploy(self, config: ModelDeploymentConfig) -> None:
        """Hands the alias's application to Serve and returns once Serve has it (not once
        its replicas run: `state` tells)."""
        for attempt in range(PICKLE_RETRIES):
            try:
                with self._deploying:  # the deployment's options pickle its router too
                    target = serve.RunTarget(
                        model_deployment(config, self.registry),
                        name=self.app_for(config.name),
                        route_prefix=None,
                    )
                    serve.run_many([target], wait_for_applications_running=False)
                return
            except ValueError as exc:
                # Serve's pickling by value raced another thread of this process that
                # this lock does not cover; nothing was deployed: try again.
                if "pickle by value" not in str(exc) or attempt == PICKLE_RETRIES - 1:
                    raise
                logger.warning("deploying %s: %r; again", config.name, exc)
                time.sleep(0.2 * (attempt + 1))

    def remove(self, alias: str) -> None:
        """Asks Serve to delete the alias's application; returns before it is gone."""
        serve.delete(self.app_for(alias), _blocking=False)
        with self._status_lock:  # the next state reads Serve again (DELETING, or gone)
            self._status = (0.0, {})

    def state(self, alias: str) -> tuple[str, str]:
        """(Serve's status of the alias's application, its message); ("", "") when there
        is none."""
        app = self._applications().get(self.app_for(alias))
        status = "" if app is None else getattr(app.status, "value", str(app.status))
        if status in ("", "NOT_STARTED"):
            return "", ""
        return status, app.message or ""

    def _applications(self) -> dict[str, Any]:
        """Serve's applications, as one status call made at most STATUS_FRESH_S ago."""
        with self._status_lock:  # the callers waiting here share the call under way
            taken, apps = self._status
            if time.monotonic() - taken > STATUS_FRESH_S:
                apps = dict(serve.status().applications)
                self._status = (time.monotonic(), apps)
            return apps

    def is_running(self, alias: str) -> bool:
        return self.state(alias)[0] == "RUNNING"

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
