"""OpenAI's Assistants v2 runs: create (streamed or not), create-and-run, retrieve, list,
update, cancel, and run steps. A run is carried out by this ingress's RunExecutor; a
streamed one answers its events as server-sent events (`event: thread.run.created`
... `event: done`), as the SDK's AssistantEventHandler reads them.

This module's routes are matched before routes.py's (ROUTE_MODULES in __init__.py), so
`POST /v1/threads/runs` is matched here before `POST /v1/threads/{thread_id}` there.
"""

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse

from deployments.api.assistants.routes import CursorDep, IdempotencyKey
from deployments.api.assistants.runs import END
from deployments.api.assistants.schema import RunCreate, ThreadAndRunCreate, WithMetadata
from deployments.api.assistants.service import Assistants, AssistantsDep, WhoDep
from deployments.http.caller import Caller
from deployments.http.streaming import SSE_HEADERS
from deployments.ingress import IngressDep, RequestTag
from deployments.state.assistants import RUN_ACTIVE

router = APIRouter(prefix="/v1")
POLL_AFTER_MS = "250"  # the SDK's create_and_poll waits this long between reads
DONE = "event: done\ndata: [DONE]\n\n"


@router.post("/threads/runs")
async def create_thread_and_run(
    req: ThreadAndRunCreate, a: AssistantsDep, ingress: IngressDep, tag: RequestTag, who: WhoDep
):  # noqa: ANN201
    await a.store.get_assistant(req.assistant_id, who)  # a 404 before any thread is made
    thread = req.thread
    messages = [m.fields() for m in thread.messages] if thread else []
    meta = (thread.metadata if thread else None) or {}
    created = await a.store.create_thread(meta, messages, who)
    return await _create_run(created["id"], req, a, ingress, tag, None, who, created)


@router.post("/threads/{thread_id}/runs")
async def create_run(
    thread_id: str,
    req: RunCreate,
    a: AssistantsDep,
    ingress: IngressDep,
    tag: RequestTag,
    who: WhoDep,
    key: IdempotencyKey = None,
):  # noqa: ANN201
    return await _create_run(thread_id, req, a, ingress, tag, key, who)


@router.get("/threads/{thread_id}/runs")
async def list_runs(thread_id: str, a: AssistantsDep, cursor: CursorDep, who: WhoDep) -> dict:
    return await a.store.runs.list_runs(thread_id, who, **cursor.args)


@router.get("/threads/{thread_id}/runs/{run_id}")
async def get_run(
    thread_id: str, run_id: str, a: AssistantsDep, response: Response, who: WhoDep
) -> dict:
    response.headers["openai-poll-after-ms"] = POLL_AFTER_MS
    return await a.store.runs.get_run(thread_id, run_id, who)


@router.post("/threads/{thread_id}/runs/{run_id}")
async def update_run(
    thread_id: str, run_id: str, req: WithMetadata, a: AssistantsDep, who: WhoDep
) -> dict:
    if "metadata" not in req.model_fields_set:
        return await a.store.runs.get_run(thread_id, run_id, who)
    return await a.store.runs.update_run_metadata(thread_id, run_id, req.metadata or {}, who)


@router.post("/threads/{thread_id}/runs/{run_id}/cancel")
async def cancel_run(thread_id: str, run_id: str, a: AssistantsDep, who: WhoDep) -> dict:
    run = await a.store.runs.request_cancel(thread_id, run_id, who)
    a.runs.stop(run_id)  # here at once; another ingress's run at its next lease tick
    return run


@router.get("/threads/{thread_id}/runs/{run_id}/steps")
async def list_steps(
    thread_id: str, run_id: str, a: AssistantsDep, cursor: CursorDep, who: WhoDep
) -> dict:
    return await a.store.runs.list_steps(thread_id, run_id, who, **cursor.args)


@router.get("/threads/{thread_id}/runs/{run_id}/steps/{step_id}")
async def get_step(
    thread_id: str, run_id: str, step_id: str, a: AssistantsDep, who: WhoDep
) -> dict:
    return await a.store.runs.get_step(thread_id, run_id, step_id, who)


async def _create_run(
    thread_id: str,
    req: RunCreate,
    a: Assistants,
    ingress: IngressDep,
    tag: str,
    key: str | None,
    who: Caller,
    new_thread: dict | None = None,
):  # noqa: ANN202
    assistant = await a.store.get_assistant(req.assistant_id, who)
    model = req.model or assistant["model"]
    ingress.model(model)
    instructions = req.instructions if req.instructions is not None else assistant["instructions"]
    if req.additional_instructions:
        instructions = "\n\n".join(filter(None, [instructions, req.additional_instructions]))
    fields = {
        "assistant_id": assistant["id"],
        "model": model,
        "instructions": instructions,
        "temperature": _first(req.temperature, assistant["temperature"]),
        "top_p": _first(req.top_p, assistant["top_p"]),
        "max_prompt_tokens": req.max_prompt_tokens,
        "max_completion_tokens": req.max_completion_tokens,
        "response_format": req.response_format or assistant["response_format"],
        "meta": req.metadata or {},
    }
    for i, m in enumerate(req.additional_messages or ()):
        message_key = None if key is None else f"{key}/message/{i}"
        await a.store.create_message(thread_id, m.fields(), message_key, who)
    run, is_new = await a.store.runs.create_run(thread_id, fields, key, who)
    events: asyncio.Queue | None = asyncio.Queue() if req.stream and is_new else None
    if is_new:
        a.runs.start(run, tag, events)
    if not req.stream:
        return run
    body = _events(run, events, new_thread) if is_new else _replay(a, run, who)
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


async def _events(run: dict, events: asyncio.Queue, new_thread: dict | None) -> AsyncIterator[str]:
    """The run's events as the SDK reads them."""
    if new_thread is not None:
        yield _frame("thread.created", new_thread)
    yield _frame("thread.run.created", run)
    yield _frame("thread.run.queued", run)
    while (item := await events.get()) is not END:
        yield _frame(*item)
    yield DONE


async def _replay(a: Assistants, run: dict, who: Caller) -> AsyncIterator[str]:
    """A retried stream (its run made by the first attempt, and carried out there):
    the run followed in the database to its end, then its message and the run's end, so
    the SDK's final run and messages are right (the text arrives whole, not in deltas)."""
    yield _frame("thread.run.created", run)
    while run["status"] in RUN_ACTIVE:
        await asyncio.sleep(float(POLL_AFTER_MS) / 1000)
        run = await a.store.runs.get_run(run["thread_id"], run["id"], who)
    messages = await a.store.list_messages(run["thread_id"], run["id"], who, limit=100, order="asc")
    for message in messages["data"]:
        yield _frame("thread.message.created", {**message, "content": []})
        yield _frame(f"thread.message.{message['status']}", message)
    yield _frame(f"thread.run.{run['status']}", run)
    yield DONE


def _frame(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)
