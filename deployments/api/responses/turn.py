"""A response being made (OpenAI's Responses API): its Response object, its stored
entry, and its output items (a reasoning model's thinking, assistant text and function
calls) built from the output."""

import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

from app.text.tool_calls import ToolFormat
from app.text.tool_stream import whole_output
from deployments.api.responses.conversation_store import Joined, append_turn
from deployments.api.responses.file_search import Searched
from deployments.api.responses.item_messages import assistant_message, output_new_items
from deployments.api.responses.schema import ResponsesRequest
from deployments.api.responses.store import Entry, ResponseStore
from deployments.http.generation import Generation, OutputState


@dataclass
class Turn:
    """One response being made: what its object and its stored entry are built from."""

    id: str
    model: str
    req: ResponsesRequest
    created_at: int
    chain: str
    prompt_tokens: int
    reused: int  # prompt tokens the chain's context already held
    new_messages: list[dict[str, Any]]
    fmt: ToolFormat | None
    owner: str | None = None  # the id of the key that asked
    conversation: Joined | None = None  # the conversation it continues and adds to
    searched: Searched | None = None  # what its file_search found

    def body(self, status: str, output: list[dict], gen: Generation | None) -> dict[str, Any]:
        req = self.req
        usage = None
        if gen is not None:
            out = gen.outputs[0].num_tokens
            reasoning = gen.outputs[0].reasoning_tokens
            # A context's held tokens count as cached in the engine's report too.
            cached = max(self.reused, gen.cached_tokens)
            usage = {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": out,
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": self.prompt_tokens + out,
            }
        choice = req.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "text": _text_echo(req),
            "tool_choice": choice.model_dump()
            if hasattr(choice, "model_dump")
            else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
            **({"conversation": {"id": self.conversation.id}} if self.conversation else {}),
        }

    async def finish(self, store: ResponseStore, output: list[dict], gen: Generation) -> dict:
        """The finished response's object, stored (with `store`) for GET and follow-ups,
        and its input and output items added to its conversation: all in one transaction,
        so a conversation never holds half a turn."""
        status = "incomplete" if gen.outputs[0].finish_reason == "length" else "completed"
        if self.searched is not None:
            output = self.searched.annotate(output)
        body = self.body(status, output, gen)
        entry = None
        if self.req.store:
            messages = [*self.new_messages, assistant_message(output)]
            entry = Entry(
                self.id,
                self.model,
                self.chain,
                self.req.previous_response_id,
                self.req.input_items(),
                messages,
                body,
                self.owner,
            )
        joined, also = self.conversation, None
        if joined is not None:
            said = [i for i in output if i["type"] != "file_search_call"]  # no message of its own
            also = partial(append_turn, joined.id, [*joined.items, *output_new_items(said)])
        if entry is not None or also is not None:
            await store.put(entry, also)
        return body


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {
        "type": "message",
        "id": item_id or f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    """The thinking, as OpenAI's reasoning item carries a model's own reasoning text (its
    `content`; there is no summary of it here)."""
    return {
        "type": "reasoning",
        "id": item_id or f"rs_{uuid.uuid4().hex}",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{call_id.removeprefix('call_')}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(out: OutputState, fmt: ToolFormat | None) -> list[dict]:
    """A finished output as Responses output items: its thinking, its text, then its
    calls (an output cut off while thinking has no message)."""
    items = [reasoning_item(out.thinking)] if out.reasoned else []
    content, calls = (out.text, []) if fmt is None else whole_output(fmt, out.text)
    if content or not (calls or items):
        items.append(message_item(content))
    return items + [call_item(i, c.name, c.arguments) for i, c in calls]


def _text_echo(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type != "json_schema":  # text and json_object: the type alone
        echo: dict[str, Any] = {"format": {"type": fmt.type if fmt else "text"}}
    else:
        echo = {"format": fmt.model_dump(by_alias=True, exclude_none=True)}
    if req.text and req.text.verbosity:
        echo["verbosity"] = req.text.verbosity
    return echo
