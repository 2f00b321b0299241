"""How a generation becomes Ollama's reply: one object, or an NDJSON stream of them, the
text in `response` (/api/generate) or `message.content` (/api/chat), a reasoning model's
thinking apart in `thinking` / `message.thinking` (only where there is some, as Ollama
omits it), tool calls read out of the answer and sent whole, each in the chunk where it
completes. The route gives `piece` (text, thinking, calls -> its chunk) and `final`
(the last object's figures)."""

import json
from collections.abc import AsyncIterator, Callable

from app.text.tool_calls import ParsedCall, ToolFormat
from app.text.tool_stream import ToolCallStream, whole_output
from deployments.http.generation import Generation
from deployments.http.streaming import Wire, stream

Piece = Callable[[str, str, list | None], dict]


async def respond(  # noqa: ANN201
    gen: Generation,
    streamed: bool,
    fmt: ToolFormat | None,
    piece: Piece,
    final: Callable[[], dict],
    wire: Wire,
):
    if not streamed:
        await gen.drain()
        out = gen.outputs[0]
        content, calls = out.text, []
        if fmt is not None:
            content, calls = whole_output(fmt, out.text)
        whole = piece(content or "", out.thinking, [ollama_call(c) for _, c in calls])
        # The text goes in the final object, with the figures.
        return {
            **final(),
            **{k: whole[k] for k in ("response", "message", "thinking") if k in whole},
        }
    return stream(gen, _chunks(gen, fmt, piece, final), wire)


async def _chunks(
    gen: Generation, fmt: ToolFormat | None, piece: Piece, final: Callable[[], dict]
) -> AsyncIterator[dict]:
    calls, sent = (ToolCallStream(fmt) if fmt is not None else None), 0
    async for d in gen.deltas():
        content, done = d.text, []
        if calls is not None:
            content, _ = calls.feed(d.text, final=d.finish_reason is not None)
            done = calls.complete_calls()
        if content or d.thinking or len(done) > sent:
            yield piece(content, d.thinking, [ollama_call(c) for _, c in done[sent:]])
            sent = len(done)
    yield final()


def ollama_call(call: ParsedCall) -> dict:
    try:
        arguments = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        arguments = {}  # cut off mid-call (num_predict): Ollama's arguments are an object
    return {"function": {"name": call.name, "arguments": arguments}}
