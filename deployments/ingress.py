"""Ingress: the FastAPI app. Validates, routes by `model`, formats; no model work here."""

import logging
import time
from typing import Any

from fastapi import FastAPI, Response
from fastapi.middleware.cors import CORSMiddleware
from ray import serve

from deployments.config import AppConfig
from app.models.source import resolve_model
from app.models.tokenizer import load_tokenizer
from app.protocol.errors import ShoalError
from deployments.errors import install_error_handlers
from deployments.metrics import IngressMetrics
from deployments.request_guard import RequestGuard
from deployments.routes.llamacpp import build_router as build_llamacpp_router
from deployments.routes.ollama import build_router as build_ollama_router
from deployments.routes.openai import build_router
from deployments.routes.parrot import build_router as build_parrot_router

logger = logging.getLogger("ray.serve")


class UnknownModelError(ShoalError):
    status_code = 404
    error_type = "not_found_error"


def create_app(config: AppConfig, get_ingress: Any) -> FastAPI:
    app = FastAPI(title="Shoal", docs_url=None, redoc_url=None)
    app.include_router(build_router(get_ingress))
    app.include_router(build_parrot_router(get_ingress))
    app.include_router(build_llamacpp_router(get_ingress))
    app.include_router(build_ollama_router(get_ingress))
    install_error_handlers(app)

    def observe(scope: dict, status: int, seconds: float) -> None:
        ingress = get_ingress_or_none()
        if ingress is not None:  # label by route template, never by raw path (cardinality)
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

    app.add_middleware(RequestGuard, config=config, observe=observe)
    if config.cors_origins:  # outermost: preflights and 401s carry CORS headers
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        ingress = get_ingress()
        await ingress.refresh_replica_stats()
        return Response(ingress.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


class Ingress:
    def __init__(
        self,
        config: AppConfig,
        tokenizer: Any,
        models: dict[str, Any],
        embedder: Any,
        registry: Any = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.tokenizer = tokenizer
        # Configured once and cached: per-request .options() is slow.
        self.models = {name: h.options(stream=True) for name, h in models.items()}
        self.embedder = embedder
        self.tokenizers = {
            m.name: load_tokenizer(resolve_model(m.engine.model)) for m in config.models
        }
        self.created = int(time.time())
        self.metrics = IngressMetrics()
        self.model_calls = models  # plain (unary) handles: stats, contexts

    async def refresh_replica_stats(self) -> dict[str, dict]:
        """A replica's stats per model (one replica each: the handle picks it)."""
        fresh = {}
        for name, handle in self.model_calls.items():
            try:
                stats = await handle.stats.remote()
            except Exception:  # a replica being replaced: report what we have
                continue
            self.metrics.set_replica_stats(name, str(stats.get("replica", "0")), stats)
            fresh[name] = stats
        return fresh

    def default_model(self, name: str | None) -> str:
        """`name` when it is served; the first configured model when None."""
        if name is None:
            return self.config.models[0].name
        self.require_model(name)
        return name

    def require_model(self, name: str) -> None:
        if name not in self.models:
            raise UnknownModelError(f"The model '{name}' does not exist", param="model")

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "shoal"}


_replica: list[Ingress] = []  # this process's ingress replica (one per Ray actor)


def current_ingress() -> Ingress:
    return _replica[0]


def get_ingress_or_none() -> Ingress | None:
    return _replica[0] if _replica else None


def register_replica(ingress: Ingress) -> None:
    _replica[:] = [ingress]


def make_ingress(config: AppConfig):  # noqa: ANN201 (a Serve deployment class)
    # Module-level functions travel to the replica by reference, so the routes and the
    # replica meet in that process's copy of this module.
    app = create_app(config, current_ingress)

    @serve.ingress(app)
    class ShoalIngress(Ingress):
        def __init__(
            self, tokenizer: Any, models: dict[str, Any], embedder: Any, registry: Any = None
        ) -> None:
            super().__init__(config, tokenizer, models, embedder, registry)
            register_replica(self)

    return serve.deployment(ShoalIngress, name="Ingress")
