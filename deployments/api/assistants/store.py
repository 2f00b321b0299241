"""AssistantsStore: every read and write of the Assistants API's state, each one unit of
work on the database: assistants, threads and messages here, runs and their steps in
`runs` (run_store.py). Routes and the run executor call these; they never open a
session themselves. Routes say who asks (`who`): a key reads and changes only what it
made (OWNERS in deployments/state/assistants.py).
"""

from dataclasses import asdict
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from app.protocol.errors import InvalidRequestError
from deployments.api.assistants.run_store import RunStore, Who
from deployments.retrieval.excerpts import with_excerpts
from deployments.retrieval.service import Found
from deployments.state.assistants import (
    Assistant,
    Message,
    Run,
    RunStep,
    Thread,
)
from deployments.state.base import IdempotencyKey, new_id, now
from deployments.state.database import Database, find, once, page

MAX_THREAD_MESSAGES = 100_000  # OpenAI's limit on one thread


class AssistantsStore:
    def __init__(self, url: str, lease_s: float = 30.0) -> None:
        self.db = Database(url)
        self.runs = RunStore(self.db, lease_s)

    def close(self) -> None:
        self.db.close()

    # ---- assistants -------------------------------------------------------------------
    async def create_assistant(self, fields: dict, who: Who = None) -> dict:
        def work(s: Session) -> dict:
            row = Assistant(id=new_id("asst"), owner=owner(who), **fields)
            s.add(row)
            s.flush()
            return row.as_api()

        return await self.db.work(work)

    async def get_assistant(self, assistant_id: str, who: Who = None) -> dict:
        return await self.db.work(lambda s: find(s, Assistant, assistant_id, who).as_api())

    async def update_assistant(self, assistant_id: str, fields: dict, who: Who = None) -> dict:
        return await self.db.work(_update, Assistant, assistant_id, fields, who)

    async def list_assistants(self, who: Who = None, **cursor: Any) -> dict:
        return await self.db.work(lambda s: page(s, Assistant, viewer=who, **cursor))

    async def delete_assistant(self, assistant_id: str, who: Who = None) -> dict:
        def work(s: Session) -> dict:
            s.delete(find(s, Assistant, assistant_id, who))
            return {"id": assistant_id, "object": "assistant.deleted", "deleted": True}

        return await self.db.work(work)

    # ---- threads ----------------------------------------------------------------------
    async def create_thread(
        self, meta: dict, messages: list[dict], who: Who = None, tool_resources: dict | None = None
    ) -> dict:
        def work(s: Session) -> dict:
            thread = Thread(
                id=new_id("thread"), owner=owner(who), meta=meta, tool_resources=tool_resources
            )
            s.add(thread)
            for m in messages:
                s.add(_message(thread.id, **m))
            s.flush()
            return thread.as_api()

        return await self.db.work(work)

    async def get_thread(self, thread_id: str, who: Who = None) -> dict:
        return await self.db.work(lambda s: find(s, Thread, thread_id, who).as_api())

    async def update_thread(self, thread_id: str, fields: dict, who: Who = None) -> dict:
        return await self.db.work(_update, Thread, thread_id, fields, who)

    async def delete_thread(self, thread_id: str, who: Who = None) -> tuple[dict, list[str]]:
        """Delete the thread, its messages, runs and steps; also the ids of the runs that
        were active (ended here as cancelled: the caller stops their work)."""

        def work(s: Session) -> tuple[dict, list[str]]:
            s.delete(find(s, Thread, thread_id, who))
            active = self.runs.end_active_runs(s, thread_id)
            for model in (Message, Run, RunStep):
                s.execute(delete(model).where(model.thread_id == thread_id))
            scopes = [f"messages:{thread_id}", f"runs:{thread_id}"]
            s.execute(delete(IdempotencyKey).where(IdempotencyKey.scope.in_(scopes)))
            return {"id": thread_id, "object": "thread.deleted", "deleted": True}, active

        return await self.db.work(work)

    # ---- messages ---------------------------------------------------------------------
    async def create_message(
        self, thread_id: str, fields: dict, key: str | None, who: Who = None
    ) -> tuple[dict, bool]:
        def work(s: Session) -> dict:
            find(s, Thread, thread_id, who)
            self.runs.refuse_if_running(
                s, thread_id, "Can't add messages to {thread} while a run {run} is active."
            )
            held = s.scalar(select(func.count()).where(Message.thread_id == thread_id))
            if held >= MAX_THREAD_MESSAGES:
                raise InvalidRequestError(
                    f"A thread holds at most {MAX_THREAD_MESSAGES:,} messages; {thread_id} is full.",
                    param="thread_id",
                )
            row = _message(thread_id, **fields)
            s.add(row)
            s.flush()
            return row.as_api()

        return await once(self.db, key, f"messages:{thread_id}", Message, work)

    async def get_message(self, thread_id: str, message_id: str, who: Who = None) -> dict:
        def work(s: Session) -> dict:
            find(s, Thread, thread_id, who)
            return find(s, Message, message_id, thread_id=thread_id).as_api()

        return await self.db.work(work)

    async def update_message(
        self, thread_id: str, message_id: str, fields: dict, who: Who = None
    ) -> dict:
        def work(s: Session) -> dict:
            find(s, Thread, thread_id, who)
            return _update(s, Message, message_id, fields, None, {"thread_id": thread_id})

        return await self.db.work(work)

    async def list_messages(
        self, thread_id: str, run_id: str | None, who: Who = None, **cursor: Any
    ) -> dict:
        def work(s: Session) -> dict:
            find(s, Thread, thread_id, who)
            where = {"thread_id": thread_id} | ({"run_id": run_id} if run_id else {})
            return page(s, Message, **cursor, **where)

        return await self.db.work(work)

    async def delete_message(self, thread_id: str, message_id: str, who: Who = None) -> dict:
        def work(s: Session) -> dict:
            find(s, Thread, thread_id, who)
            s.delete(find(s, Message, message_id, thread_id=thread_id))
            return {"id": message_id, "object": "thread.message.deleted", "deleted": True}

        return await self.db.work(work)

    async def conversation(self, thread_id: str, max_chars: int, max_messages: int) -> list[dict]:
        """The thread's latest messages, oldest first, as chat-template messages: no more
        than `max_messages`, and no more text than `max_chars` (the newest message
        always). Older ones are left out here, before anything is rendered: a thread may
        hold far more than any context window. Each renders as the run that answered it
        rendered it (see Message's hidden columns): a user message with the excerpts a
        file_search put before it, a reply after its run's calls and tool outputs."""

        def work(s: Session) -> list[dict]:
            newest_first = (
                select(Message.role, Message.text, Message.excerpts, Message.prelude)
                .where(Message.thread_id == thread_id)
                .order_by(Message.seq.desc())
                .limit(max_messages)
                .execution_options(yield_per=256)
            )
            out: list[list[dict]] = []
            chars = 0
            for role, text, excerpts, prelude in s.execute(newest_first):
                if excerpts:
                    text = with_excerpts([Found(**f) for f in excerpts], text)
                turn = [*(prelude or []), {"role": role, "content": text}]
                chars += sum(len(str(m.get("content") or "")) for m in turn)
                if out and chars > max_chars:
                    break
                out.append(turn)
            return [m for turn in out[::-1] for m in turn]

        return await self.db.work(work)

    async def last_user_message(self, thread_id: str) -> dict | None:
        """The thread's newest user message: `id`, `text` and `excerpts` (None when no
        file_search has searched for it yet)."""

        def work(s: Session) -> dict | None:
            row = s.execute(
                select(Message.id, Message.text, Message.excerpts)
                .where(Message.thread_id == thread_id, Message.role == "user")
                .order_by(Message.seq.desc())
                .limit(1)
            ).first()
            return None if row is None else {"id": row[0], "text": row[1], "excerpts": row[2]}

        return await self.db.work(work)

    async def set_excerpts(self, message_id: str, found: list[Found]) -> None:
        def work(s: Session) -> None:
            s.execute(
                update(Message)
                .where(Message.id == message_id)
                .values(excerpts=[asdict(f) for f in found])
            )

        await self.db.work(work)


def _message(thread_id: str, **fields: Any) -> Message:
    if fields.get("status", "completed") == "completed":
        fields.setdefault("completed_at", now())
    return Message(id=new_id("msg"), thread_id=thread_id, **fields)


def owner(who: Who) -> str | None:
    """The owner a new object gets: the id of the key that made it."""
    return None if who is None else who.key_id


def _update(
    s: Session, model: type, object_id: str, fields: dict, who: Who, where: dict | None = None
) -> dict:
    row = find(s, model, object_id, who, **(where or {}))
    for name, value in fields.items():
        setattr(row, name, value)
    s.flush()
    return row.as_api()
