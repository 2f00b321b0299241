"""A run's file_search: before the run generates, it searches its stores (its
assistant's and its thread's `tool_resources.file_search.vector_store_ids`) with the
thread's last user message, as deployments/retrieval does for every dialect:

- it waits (up to INDEX_WAIT_S) for files still being indexed, as OpenAI's run does;
- the chunks found go into that message ahead of its text (`with_excerpts`), kept in
  the message's hidden `excerpts`: every later run renders the message the same way, so
  the thread's warm context still holds it. A message searched for once is not searched
  for again by a later run: its excerpts stay (what the model was shown stays true);
- the run records a `tool_calls` step with the file_search call and its results (their
  text only when the run's `include` asks, as OpenAI's);
- the reply gets `file_citation` annotations of the chunks it cites (`citations`).

The search always runs when the run has the tool (and `tool_choice` is not "none"): the
small models served here do not decide reliably when to call it, and an assistant that
brings file_search means to use it.
"""

import uuid
from collections.abc import Callable
from typing import Any

from deployments.api.assistants.store import AssistantsStore
from deployments.api.assistants.tool_schema import RESULTS_CONTENT
from deployments.retrieval.service import Found, Retrieval, retrieval_needed

DEFAULT_RESULTS = 5  # this server's models read a few chunks well, not OpenAI's 20
INDEX_WAIT_S = 60.0  # how long a run waits for its stores' files to be indexed


def file_search_tool(run: dict) -> dict | None:
    """The run's file_search tool, unless it has none or its tool_choice is "none"."""
    if run.get("tool_choice") == "none":
        return None
    return next((t for t in run["tools"] if t["type"] == "file_search"), None)


async def searched(store: AssistantsStore, run: dict) -> list[Found] | None:
    """What the run's file_search put in its thread's last user message (a run that
    continues after tool outputs cites it); None without the tool."""
    if file_search_tool(run) is None:
        return None
    last = await store.last_user_message(run["thread_id"])
    return [Found(**f) for f in (last or {}).get("excerpts") or []]


async def search_for_run(
    store: AssistantsStore,
    retrieval: Callable[[], Retrieval | None],
    run: dict,
    emit: Any,
    include: list[str],
) -> list[Found] | None:
    """Search for the thread's last user message (see the module's docstring), record
    the step and emit its events; what was found, None without the tool."""
    tool = file_search_tool(run)
    if tool is None:
        return None
    last = await store.last_user_message(run["thread_id"])
    if last is None:
        return []  # nothing asked: nothing to search for
    settings = tool.get("file_search") or {}
    ranking = {"ranker": "auto", "score_threshold": 0.0} | (settings.get("ranking_options") or {})
    if last["excerpts"] is not None:
        found = [Found(**f) for f in last["excerpts"]]
    else:
        found = await _search(retrieval, run["vector_store_ids"], last["text"], settings, ranking)
        await store.set_excerpts(last["id"], found)
    call = {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "file_search",
        "file_search": {"ranking_options": ranking, "results": [_result(f) for f in found]},
    }
    step = await store.runs.tools.tool_step(run, [call], done=True)
    shown = step_shown(step, include)
    opened = {**shown, "status": "in_progress", "completed_at": None}
    opened["step_details"] = {"type": "tool_calls", "tool_calls": []}
    emit("thread.run.step.created", opened)
    emit("thread.run.step.in_progress", opened)
    tool_calls = [{"index": 0, **c} for c in shown["step_details"]["tool_calls"]]
    delta = {"step_details": {"type": "tool_calls", "tool_calls": tool_calls}}
    emit(
        "thread.run.step.delta",
        {"id": step["id"], "object": "thread.run.step.delta", "delta": delta},
    )
    emit("thread.run.step.completed", shown)
    return found


async def _search(
    retrieval: Callable[[], Retrieval | None],
    store_ids: list[str],
    query: str,
    settings: dict,
    ranking: dict,
) -> list[Found]:
    if not store_ids:
        return []
    found = retrieval_needed(retrieval())
    await found.wait_indexed(store_ids, INDEX_WAIT_S)
    return await found.search(
        store_ids,
        query[: found.config.max_query_chars],  # a long message: what it opens with
        settings.get("max_num_results") or DEFAULT_RESULTS,
        threshold=float(ranking.get("score_threshold") or 0.0),
    )


def _result(f: Found) -> dict:
    return {
        "file_id": f.file_id,
        "file_name": f.filename,
        "score": f.score,
        "content": [{"type": "text", "text": f.text}],
    }


def step_shown(step: dict, include: list[str] | None) -> dict:
    """The step as the client asked for it: a file_search's results carry their text
    only when `include` names RESULTS_CONTENT (as OpenAI's)."""
    if RESULTS_CONTENT in (include or []) or step["type"] != "tool_calls":
        return step
    calls = []
    for call in step["step_details"]["tool_calls"]:
        if call["type"] == "file_search":
            results = [
                {k: v for k, v in r.items() if k != "content"}
                for r in call["file_search"].get("results") or []
            ]
            call = {**call, "file_search": {**call["file_search"], "results": results}}
        calls.append(call)
    return {**step, "step_details": {**step["step_details"], "tool_calls": calls}}
