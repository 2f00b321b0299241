"""OpenAI's Responses API: POST /v1/responses (whole, or streamed as its typed events),
GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items.

A response may continue from `previous_response_id`: the stored conversation up to it,
then the new input, rendered with the model's chat template. A chain of stored responses
shares one persistent context (deployments/api/warm_context.py): a follow-up appends only its
new tokens, with no re-prefill of the history (a branch started while another turn of
its chain holds the context runs without it). `instructions` are never carried over,
as OpenAI documents: each request's own lead the prompt.

Or it may continue a `conversation` (conversations.py), never both: the conversation's
items, then the new input; its input and output items are added to the conversation
when it ends, with the stored response, in one transaction (a failed response adds
nothing). A conversation is a persistent context as a chain is, named after it.
"""

import logging
import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request

from app.protocol.errors import InvalidRequestError, ShoalError
from app.protocol.sampling import SamplingParams
from deployments.api.responses import conversation_store
from deployments.api.responses.conversation_store import ConversationStore, Joined
from deployments.api.responses.events import error_event, response_events
from deployments.api.responses.file_search import search_turn, turn_message
from deployments.api.responses.item_messages import input_new_items, listed_item
from deployments.api.responses.schema import ResponsesRequest
from deployments.api.responses.store import Entry, ResponseStore
from deployments.api.responses.turn import Turn, output_items
from deployments.api.warm_context import free, generate_in_context
from deployments.http.adapters import named_adapter
from deployments.http.caller import Caller, caller_of
from deployments.http.chat_turn import ChatTurn, PreparedTurn, prepare
from deployments.http.generation import Generation
from deployments.http.streaming import stream, typed_sse
from deployments.ingress import Ingress, IngressDep, RequestTag
from deployments.state.database import Database

logger = logging.getLogger("ray.serve")
# A chain's context busy with another turn is waited for only briefly (a turn that has
# just ended may not be settled yet); a parallel branch then runs without it.
CHAIN_BUSY_PAUSES_S = (0.05, 0.1, 0.2, None)
WIRE = typed_sse(lambda exc: {**error_event(exc), "sequence_number": 0})

router = APIRouter(prefix="/v1")


def install(app: FastAPI, ingress: Ingress) -> None:
    """Stored responses live in the app's database, which every ingress replica shares."""
    store = app.state.responses = ResponseStore(Database(ingress.config.database.sqlalchemy_url()))
    app.state.conversations = ConversationStore(store.db)  # conversations.py's, one database

    async def stop() -> None:
        store.close()

    app.router.on_shutdown.append(stop)


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


def _conversations(request: Request) -> ConversationStore:
    return request.app.state.conversations


StoreDep = Annotated[ResponseStore, Depends(_store)]
ConversationsDep = Annotated[ConversationStore, Depends(_conversations)]
WhoDep = Annotated[Caller, Depends(caller_of)]  # a key sees only the responses it made


def context_id(chain: str) -> str:
    return f"responses/{chain}"


@router.post("/responses")
async def create(
    req: ResponsesRequest,
    ingress: IngressDep,
    store: StoreDep,
    conversations: ConversationsDep,
    tag: RequestTag,
    who: WhoDep,
    request: Request,
):  # noqa: ANN201
    name = ingress.served_name(req.model)
    previous, history, new_messages, joined = await _continued(req, store, conversations, who)
    searched = None
    if (tool := req.file_search()) is not None:
        retrieval = getattr(request.app.state, "retrieval", None)
        # The turn's own messages: in a conversation, its new items' fragments, which
        # are stored as the model is shown them (and the prompt's copy of them follows).
        own = new_messages if joined is None else [new.message for new in joined.items]
        searched = await search_turn(retrieval, tool, own, req.include, who)
        if joined is not None and searched is not None:
            shown, mine = turn_message(new_messages), turn_message(own)
            assert shown is not None and mine is not None  # own's are new_messages' last
            shown["content"] = mine["content"]
    lead = [{"role": "system", "content": req.instructions}] if req.instructions else []
    chat = ChatTurn(
        name,
        [*lead, *history, *new_messages],
        req.params(ingress.config.max_tokens_default, None),
        req.output_constraint(),
        **req.tool_fields().turn_tools(),
    )
    prepared = await prepare(ingress, chat)
    ids, params, fmt = prepared.prompt_ids, prepared.params, prepared.tool_format
    rid = f"resp_{uuid.uuid4().hex}"
    chain = previous.chain if previous is not None else rid
    cid = context_id(chain) if req.store else None
    if joined is not None:  # the conversation's context, whatever becomes of the response
        cid = conversation_store.context_id(joined.id)
    gen, reused = await _start(ingress, name, ids, params, tag, cid, prepared)
    made = int(time.time())
    turn = Turn(
        rid, name, req, made, chain, len(ids), reused, new_messages, fmt, who.key_id, joined
    )
    turn.searched = searched
    if req.stream:
        return stream(gen, response_events(turn, gen, store), WIRE)
    await gen.drain()
    return await turn.finish(store, output_items(gen.outputs[0], fmt), gen)


