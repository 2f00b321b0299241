"""Anthropic's Messages API: POST /v1/messages (whole, or streamed as Anthropic's
events) and POST /v1/messages/count_tokens. Errors under /v1/messages come back in
Anthropic's shape, {"type": "error", "error": {"type", "message"}}; the key may come as
`x-api-key` (the request guard reads it).

The conversation goes through the model's chat template like an OpenAI chat, tools
through the same call grammar and parser: `tool_choice` any is OpenAI's required, tool
is a named function. A last assistant message is a prefill the reply continues. A
reasoning model's thinking comes first, as a thinking block (signed with an empty
signature: there is nothing to verify it against here), then the answer's blocks.
"""

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter

from app.protocol.errors import ShoalError
from app.protocol.sampling import Constraint, SamplingParams
from app.text.tool_calls import ToolFormat
from app.text.tool_stream import CallFragment, ToolCallStream, whole_output
from deployments.api.anthropic.schema import CountTokensRequest, MessagesRequest
from deployments.http.chat_turn import ChatTurn, start
from deployments.http.errors import error_shape
from deployments.http.generation import Generation, OutputState
from deployments.http.streaming import stream, typed_sse
from deployments.ingress import Ingress, IngressDep, RequestTag

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


@error_shape("/v1/messages")
def anthropic_error(exc: ShoalError) -> dict:
    kind = _TYPES.get(exc.status_code, "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


WIRE = typed_sse(anthropic_error)

router = APIRouter()


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, ingress: IngressDep) -> dict:
    """The prompt tokens the same request to /v1/messages would feed the model."""
    # Only the rendering: the output's constraint (a tools grammar to build) counts nothing.
    turn = _turn(ingress, req, SamplingParams())
    args = turn.template_args
    ids, _ = await ingress.encode_chat_with_images(
        turn.model, turn.messages, turn.tools, turn.ending, args
    )
    return {"input_tokens": len(ids)}


@router.post("/v1/messages")
async def messages(req: MessagesRequest, ingress: IngressDep, tag: RequestTag):  # noqa: ANN201
    turn = _turn(ingress, req, req.params(), req.output_constraint(), req.stop_strings)
    gen, prepared = await start(ingress, turn, tag)
    fmt, name = prepared.tool_format, turn.model
    head = {
        "id": f"msg_{gen.request_id}",
        "type": "message",
        "role": "assistant",
        "model": name,
    }
    if req.stream:
        return stream(gen, _events(gen, head, fmt), WIRE)
    await gen.drain()
    out = gen.outputs[0]
    content, has_calls = _content(out, fmt)
    reason, sequence = _stop(out, has_calls)
    return {
        **head,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {**_input_usage(gen), "output_tokens": out.num_tokens},
    }


def _turn(
    ingress: Ingress,
    req: CountTokensRequest,
    params: SamplingParams,
    constraint: Constraint | None = None,
    stop_strings: list[str] | None = None,
) -> ChatTurn:
    return ChatTurn(
        ingress.served_name(req.model),
        req.template_messages(),
        params,
        constraint,
        **req.tool_fields().turn_tools(),
        template_args=req.template_args(),
        ending=req.prompt_ending,
        stop_strings=stop_strings or [],
    )


def _input_usage(gen: Generation) -> dict[str, int]:
    """Anthropic counts cached prompt tokens apart from the rest."""
    return {
        "input_tokens": len(gen.prompt_ids) - gen.cached_tokens,
        "cache_read_input_tokens": gen.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _content(out: OutputState, fmt: ToolFormat | None) -> tuple[list[dict], bool]:
    blocks: list[dict[str, Any]] = []
    if out.reasoned:
        blocks.append({"type": "thinking", "thinking": out.thinking, "signature": ""})
    text, calls = (out.text, []) if fmt is None else whole_output(fmt, out.text)
    if text or not (calls or blocks):  # cut off while thinking: no answer block, as streamed
        blocks.append({"type": "text", "text": text or ""})
    for call_id, call in calls:
        try:
            arguments = json.loads(call.arguments or "{}")
        except json.JSONDecodeError:
            arguments = {}  # cut off mid-call (max_tokens): Anthropic's input is an object
        blocks.append(
            {"type": "tool_use", "id": _tool_id(call_id), "name": call.name, "input": arguments}
        )
    return blocks, bool(calls)


def _stop(out: OutputState, has_calls: bool) -> tuple[str, str | None]:
    """stop_reason and stop_sequence."""
    if out.stops.stopped:
        return "stop_sequence", out.stops.matched
    if out.finish_reason == "length":
        return "max_tokens", None
    return ("tool_use" if has_calls else "end_turn"), None


class _Blocks:
    """The content blocks of a stream: a thinking block opened by the first thinking, a
    text block by the first text, a tool_use block by each call's first fragment;
    opening one closes the one before (a thinking block with its signature)."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # "text" or a call's id

    def start(self, key: str, block: dict) -> list[dict]:
        events = self.stop()
        self.open = key
        events.append({"type": "content_block_start", "index": self.count, "content_block": block})
        if self.count == 0:  # Anthropic's streams ping once, after the first block opens
            events.append({"type": "ping"})
        return events

    def stop(self) -> list[dict]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(self.delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        self.count += 1
        return [*events, {"type": "content_block_stop", "index": self.count - 1}]

    def delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.count, "delta": delta}


async def _events(gen: Generation, head: dict, fmt: ToolFormat | None) -> AsyncIterator[dict]:
    usage = {**_input_usage(gen), "output_tokens": 0}
    message = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    yield {"type": "message_start", "message": message}
    blocks = _Blocks()
    calls = ToolCallStream(fmt) if fmt is not None else None
    out = gen.outputs[0]
    async for d in gen.deltas():
        if d.thinking:
            if blocks.open != "thinking":
                block = {"type": "thinking", "thinking": "", "signature": ""}
                for event in blocks.start("thinking", block):
                    yield event
            yield blocks.delta({"type": "thinking_delta", "thinking": d.thinking})
        text, fragments = d.text, []
        if calls is not None:
            text, fragments = calls.feed(d.text, final=d.finish_reason is not None)
        if text:
            if blocks.open != "text":
                for event in blocks.start("text", {"type": "text", "text": ""}):
                    yield event
            yield blocks.delta({"type": "text_delta", "text": text})
        for fragment in fragments:
            for event in _call_events(blocks, fragment):
                yield event
    if blocks.count == 0 and blocks.open is None:  # an empty reply is one empty text block
        for event in blocks.start("text", {"type": "text", "text": ""}):
            yield event
    for event in blocks.stop():
        yield event
    reason, sequence = _stop(out, calls is not None and calls.has_calls)
    yield {
        "type": "message_delta",
        "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": {"output_tokens": out.num_tokens},
    }
    yield {"type": "message_stop"}


def _call_events(blocks: _Blocks, fragment: CallFragment) -> list[dict]:
    events = []
    if fragment.id is not None:
        block = {
            "type": "tool_use",
            "id": _tool_id(fragment.id),
            "name": fragment.name,
            "input": {},
        }
        events += blocks.start(fragment.id, block)
    if fragment.arguments:
        events.append(
            blocks.delta({"type": "input_json_delta", "partial_json": fragment.arguments})
        )
    return events
