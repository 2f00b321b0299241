"""OpenAI's Responses API: POST /v1/responses (whole, or streamed as its typed events),
GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items.

A response may continue from `previous_response_id`: the stored conversation up to it,
then the new input, rendered with the model's chat template. A chain of stored responses
shares one persistent context (deployments/warm_context.py): a follow-up appends only its
new tokens, with no re-prefill of the history. `instructions` are never carried over,
as OpenAI documents: each request's own lead the prompt.
"""

import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request

from app.protocol.responses import ResponsesRequest
from deployments.ingress import Ingress, IngressDep, RequestTag
from deployments.response_store import ResponseStore
from deployments.response_turn import Turn, output_items
from deployments.responses_events import error_event, response_events
from deployments.streaming import stream, typed_sse
from deployments.warm_context import free, generate_in_context

WIRE = typed_sse(lambda exc: {**error_event(exc), "sequence_number": 0})

router = APIRouter(prefix="/v1")


def install(app: FastAPI, ingress: Ingress) -> None:
    app.state.responses = ResponseStore()


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


StoreDep = Annotated[ResponseStore, Depends(_store)]


def context_id(chain: str) -> str:
    return f"responses/{chain}"


@router.post("/responses")
async def create(req: ResponsesRequest, ingress: IngressDep, store: StoreDep, tag: RequestTag):  # noqa: ANN201
    name = ingress.served_name(req.model)
    previous, history = None, []
    if req.previous_response_id is not None:
        previous, history = store.conversation(req.previous_response_id)
    new_messages = req.input_messages()
    lead = [{"role": "system", "content": req.instructions}] if req.instructions else []
    tools = req.tool_fields()
    ids = await ingress.encode_chat(name, [*lead, *history, *new_messages], tools.template_tools())
    fmt = ingress.tool_format(name) if tools.uses_tools else None
    constraint = req.output_constraint()
    if fmt is not None and (tools.forces_call or constraint is None):
        constraint = tools.tool_constraint(fmt)
    params = req.params(ingress.config.max_tokens_default, constraint)
    rid = f"resp_{uuid.uuid4().hex}"
    chain = previous.chain if previous is not None else rid
    if req.store:  # the chain's context grows with each stored turn
        gen, reused = await generate_in_context(ingress, name, context_id(chain), ids, params, tag)
    else:  # a turn nobody can continue leaves the chain's context as it was
        gen, reused = await ingress.generate(name, ids, params, [], tag), 0
    turn = Turn(rid, name, req, int(time.time()), chain, len(ids), reused, new_messages, fmt)
    if req.stream:
        return stream(gen, response_events(turn, gen, store), WIRE)
    await gen.drain()
    return turn.finish(store, output_items(gen.outputs[0].text, fmt), gen)


@router.get("/responses/{response_id}")
async def retrieve(response_id: str, store: StoreDep) -> dict:
    return store.get(response_id).body


@router.delete("/responses/{response_id}")
async def delete(response_id: str, ingress: IngressDep, store: StoreDep) -> dict:
    entry = store.get(response_id)
    store.delete(response_id)
    if entry.chain == response_id:  # the chain's first turn: its context goes with it
        await free(ingress, entry.model, context_id(entry.chain))
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/responses/{response_id}/input_items")
async def input_items(response_id: str, store: StoreDep) -> dict:
    items = [
        {"id": f"msg_{response_id[5:]}_{i}", **_as_listed(item)}
        for i, item in enumerate(store.get(response_id).input_items)
    ]
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": False,
    }


def _as_listed(item: dict) -> dict:
    """An input item as OpenAI lists it: a message's text as an input_text part."""
    if item.get("type", "message") != "message":
        return item
    content = item.get("content")
    if isinstance(content, str):
        content = [{"type": "input_text", "text": content}]
    return {"type": "message", "status": "completed", **item, "content": content}
