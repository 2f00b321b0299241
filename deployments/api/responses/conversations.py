"""OpenAI's Conversations API: a durable list of items that Responses continue
(`conversation` on POST /v1/responses, in routes.py) and add their turns to.

POST /v1/conversations (metadata, up to 20 first items), GET, POST (its metadata) and
DELETE /v1/conversations/{id}, and its items: GET (a page, newest first unless
`order=asc`) and POST (up to 20 more) /v1/conversations/{id}/items, GET and DELETE
/v1/conversations/{id}/items/{item_id}. Items added between turns make the next turn's
prompt longer; its warm context still reuses what it holds (warm_context.py). The store
is made by routes.install, beside the stored responses it shares a database with.
"""

import logging
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request

from app.protocol.errors import ShoalError
from deployments.api.responses.conversation_store import ConversationStore, context_id
from deployments.api.responses.item_messages import new_items
from deployments.api.responses.schema import ConversationCreate, ConversationUpdate, ItemsCreate
from deployments.api.warm_context import free
from deployments.http.caller import Caller, caller_of
from deployments.ingress import IngressDep

logger = logging.getLogger("ray.serve")
router = APIRouter(prefix="/v1")


def _store(request: Request) -> ConversationStore:
    return request.app.state.conversations


StoreDep = Annotated[ConversationStore, Depends(_store)]
WhoDep = Annotated[Caller, Depends(caller_of)]  # a key sees only the conversations it made
# Nothing extra to include: items are returned whole. Accepted, as the SDK may send it.
IncludeQuery = Annotated[list[str] | None, Query()]


@router.post("/conversations")
async def create(req: ConversationCreate, store: StoreDep, who: WhoDep) -> dict:
    items = new_items(req.items, "items") if req.items else []
    return await store.create(req.metadata, items, who)


@router.get("/conversations/{conversation_id}")
async def retrieve(conversation_id: str, store: StoreDep, who: WhoDep) -> dict:
    return await store.get(conversation_id, who)


@router.post("/conversations/{conversation_id}")
async def update(
    conversation_id: str, req: ConversationUpdate, store: StoreDep, who: WhoDep
) -> dict:
    return await store.update(conversation_id, req.metadata, who)


@router.delete("/conversations/{conversation_id}")
async def delete(conversation_id: str, store: StoreDep, who: WhoDep, ingress: IngressDep) -> dict:
    deleted = await store.delete(conversation_id, who)
    # Its context, on whichever model its turns ran (each turn may name another).
    for model in ingress.served_models():
        try:
            await free(ingress, model.name, context_id(conversation_id))
        except ShoalError as exc:  # deleted all the same: an idle context ages out
            logger.warning("conversation %s: its context stays for now: %s", conversation_id, exc)
    return deleted


@router.get("/conversations/{conversation_id}/items")
async def list_items(
    conversation_id: str,
    store: StoreDep,
    who: WhoDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    include: IncludeQuery = None,
) -> dict:
    return await store.items(conversation_id, who, limit, order, after)


@router.post("/conversations/{conversation_id}/items")
async def create_items(
    conversation_id: str,
    req: ItemsCreate,
    store: StoreDep,
    who: WhoDep,
    include: IncludeQuery = None,
) -> dict:
    return await store.append(conversation_id, new_items(req.items, "items"), who)


@router.get("/conversations/{conversation_id}/items/{item_id}")
async def retrieve_item(
    conversation_id: str, item_id: str, store: StoreDep, who: WhoDep, include: IncludeQuery = None
) -> dict:
    return await store.item(conversation_id, item_id, who)


@router.delete("/conversations/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, store: StoreDep, who: WhoDep) -> dict:
    return await store.delete_item(conversation_id, item_id, who)
