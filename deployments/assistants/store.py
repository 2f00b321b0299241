"""AssistantsStore: every read and write of the Assistants API's state, each one unit of
work on the database (routes and the run executor call these; they never open a session).

Runs carry a lease (`leased_at`): the ingress working on a run renews it while the run
is queued or in progress. A run whose lease has lapsed (its ingress crashed or was
restarted) is ended as failed, or expired past its `expires_at`, the next time anyone
reads it, so no run stays in progress for ever, whichever ingress replica reads it.
"""

import time
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.protocol.errors import InvalidRequestError
from deployments.assistants.database import Database, find, page
from deployments.assistants.schema import (
    RUN_ACTIVE,
    Assistant,
    IdempotencyKey,
    Message,
    Run,
    RunStep,
    Thread,
    new_id,
    now,
)

RUN_EXPIRES_AFTER_S = 600  # OpenAI's: a run not done in ten minutes expires
LAPSED_ERROR = {
    "code": "server_error",
    "message": "the server running this run stopped before it finished; create a new run",
}


class AssistantsStore:
    def __init__(self, url: str, lease_s: float = 30.0) -> None:
        self.db = Database(url)
        self.lease_s = lease_s

    def close(self) -> None:
        self.db.close()

    # ---- assistants -------------------------------------------------------------------
    async def create_assistant(self, fields: dict) -> dict:
        def work(s: Session) -> dict:
            row = Assistant(id=new_id("asst"), **fields)
            s.add(row)
            s.flush()
            return row.as_api()

        return await self.db.work(work)

    async def get_assistant(self, assistant_id: str) -> dict:
        return await self.db.work(lambda s: find(s, Assistant, assistant_id).as_api())

    async def update_assistant(self, assistant_id: str, fields: dict) -> dict:
        return await self.db.work(_update, Assistant, assistant_id, fields)

    async def list_assistants(self, **cursor: Any) -> dict:
        return await self.db.work(lambda s: page(s, Assistant, **cursor))

    async def delete_assistant(self, assistant_id: str) -> dict:
        def work(s: Session) -> dict:
            s.delete(find(s, Assistant, assistant_id))
            return {"id": assistant_id, "object": "assistant.deleted", "deleted": True}

        return await self.db.work(work)

    # ---- threads ----------------------------------------------------------------------
    async def create_thread(self, meta: dict, messages: list[dict]) -> dict:
        def work(s: Session) -> dict:
            thread = Thread(id=new_id("thread"), meta=meta)
            s.add(thread)
            for m in messages:
                s.add(_message(thread.id, **m))
            s.flush()
            return thread.as_api()

        return await self.db.work(work)

    async def get_thread(self, thread_id: str) -> dict:
        return await self.db.work(lambda s: find(s, Thread, thread_id).as_api())

    async def update_thread(self, thread_id: str, fields: dict) -> dict:
        return await self.db.work(_update, Thread, thread_id, fields)

    async def delete_thread(self, thread_id: str) -> dict:
        def work(s: Session) -> dict:
            s.delete(find(s, Thread, thread_id))
            for model in (Message, Run, RunStep):
                s.execute(delete(model).where(model.thread_id == thread_id))
            return {"id": thread_id, "object": "thread.deleted", "deleted": True}

        return await self.db.work(work)

    # ---- messages ---------------------------------------------------------------------
    async def create_message(
        self, thread_id: str, fields: dict, key: str | None
    ) -> tuple[dict, bool]:
        def work(s: Session) -> dict:
            find(s, Thread, thread_id)
            self._refuse_if_running(
                s, thread_id, "Can't add messages to {thread} while a run {run} is active."
            )
            row = _message(thread_id, **fields)
            s.add(row)
            s.flush()
            return row.as_api()

        return await self._once(key, f"messages:{thread_id}", Message, work)

    async def get_message(self, thread_id: str, message_id: str) -> dict:
        return await self.db.work(
            lambda s: find(s, Message, message_id, thread_id=thread_id).as_api()
        )

    async def update_message(self, thread_id: str, message_id: str, fields: dict) -> dict:
        return await self.db.work(_update, Message, message_id, fields, {"thread_id": thread_id})

    async def list_messages(self, thread_id: str, run_id: str | None, **cursor: Any) -> dict:
        def work(s: Session) -> dict:
            find(s, Thread, thread_id)
            where = {"thread_id": thread_id} | ({"run_id": run_id} if run_id else {})
            return page(s, Message, **cursor, **where)

        return await self.db.work(work)

    async def delete_message(self, thread_id: str, message_id: str) -> dict:
        def work(s: Session) -> dict:
            s.delete(find(s, Message, message_id, thread_id=thread_id))
            return {"id": message_id, "object": "thread.message.deleted", "deleted": True}

        return await self.db.work(work)

    async def conversation(self, thread_id: str) -> list[dict]:
        """The thread's messages, oldest first, as chat-template messages."""

        def work(s: Session) -> list[dict]:
            rows = s.scalars(
                select(Message).where(Message.thread_id == thread_id).order_by(Message.seq)
            )
            return [{"role": m.role, "content": m.text} for m in rows]

        return await self.db.work(work)

    # ---- runs -------------------------------------------------------------------------
    async def create_run(self, thread_id: str, fields: dict, key: str | None) -> tuple[dict, bool]:
        """A queued run (the caller starts it when it is new: not a retry's); 400 while
        the thread has an active run."""

        def work(s: Session) -> dict:
            find(s, Thread, thread_id)
            self._refuse_if_running(
                s, thread_id, "Thread {thread} already has an active run {run}."
            )
            row = Run(
                id=new_id("run"),
                thread_id=thread_id,
                expires_at=now() + RUN_EXPIRES_AFTER_S,
                leased_at=time.time(),
                **fields,
            )
            s.add(row)
            s.flush()
            return row.as_api()

        return await self._once(key, f"runs:{thread_id}", Run, work)

    async def get_run(self, thread_id: str, run_id: str) -> dict:
        def work(s: Session) -> dict:
            row = find(s, Run, run_id, thread_id=thread_id)
            self._end_if_lapsed(s, row)
            return row.as_api()

        return await self.db.work(work)

    async def list_runs(self, thread_id: str, **cursor: Any) -> dict:
        def work(s: Session) -> dict:
            find(s, Thread, thread_id)
            for row in s.scalars(select(Run).filter_by(thread_id=thread_id)):
                self._end_if_lapsed(s, row)
            return page(s, Run, thread_id=thread_id, **cursor)

        return await self.db.work(work)

    async def set_run(self, run_id: str, **changes: Any) -> dict:
        """Record the executor's progress (and renew the lease)."""

        def work(s: Session) -> dict:
            row = find(s, Run, run_id)
            for name, value in changes.items():
                setattr(row, name, value)
            row.leased_at = time.time()
            return row.as_api()

        return await self.db.work(work)

    async def renew_lease(self, run_id: str) -> str:
        """Renew the run's lease; its status (a cancel asked through another ingress
        shows here as `cancelling`)."""

        def work(s: Session) -> str:
            s.execute(update(Run).where(Run.id == run_id).values(leased_at=time.time()))
            return s.scalar(select(Run.status).where(Run.id == run_id)) or "expired"

        return await self.db.work(work)

    async def request_cancel(self, thread_id: str, run_id: str) -> dict:
        def work(s: Session) -> dict:
            row = find(s, Run, run_id, thread_id=thread_id)
            self._end_if_lapsed(s, row)
            if row.status not in ("queued", "in_progress"):
                raise InvalidRequestError(
                    f"Cannot cancel run with status '{row.status}'.", param="run_id"
                )
            row.status = "cancelling"
            return row.as_api()

        return await self.db.work(work)

    def _refuse_if_running(self, s: Session, thread_id: str, message: str) -> None:
        for run in s.scalars(
            select(Run).filter_by(thread_id=thread_id).where(Run.status.in_(RUN_ACTIVE))
        ):
            if not self._end_if_lapsed(s, run):
                raise InvalidRequestError(
                    message.format(thread=thread_id, run=run.id), param="thread_id"
                )

    def _end_if_lapsed(self, s: Session, row: Run) -> bool:
        if row.status not in RUN_ACTIVE or time.time() - row.leased_at < self.lease_s:
            return False
        t = now()
        if row.expires_at is not None and t >= row.expires_at:
            row.status, row.last_error = "expired", None
        else:
            row.status, row.failed_at, row.last_error = "failed", t, LAPSED_ERROR
        for step in s.scalars(select(RunStep).filter_by(run_id=row.id, status="in_progress")):
            step.status, step.failed_at, step.last_error = "failed", t, LAPSED_ERROR
        s.execute(
            update(Message)
            .where(Message.run_id == row.id, Message.status == "in_progress")
            .values(
                status="incomplete", incomplete_at=t, incomplete_details={"reason": "run_failed"}
            )
        )
        return True

    # ---- run steps --------------------------------------------------------------------
    async def create_step(self, run: dict, message_id: str) -> dict:
        def work(s: Session) -> dict:
            row = RunStep(
                id=new_id("step"),
                run_id=run["id"],
                thread_id=run["thread_id"],
                assistant_id=run["assistant_id"],
                message_id=message_id,
            )
            s.add(row)
            s.flush()
            return row.as_api()

        return await self.db.work(work)

    async def set_step(self, step_id: str, **changes: Any) -> dict:
        return await self.db.work(_update, RunStep, step_id, changes)

    async def get_step(self, thread_id: str, run_id: str, step_id: str) -> dict:
        return await self.db.work(
            lambda s: find(s, RunStep, step_id, thread_id=thread_id, run_id=run_id).as_api()
        )

    async def list_steps(self, thread_id: str, run_id: str, **cursor: Any) -> dict:
        def work(s: Session) -> dict:
            find(s, Run, run_id, thread_id=thread_id)
            return page(s, RunStep, run_id=run_id, **cursor)

        return await self.db.work(work)

    async def add_message(self, thread_id: str, **fields: Any) -> dict:
        """A message the executor writes (the assistant's reply), active runs or not."""

        def work(s: Session) -> dict:
            row = _message(thread_id, **fields)
            s.add(row)
            s.flush()
            return row.as_api()

        return await self.db.work(work)

    async def set_message(self, message_id: str, **changes: Any) -> dict:
        return await self.db.work(_update, Message, message_id, changes)

    # ---- idempotency ------------------------------------------------------------------
    async def _once(
        self, key: str | None, scope: str, model: type, create: Any
    ) -> tuple[dict, bool]:
        """`create` once per (scope, Idempotency-Key): a retry gets the first object as
        it is now, also when the two race (the unique key decides); and whether it was
        made now."""
        if key is None:
            return await self.db.work(create), True

        def work(s: Session) -> tuple[dict, bool]:
            seen = s.scalar(select(IdempotencyKey).filter_by(scope=scope, key=key))
            if seen is not None:
                return find(s, model, seen.object_id).as_api(), False
            made = create(s)
            s.add(IdempotencyKey(scope=scope, key=key, object_id=made["id"]))
            s.flush()
            return made, True

        try:
            return await self.db.work(work)
        except IntegrityError:  # the same key, committed by a concurrent request
            return await self.db.work(work)


def _message(thread_id: str, **fields: Any) -> Message:
    if fields.get("status", "completed") == "completed":
        fields.setdefault("completed_at", now())
    return Message(id=new_id("msg"), thread_id=thread_id, **fields)


def _update(
    s: Session, model: type, object_id: str, fields: dict, where: dict | None = None
) -> dict:
    row = find(s, model, object_id, **(where or {}))
    for name, value in fields.items():
        setattr(row, name, value)
    s.flush()
    return row.as_api()
