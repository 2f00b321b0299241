"""The one way a Generation becomes a streamed HTTP response, in any dialect.

A dialect gives its `Wire` (how a chunk and an error are written, what ends the stream)
and an iterator of its chunks; `stream` does the rest: frames each chunk, turns a
failure mid-stream (a ShoalError) into the dialect's error event, and cancels the
generation however the response ends.

The response itself cancels the generation too: an iterator that never started has
nothing to run, so a client that leaves between the route's return and the first byte
would otherwise leave its request generating for no one (cancelling a finished one is
a no-op).
"""

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from app.protocol.errors import ShoalError
from deployments.http.generation import Generation

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class Wire:
    """How one dialect frames a stream."""

    media_type: str
    frame: Callable[[dict], str]
    error: Callable[[ShoalError], dict]
    end: str = ""  # written after the last chunk, also after an error
    headers: dict[str, str] | None = None


def sse(error: Callable[[ShoalError], dict], end: str = "") -> Wire:
    """Server-sent events: `data: {json}` per chunk."""
    return Wire(
        "text/event-stream", lambda c: f"data: {json.dumps(c)}\n\n", error, end, SSE_HEADERS
    )


def typed_sse(error: Callable[[ShoalError], dict]) -> Wire:
    """Server-sent events named by each chunk's `type` (`event: {type}` then its data), as
    OpenAI's Responses API and Anthropic's Messages API stream."""

    def frame(chunk: dict) -> str:
        return f"event: {chunk.get('type', 'message')}\ndata: {json.dumps(chunk)}\n\n"

    return Wire("text/event-stream", frame, error, "", SSE_HEADERS)


def ndjson(error: Callable[[ShoalError], dict]) -> Wire:
    """One JSON object per line."""
    return Wire("application/x-ndjson", lambda c: json.dumps(c) + "\n", error)


class GenerationStream(StreamingResponse):
    def __init__(self, body: AsyncIterator[str], generation: Generation, wire: Wire) -> None:
        super().__init__(body, media_type=wire.media_type, headers=wire.headers)
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 (ASGI)
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.cancel()


def stream(generation: Generation, chunks: AsyncIterator[dict], wire: Wire) -> GenerationStream:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield wire.frame(chunk)
        except ShoalError as exc:
            yield wire.frame(wire.error(exc))
        finally:
            generation.cancel()
        if wire.end:
            yield wire.end

    return GenerationStream(body(), generation, wire)
