"""OpenAI's Assistants v2 runs: create (streamed or not), create-and-run, retrieve, list,
update, cancel, submit tool outputs, and run steps. A run is carried out by this
ingress's RunExecutor; a streamed one answers its events as server-sent events (`event:
thread.run.created` ... `event: done`), as the SDK's AssistantEventHandler reads them.

This module's routes are matched before routes.py's (ROUTE_MODULES in __init__.py), so
`POST /v1/threads/runs` is matched here before `POST /v1/threads/{thread_id}` there.
"""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from app.protocol.errors import InvalidRequestError
from deployments.api.assistants.routes import CursorDep, IdempotencyKey, add_message, new_thread
from deployments.api.assistants.run_search import step_shown
from deployments.api.assistants.runs import END
from deployments.api.assistants.schema import (
    RunCreate,
    SubmitToolOutputs,
    ThreadAndRunCreate,
    WithMetadata,
)
from deployments.api.assistants.service import Assistants, AssistantsDep, WhoDep
from deployments.api.assistants.thread_files import run_store_ids
from deployments.api.assistants.tool_schema import (
    RESULTS_CONTENT,
    ToolResources,
    check_choice,
    dump_tools,
)
from deployments.http.adapters import named_adapter
from deployments.http.caller import Caller
from deployments.http.streaming import SSE_HEADERS
from deployments.ingress import IngressDep, RequestTag
from deployments.state.assistants import RUN_ACTIVE

router = APIRouter(prefix="/v1")
POLL_AFTER_MS = "250"  # the SDK's create_and_poll waits this long between reads
DONE = "event: done\ndata: [DONE]\n\n"
# `include`, as the SDK sends it: a query parameter (`include[]=...`).
Include = Annotated[list[str] | None, Query(alias="include[]")]


def _include(*asked: list[str] | None) -> list[str]:
    out = [i for given in asked for i in given or []]
    for item in out:
        if item != RESULTS_CONTENT:
            raise InvalidRequestError(f"include: only {RESULTS_CONTENT!r} is served", "include")
    return out


@router.post("/threads/runs")
async def create_thread_and_run(
    req: ThreadAndRunCreate,
    a: AssistantsDep,
    ingress: IngressDep,
    tag: RequestTag,
    who: WhoDep,
    include: Include = None,
):  # noqa: ANN201
    await a.store.get_assistant(req.assistant_id, who)  # a 404 before any thread is made
    created = await new_thread(req.thread, a, who)
    asked = _include(include, req.include)
    return await _create_run(
        created["id"], req, a, ingress, tag, None, who, asked, created, req.tool_resources
    )


@router.post("/threads/{thread_id}/runs")
async def create_run(
    thread_id: str,
    req: RunCreate,
    a: AssistantsDep,
    ingress: IngressDep,
    tag: RequestTag,
    who: WhoDep,
    key: IdempotencyKey = None,
    include: Include = None,
):  # noqa: ANN201
    asked = _include(include, req.include)
    return await _create_run(thread_id, req, a, ingress, tag, key, who, asked)


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


@router.post("/threads/{thread_id}/runs/{run_id}/submit_tool_outputs")
async def submit_tool_outputs(
    thread_id: str,
    run_id: str,
    req: SubmitToolOutputs,
    a: AssistantsDep,
    tag: RequestTag,
    who: WhoDep,
):  # noqa: ANN201
    outputs = [o.model_dump() for o in req.tool_outputs]
    work, step, shown = await a.store.runs.tools.submit_outputs(thread_id, run_id, outputs, who)
    events: asyncio.Queue | None = asyncio.Queue() if req.stream else None
    a.runs.start(work, tag, events)
    if not req.stream:
        return shown
    assert events is not None
    body = _continued(step, events)
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


@router.get("/threads/{thread_id}/runs/{run_id}/steps")
async def list_steps(
    thread_id: str,
    run_id: str,
    a: AssistantsDep,
    cursor: CursorDep,
    who: WhoDep,
    include: Include = None,
) -> dict:
    listed = await a.store.runs.list_steps(thread_id, run_id, who, **cursor.args)
    asked = _include(include)
    return {**listed, "data": [step_shown(step, asked) for step in listed["data"]]}


@router.get("/threads/{thread_id}/runs/{run_id}/steps/{step_id}")
async def get_step(
    thread_id: str,
    run_id: str,
    step_id: str,
    a: AssistantsDep,
    who: WhoDep,
    include: Include = None,
) -> dict:
    step = await a.store.runs.get_step(thread_id, run_id, step_id, who)
    return step_shown(step, _include(include))


async def _create_run(
    thread_id: str,
    req: RunCreate,
    a: Assistants,
    ingress: IngressDep,
    tag: str,
    key: str | None,
    who: Caller,
    include: list[str],
    made_thread: dict | None = None,
    resources: ToolResources | None = None,
):  # noqa: ANN202
    assistant = await a.store.get_assistant(req.assistant_id, who)
    model = req.model or assistant["model"]
    if named_adapter(ingress.model(model).name) is not None:  # runs keep the base's contexts
        raise InvalidRequestError("Assistants runs do not take LoRA adapters", "model")
    tools = dump_tools(req.tools) if req.tools is not None else assistant["tools"]
    check_choice(req.tool_choice, tools)
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
        "tools": tools,
        "tool_choice": _dumped(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
    }
    for i, m in enumerate(req.additional_messages or ()):
        message_key = None if key is None else f"{key}/message/{i}"
        await add_message(thread_id, m, a, message_key, who)
    if any(t["type"] == "file_search" for t in tools):
        fields["vector_store_ids"] = await run_store_ids(
            a.retrieval, a.store, thread_id, assistant, resources, who
        )
    run, is_new = await a.store.runs.create_run(thread_id, fields, key, who)
    events: asyncio.Queue | None = asyncio.Queue() if req.stream and is_new else None
    if is_new:
        a.runs.start(run, tag, events, include)
    if not req.stream:
        return run
    body = _events(run, events, made_thread) if is_new else _replay(a, run, who)
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


async def _events(run: dict, events: asyncio.Queue, made_thread: dict | None) -> AsyncIterator[str]:
    """The run's events as the SDK reads them."""
    if made_thread is not None:
        yield _frame("thread.created", made_thread)
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
    while run["status"] in RUN_ACTIVE and run["status"] != "requires_action":
        await asyncio.sleep(float(POLL_AFTER_MS) / 1000)
        run = await a.store.runs.get_run(run["thread_id"], run["id"], who)
    messages = await a.store.list_messages(run["thread_id"], run["id"], who, limit=100, order="asc")
    for message in messages["data"]:
        yield _frame("thread.message.created", {**message, "content": []})
        yield _frame(f"thread.message.{message['status']}", message)
    yield _frame(f"thread.run.{run['status']}", run)
    yield DONE


async def _continued(step: dict | None, events: asyncio.Queue) -> AsyncIterator[str]:
    """A run's events after its tool outputs: their step done, then the run's."""
    if step is not None:
        yield _frame("thread.run.step.completed", step)
    while (item := await events.get()) is not END:
        yield _frame(*item)
    yield DONE


def _dumped(choice: object) -> object:
    if choice is None:
        return "auto"
    return choice.model_dump() if isinstance(choice, BaseModel) else choice


def _frame(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)
