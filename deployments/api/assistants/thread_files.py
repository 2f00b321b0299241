"""The vector stores an assistant and a thread search (`tool_resources.file_search`), and
the files messages bring.

As OpenAI's: a message's attachments with the file_search tool go into its thread's
store: the one the thread names, else one made for the thread the first time
(`Retrieval.thread_store`, which expires after a week unused) and recorded in the
thread's tool_resources. A thread may also ask for a store made from files
(`vector_stores`). Every store named is checked first: another key's is a 404.
"""

from collections.abc import Callable

from deployments.api.assistants.store import AssistantsStore
from deployments.api.assistants.tool_schema import ToolResources
from deployments.http.caller import Caller
from deployments.retrieval.service import Retrieval, retrieval_needed

THREAD_STORE_NAME = "thread files"

RetrievalOf = Callable[[], Retrieval | None]


async def checked_resources(
    retrieval: RetrievalOf, resources: ToolResources | None, who: Caller
) -> dict:
    """An assistant's tool_resources as stored, its stores checked."""
    if resources is None or resources.file_search is None:
        return {}
    ids = resources.store_ids
    if ids:
        await retrieval_needed(retrieval()).usable(ids, who)
    return {"file_search": {"vector_store_ids": ids}}


async def thread_resources(
    retrieval: RetrievalOf, resources: ToolResources | None, files: list[str], who: Caller
) -> dict:
    """A thread's tool_resources as stored: its store (named, or made from the files
    it asks for and those its messages bring), checked, with `files` queued in it."""
    ids = resources.store_ids if resources is not None else []
    files = [*(resources.new_files if resources is not None else []), *files]
    if not ids and not files:
        return {"file_search": {"vector_store_ids": []}} if resources else {}
    found = retrieval_needed(retrieval())
    if ids:
        await found.usable(ids, who)
        if files:
            await found.add_files(ids[0], files, who)
    else:
        ids = [await found.thread_store(who, THREAD_STORE_NAME, files)]
    return {"file_search": {"vector_store_ids": ids}}


async def attach(
    retrieval: RetrievalOf, store: AssistantsStore, thread_id: str, files: list[str], who: Caller
) -> None:
    """Queue the files a new message brings in its thread's store (made the first
    time, and recorded in the thread's tool_resources)."""
    if not files:
        return
    thread = await store.get_thread(thread_id, who)
    held = ToolResources.model_validate(thread["tool_resources"] or {})
    resources = await thread_resources(retrieval, held, files, who)
    if resources != thread["tool_resources"]:
        await store.update_thread(thread_id, {"tool_resources": resources}, who)


async def run_store_ids(
    retrieval: RetrievalOf,
    store: AssistantsStore,
    thread_id: str,
    assistant: dict,
    resources: ToolResources | None,
    who: Caller,
) -> list[str]:
    """The stores a run's file_search searches: its assistant's (or create-and-run's own
    `tool_resources`) and its thread's, each one `who` may use."""
    own = resources.store_ids if resources is not None else None
    if own is None:
        own = ToolResources.model_validate(assistant["tool_resources"] or {}).store_ids
    thread = await store.get_thread(thread_id, who)
    held = ToolResources.model_validate(thread["tool_resources"] or {}).store_ids
    ids = list(dict.fromkeys([*own, *held]))
    if ids:
        await retrieval_needed(retrieval()).usable(ids, who)
    return ids
