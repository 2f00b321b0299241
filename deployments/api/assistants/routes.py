"""OpenAI's Assistants v2: assistants, threads and their messages (runs are in
run_routes.py). State lives in the Assistants database (deployments/state);
these routes validate, call the store, and answer its objects. Each says who asks: a
key sees only what it made, another key's ids are 404s (OWNERS in state/assistants.py)."""

import logging
from typing import Annotated

from fastapi import APIRouter, FastAPI, Header

from app.protocol.errors import ShoalError
from deployments.api.assistants import service
from deployments.api.assistants.schema import (
    AssistantCreate,
    AssistantUpdate,
    MessageCreate,
    MessageUpdate,
    ThreadCreate,
    ThreadUpdate,
)
from deployments.api.assistants.service import Assistants, AssistantsDep, WhoDep
from deployments.api.assistants.thread_context import free_thread
from deployments.api.assistants.thread_files import attach, checked_resources, thread_resources
from deployments.api.assistants.tool_schema import dump_tools
from deployments.api.cursor import CursorDep
from deployments.http.caller import Caller
from deployments.ingress import Ingress, IngressDep

logger = logging.getLogger("ray.serve")
router = APIRouter(prefix="/v1")
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", max_length=256)]


def install(app: FastAPI, ingress: Ingress) -> None:
    service.install(app, ingress)


ASSISTANT_FIELDS = ("model", "name", "description", "instructions", "temperature", "top_p")


async def _assistant_fields(
    req: AssistantCreate | AssistantUpdate, a: Assistants, who: Caller
) -> dict:
    fields = req.set_fields(*ASSISTANT_FIELDS)
    if "metadata" in req.model_fields_set:
        fields["meta"] = req.metadata or {}
    if "response_format" in req.model_fields_set:
        fields["response_format"] = req.response_format or "auto"
    if "tools" in req.model_fields_set:
        fields["tools"] = dump_tools(req.tools)
    if "tool_resources" in req.model_fields_set:
        fields["tool_resources"] = await checked_resources(a.retrieval, req.tool_resources, who)
    return fields


# ---- assistants --------------------------------------------------------------------------
@router.post("/assistants")
async def create_assistant(
    req: AssistantCreate, a: AssistantsDep, ingress: IngressDep, who: WhoDep
) -> dict:
    ingress.model(req.model)
    return await a.store.create_assistant(await _assistant_fields(req, a, who), who)


@router.get("/assistants")
async def list_assistants(a: AssistantsDep, cursor: CursorDep, who: WhoDep) -> dict:
    return await a.store.list_assistants(who, **cursor.args)


@router.get("/assistants/{assistant_id}")
async def get_assistant(assistant_id: str, a: AssistantsDep, who: WhoDep) -> dict:
    return await a.store.get_assistant(assistant_id, who)


@router.post("/assistants/{assistant_id}")
async def update_assistant(
    assistant_id: str, req: AssistantUpdate, a: AssistantsDep, ingress: IngressDep, who: WhoDep
) -> dict:
    if req.model is not None:
        ingress.model(req.model)
    await a.store.get_assistant(assistant_id, who)  # a 404 before any store is looked at
    fields = await _assistant_fields(req, a, who)
    return await a.store.update_assistant(assistant_id, fields, who)


@router.delete("/assistants/{assistant_id}")
async def delete_assistant(assistant_id: str, a: AssistantsDep, who: WhoDep) -> dict:
    return await a.store.delete_assistant(assistant_id, who)


# ---- threads -----------------------------------------------------------------------------
@router.post("/threads")
async def create_thread(req: ThreadCreate, a: AssistantsDep, who: WhoDep) -> dict:
    return await new_thread(req, a, who)


async def new_thread(req: ThreadCreate | None, a: Assistants, who: Caller) -> dict:
    """A thread with its messages, and its store with the files they bring."""
    if req is None:
        return await a.store.create_thread({}, [], who)
    messages = [m.fields() for m in req.messages]
    resources = await thread_resources(a.retrieval, req.tool_resources, req.searched_files, who)
    return await a.store.create_thread(req.metadata or {}, messages, who, resources)


@router.get("/threads/{thread_id}")
async def get_thread(thread_id: str, a: AssistantsDep, who: WhoDep) -> dict:
    return await a.store.get_thread(thread_id, who)


@router.post("/threads/{thread_id}")
async def update_thread(thread_id: str, req: ThreadUpdate, a: AssistantsDep, who: WhoDep) -> dict:
    fields = {"meta": req.metadata or {}} if "metadata" in req.model_fields_set else {}
    if "tool_resources" in req.model_fields_set:
        await a.store.get_thread(thread_id, who)  # a 404 before any store is made
        fields["tool_resources"] = await thread_resources(a.retrieval, req.tool_resources, [], who)
    return await a.store.update_thread(thread_id, fields, who)


@router.delete("/threads/{thread_id}")
async def delete_thread(thread_id: str, a: AssistantsDep, ingress: IngressDep, who: WhoDep) -> dict:
    deleted, active = await a.store.delete_thread(thread_id, who)
    for run_id in active:  # ended as cancelled in the database: stop their work here
        a.runs.stop(run_id)
    for model in ingress.served_models():  # its context, wherever a run left one
        try:
            await free_thread(ingress, model.name, thread_id)
        except ShoalError as exc:  # deleted all the same: an idle context ages out
            logger.warning("thread %s: its context stays for now: %s", thread_id, exc.message)
    return deleted


# ---- messages ----------------------------------------------------------------------------
@router.post("/threads/{thread_id}/messages")
async def create_message(
    thread_id: str, req: MessageCreate, a: AssistantsDep, who: WhoDep, key: IdempotencyKey = None
) -> dict:
    return await add_message(thread_id, req, a, key, who)


async def add_message(
    thread_id: str, req: MessageCreate, a: Assistants, key: str | None, who: Caller
) -> dict:
    """The message, after the files it brings are queued in its thread's store."""
    await attach(a.retrieval, a.store, thread_id, req.searched_files, who)
    message, _ = await a.store.create_message(thread_id, req.fields(), key, who)
    return message


@router.get("/threads/{thread_id}/messages")
async def list_messages(
    thread_id: str, a: AssistantsDep, cursor: CursorDep, who: WhoDep, run_id: str | None = None
) -> dict:
    return await a.store.list_messages(thread_id, run_id, who, **cursor.args)


@router.get("/threads/{thread_id}/messages/{message_id}")
async def get_message(thread_id: str, message_id: str, a: AssistantsDep, who: WhoDep) -> dict:
    return await a.store.get_message(thread_id, message_id, who)


@router.post("/threads/{thread_id}/messages/{message_id}")
async def update_message(
    thread_id: str, message_id: str, req: MessageUpdate, a: AssistantsDep, who: WhoDep
) -> dict:
    fields = {"meta": req.metadata or {}} if "metadata" in req.model_fields_set else {}
    return await a.store.update_message(thread_id, message_id, fields, who)


@router.delete("/threads/{thread_id}/messages/{message_id}")
async def delete_message(thread_id: str, message_id: str, a: AssistantsDep, who: WhoDep) -> dict:
    return await a.store.delete_message(thread_id, message_id, who)
