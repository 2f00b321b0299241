"""Ready means ready: /v1/models lists a model only when /health says it is served (both
read the replicas' registrations), and an engine is built with its grammar vocabulary
loaded, so that the first constrained request does not wait for it."""

import contextlib
from collections.abc import Iterator

from app.engine.async_engine import AsyncEngine
from app.engine.grammar import GrammarBackend
from deployments.config import AppConfig
from deployments.http.app import create_app
from deployments.ingress import Ingress
from deployments.model_server import ModelServer
from deployments.registry import EngineRegistry
from deployments.tokenizer import Tokenizer
from tests.local_app import MODEL, LocalHandle, http_client, run


@contextlib.contextmanager
def app_with_registry(engine, registry: EngineRegistry) -> Iterator:  # noqa: ANN001
    """The real app over `engine`, with `registry` as the replicas' registry (a replica
    registers and heartbeats there once its constructor returned)."""
    config = AppConfig.model_validate({"embeddings": {"enabled": False}, "models": [{}]})
    client = AsyncEngine(engine)
    try:
        server = ModelServer(config.models[0], engine=client)
        ingress = Ingress(
            config,
            LocalHandle(Tokenizer(config.models)),
            {MODEL: LocalHandle(server)},
            registry=LocalHandle(registry),
        )
        yield create_app(ingress)
    finally:
        client.shutdown()


def test_models_list_and_health_agree_while_a_model_loads(smollm2_engine):
    registry = EngineRegistry()

    async def views(app) -> tuple[int, list[str]]:  # noqa: ANN001
        async with http_client(app) as http:
            health = await http.get("/health")
            listed = (await http.get("/v1/models")).json()
        assert [m["name"] for m in listed["models"]] == [m["id"] for m in listed["data"]]
        return health.status_code, [m["id"] for m in listed["data"]]

    with app_with_registry(smollm2_engine, registry) as app:
        # The replica is still in its constructor: not registered yet.
        assert run(views(app)) == (503, [])
        registry.register("replica-1", MODEL, {})
        registry.heartbeat("replica-1", {"num_running": 0, "num_waiting": 0})
        assert run(views(app)) == (200, [MODEL])


def test_an_engine_is_built_with_its_grammar_vocabulary_loaded(smollm2_engine):
    grammar = smollm2_engine.grammar
    assert grammar is not None and grammar.vocabulary_loaded()
    # A backend of its own (the vocabulary is read once per process): loaded when built.
    arch = smollm2_engine.arch
    fresh = GrammarBackend(smollm2_engine.source, arch.vocab_size, arch.eos_token_ids)
    try:
        assert fresh.vocabulary_loaded()
    finally:
        fresh.close()