async def _continued(
    req: ResponsesRequest, store: ResponseStore, conversations: ConversationStore, who: Caller
) -> tuple[Entry | None, list[dict], list[dict], Joined | None]:
    """What the turn continues: the response it follows, the history before its input,
    its own messages (what its stored entry keeps), and its conversation. A turn of a
    conversation keeps the whole conversation as its own messages: a response continued
    later by `previous_response_id` goes on from all of it, as OpenAI's does."""
    conversation = req.conversation_id()
    if conversation is not None:
        joined = Joined(conversation, input_new_items(req.checked_input(), "input"))
        return None, [], await conversations.messages(joined, who), joined
    if req.previous_response_id is None:
        return None, [], req.input_messages(), None
    previous, history = await store.conversation(req.previous_response_id, who)
    return previous, history, req.input_messages(), None


async def _start(
    ingress: Ingress,
    model: str,
    ids: list[int],
    params: SamplingParams,
    tag: str,
    cid: str | None,
    prepared: PreparedTurn,
) -> tuple[Generation, int]:
    """The turn's generation, and how many prompt tokens its chain's context held. A
    stored turn extends the chain's context; a turn nobody can continue (`store: false`)
    leaves it as it was. While another turn of the chain holds the context (a parallel
    branch from the same response), this one runs without it: same reply, no reuse. So
    does a turn whose prompt holds images (a context keeps tokens, not images; the
    prefix cache still finds the image's KV), and one on a LoRA adapter."""
    reasoning, images = prepared.reasoning, prepared.images
    if cid is not None and not images and named_adapter(model) is None:  # contexts: the base's
        try:
            return await generate_in_context(
                ingress, model, cid, ids, params, tag, CHAIN_BUSY_PAUSES_S, reasoning
            )
        except ShoalError as exc:
            if exc.status_code != 409:
                raise
            logger.info("context %s is busy: this turn runs without it", cid)
    return await ingress.generate(
        model, ids, params, [], tag, reasoning=reasoning, images=images
    ), 0


@router.get("/responses/{response_id}")
async def retrieve(response_id: str, store: StoreDep, who: WhoDep) -> dict:
    return (await store.get(response_id, who)).body


@router.delete("/responses/{response_id}")
async def delete(response_id: str, ingress: IngressDep, store: StoreDep, who: WhoDep) -> dict:
    entry = await store.delete(response_id, who)
    if entry.chain == response_id:  # the chain's first turn: its context goes with it
        try:
            await free(ingress, entry.model, context_id(entry.chain))
        except ShoalError as exc:  # busy: a turn is generating in it; it ages out instead
            if exc.status_code != 409:
                raise
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/responses/{response_id}/input_items")
async def input_items(
    response_id: str,
    store: StoreDep,
    who: WhoDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    include: Annotated[list[str] | None, Query()] = None,  # nothing extra to include
) -> dict:
    """The response's own input items (not those of the responses it continued), newest
    first unless `order=asc`, a page of `limit` after the item `after`."""
    items = [
        listed_item(response_id, i, item)
        for i, item in enumerate((await store.get(response_id, who)).input_items)
    ]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequestError(f"no input item {after!r} in {response_id}", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
