"""Ingress: the FastAPI app. Validates, routes by `model`, formats; no model work here."""

import hmac
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from ray import serve

from app.config import AppConfig
from app.models.source import resolve_model
from app.models.tokenizer import load_tokenizer
from app.protocol.errors import ShoalError
from deployments.errors import install_error_handlers, openai_error
from deployments.metrics import IngressMetrics
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
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    keys = [k.encode() for k in config.api_keys]

    @app.middleware("http")
    async def guard(request: Request, call_next):  # noqa: ANN001, ANN202
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        path, root = request.scope.get("path", ""), request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]  # relative to the app's route prefix
        if keys and path != "/health":
            auth = request.headers.get("authorization", "")
            token = auth[7:].encode() if auth.lower().startswith("bearer ") else b""
            if not any(hmac.compare_digest(token, k) for k in keys):
                return openai_error(401, "Invalid or missing API key", code="invalid_api_key")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_request_bytes:
            return openai_error(413, f"request body over {config.max_request_bytes} bytes")
        started = time.perf_counter()
        response = await call_next(request)
        ingress = get_ingress_or_none()
        if ingress is not None:  # label by route template, never by raw path (cardinality)
            label = getattr(request.scope.get("route"), "path", "unmatched")
            ingress.metrics.requests.labels(label, str(response.status_code)).inc()
        # Serve's proxy returns the same id as X-Request-Id on every response.
        logger.info(
            "%s %s %s %d %.1fms",
            request_id,
            request.method,
            request.url.path,
            response.status_code,
            1000 * (time.perf_counter() - started),
        )
        return response

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
