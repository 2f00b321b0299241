"""The FastAPI app over an Ingress, and the Serve deployment that runs it.

`create_app(ingress)` is all there is to the HTTP side: every dialect's router, the one
error mapper, the request guard (keys, body limits, deadline), the client's identity
(deployments/http/client_scope.py) and CORS. Tests build it over an Ingress of local
deployments; in Serve each ingress replica builds its own at start-up
(`__serve_build_asgi_app__`), so the routes reach the replica through the app's state
and never through a module global.
"""

import importlib
import logging
import pkgutil
from typing import Any

from fastapi import FastAPI, Response
from fastapi.middleware.cors import CORSMiddleware
from ray import serve

from deployments import api
from deployments.config import AppConfig
from deployments.http.client_scope import ClientScope
from deployments.http.errors import install_error_handlers
from deployments.http.guard import RequestGuard
from deployments.ingress import Ingress, IngressDep

logger = logging.getLogger("ray.serve")


def create_app(ingress: Ingress) -> FastAPI:
    app = FastAPI(title="Shoal", docs_url=None, redoc_url=None)
    app.state.ingress = ingress
    for dialect in dialects():
        app.include_router(dialect.router)
        install = getattr(dialect, "install", None)
        if install is not None:  # a dialect with state of its own makes it here
            install(app, ingress)
    app.add_api_route("/metrics", metrics, methods=["GET"])
    install_error_handlers(app)

    def observe(scope: dict, status: int, seconds: float) -> None:
        # Labelled by route template, never by raw path (cardinality).
        label = getattr(scope.get("route"), "path", "unmatched")
        ingress.metrics.requests.labels(label, str(status)).inc()
        # Serve's proxy returns the same id as X-Request-Id on every response.
        headers = dict(scope.get("headers", ()))
        logger.info(
            "%s %s %s %d %.1fms",
            headers.get(b"x-request-id", b"-").decode("latin-1"),
            scope.get("method"),
            scope.get("path"),
            status,
            1000 * seconds,
        )

    app.add_middleware(ClientScope)  # inside the guard, which finds the caller
    app.add_middleware(
        RequestGuard, config=ingress.config, observe=observe, admission=ingress.admission
    )
    if ingress.config.cors_origins:  # outermost: preflights and 401s carry CORS headers
        app.add_middleware(
            CORSMiddleware,
            allow_origins=ingress.config.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app


def dialects() -> list:
    """Every module with a `router` in each dialect's folder (deployments/api/<dialect>),
    dialects and their modules in name order (unless a
    dialect's ROUTE_MODULES says otherwise): each registers its error shape, if it is
    not OpenAI's, and makes its own state in `install(app, ingress)`, if it has any; so a
    new dialect is one new folder there."""
    modules = []
    for package in sorted(m.name for m in pkgutil.iter_modules(api.__path__) if m.ispkg):
        folder = importlib.import_module(f"{api.__name__}.{package}")
        names = getattr(folder, "ROUTE_MODULES", None)  # where the order of matching matters
        for name in names or sorted(m.name for m in pkgutil.iter_modules(folder.__path__)):
            module = importlib.import_module(f"{folder.__name__}.{name}")
            if hasattr(module, "router"):
                modules.append(module)
    return modules


async def metrics(ingress: IngressDep) -> Response:
    """Prometheus text: this ingress's request figures and every live replica's."""
    ingress.metrics.set_replicas(await ingress.engines())
    return Response(ingress.metrics.render(), media_type="text/plain; version=0.0.4")


@serve.ingress()
class ServeIngress(Ingress):
    def __init__(
        self,
        config: AppConfig,
        tokenizer: Any,
        models: dict[str, Any],
        embedder: Any,
        registry: Any = None,
        operator: Any = None,
    ) -> None:
        super().__init__(config, tokenizer, models, embedder, registry, operator)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self)


IngressDeployment = serve.deployment(ServeIngress, name="Ingress")
