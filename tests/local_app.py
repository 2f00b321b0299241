"""The real ingress app over local deployments, without Ray: the routes, the Ingress, the
Tokenizer, a ModelServer over an AsyncEngine (the real engine, stepped in a thread) and
the Embedder, each called in this process through `LocalHandle`, which has the call
surface of a Serve handle (`handle.method.remote(...)`, `.options(stream=True)`,
`cancel()`). What needs Serve itself (routing, replicas, the proxy) is tested live in
tests/serve."""

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
from fastapi import FastAPI

from app.engine import LLMEngine
from app.engine.async_engine import AsyncEngine
from deployments.config import AppConfig
from deployments.http.app import create_app
from deployments.ingress import Ingress
from deployments.model_server import ModelServer
from deployments.tokenizer import Tokenizer

MODEL = "smollm2-135m-instruct"  # the default model's served name


def run(coro: Any) -> Any:
    """Run one test's scenario on a fresh event loop."""
    return asyncio.run(coro)


class LocalStream:
    """A streaming call's results, from an async generator in this process."""

    def __init__(self, agen: AsyncIterator) -> None:
        self._agen = agen
        self._closing: asyncio.Task | None = None

    def __aiter__(self) -> "LocalStream":
        return self

    async def __anext__(self) -> Any:
        return await self._agen.__anext__()

    def cancel(self) -> None:
        """Close the generator (its `finally` aborts the request in the engine); one in
        the middle of a step ends when its consumer is cancelled."""
        if self._closing is None and not self._agen.ag_running:
            self._closing = asyncio.get_running_loop().create_task(self._close())

    async def _close(self) -> None:
        with contextlib.suppress(RuntimeError):  # already running: its consumer ends it
            await self._agen.aclose()


class LocalHandle:
    def __init__(self, target: Any, stream: bool = False) -> None:
        self._target, self._stream = target, stream

    def options(self, stream: bool | None = None, multiplexed_model_id: str = "") -> "LocalHandle":
        return LocalHandle(self._target, self._stream if stream is None else stream)

    def __getattr__(self, method: str) -> Any:
        fn = getattr(self._target, method)
        handle = self

        class Method:
            @staticmethod
            def remote(*args: Any) -> Any:
                if handle._stream:
                    return LocalStream(fn(*args))
                return _call(fn, args)

        return Method


async def _call(fn: Any, args: tuple) -> Any:
    result = fn(*args)
    return await result if inspect.isawaitable(result) else result


@contextlib.contextmanager
def local_app(
    config: AppConfig, engine: LLMEngine, embedder: Any = None
) -> Iterator[tuple[FastAPI, ModelServer]]:
    """The app for `config`'s first model, served by `engine` (stepped in a thread while
    this lasts: nothing else may step it meanwhile), and `embedder`'s embedding model."""
    client = AsyncEngine(engine)
    model = config.models[0]
    server = ModelServer(model, engine=client)
    ingress = Ingress(
        config,
        LocalHandle(
            Tokenizer(
                config.models,
                config.trust_request_chat_template,
                config.template_sandbox,
                config.images,
            )
        ),
        {model.name: LocalHandle(server)},
        None if embedder is None else LocalHandle(embedder),
    )
    try:
        yield create_app(ingress), server
    finally:
        client.shutdown()


def http_client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")
