"""Runs and run steps in the database: their transitions and their leases.

Every transition is one conditional UPDATE (`... WHERE status IN (...)`), so two writers
never overwrite each other: a cancel that lands after the run ended is refused, an end
that comes after the run was cancelled, expired or lapsed changes nothing.

Leases: the ingress carrying out a run renews `leased_at` every tick. A run whose lease
has lapsed (its ingress crashed or was stopped) is ended as failed, or expired past its
`expires_at`, by whoever reads it next, from any ingress replica: no run stays queued or
in progress for ever, and its thread can take a new run. A run in `requires_action`
waits for its client, not for an ingress: it has no lease, and expires past its
`expires_at` when next read (tool_store.py).
"""

import time
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.protocol.errors import InvalidRequestError
from deployments.api.assistants.tool_store import (
    RUN_EXPIRES_AFTER_S,
    ToolStore,
    Who,
    cancel_waiting,
    expire_if_waited_out,
)
from deployments.state.assistants import RUN_ACTIVE, Message, Run, RunStep, Thread
from deployments.state.base import new_id, now
from deployments.state.database import Database, find, once, page

__all__ = ["RUN_EXPIRES_AFTER_S", "RunStore", "Who"]
# The statuses an ingress works in, under a lease (requires_action waits for the client).
LEASED = tuple(status for status in RUN_ACTIVE if status != "requires_action")
LAPSED_ERROR = {
    "code": "server_error",
    "message": "the server running this run stopped before it finished; create a new run",
}


class RunStore:
    def __init__(self, db: Database, lease_s: float) -> None:
        self.db = db
        self.lease_s = lease_s
        self.tools = ToolStore(db)

    async def create_run(
        self, thread_id: str, fields: dict, key: str | None, who: Who = None
    ) -> tuple[dict, bool]:
        """A queued run, and whether it is new (not a retry's): the caller starts it.
        400 while the thread has an active run, also when two requests race for it."""

        def work(s: Session) -> dict:
            find(s, Thread, thread_id, who)
            self.refuse_if_running(s, thread_id, "Thread {thread} already has an active run {run}.")
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

        return await once(self.db, key, f"runs:{thread_id}", Run, work)

    async def get_run(self, thread_id: str, run_id: str, who: Who = None) -> dict:
        def work(s: Session) -> dict:
            find(s, Thread, thread_id, who)
            row = find(s, Run, run_id, thread_id=thread_id)
            self.end_if_lapsed(s, row)
            return row.as_api()

        return await self.db.work(work)

    async def list_runs(self, thread_id: str, who: Who = None, **cursor: Any) -> dict:
        def work(s: Session) -> dict:
            find(s, Thread, thread_id, who)
            for row in s.scalars(select(Run).filter_by(thread_id=thread_id)):
                self.end_if_lapsed(s, row)
            return page(s, Run, thread_id=thread_id, **cursor)

        return await self.db.work(work)

    async def update_run_metadata(
        self, thread_id: str, run_id: str, meta: dict, who: Who = None
    ) -> dict:
        def work(s: Session) -> dict:
            find(s, Thread, thread_id, who)
            row = find(s, Run, run_id, thread_id=thread_id)
            row.meta = meta
            return row.as_api()

        return await self.db.work(work)

    async def work_of(self, run_id: str) -> dict:
        """The run as its executor needs it (with its hidden columns)."""
        return await self.db.work(lambda s: find(s, Run, run_id).as_work())

    async def begin_run(self, run_id: str) -> dict:
        """queued -> in_progress; else the run as it is (`cancelling` when a cancel came
        first)."""
        t = now()
        changes = {"status": "in_progress", "started_at": t, "leased_at": time.time()}
        return await self.db.work(_transition, run_id, ("queued",), changes)

    async def renew_lease(self, run_id: str) -> dict:
        """Renew an active run's lease; the run (`cancelling` when a cancel was asked
        through any ingress, ended when someone ended it)."""
        return await self.db.work(_transition, run_id, LEASED, {"leased_at": time.time()})

    async def request_cancel(self, thread_id: str, run_id: str, who: Who = None) -> dict:
        def work(s: Session) -> dict:
            find(s, Thread, thread_id, who)
            row = find(s, Run, run_id, thread_id=thread_id)
            self.end_if_lapsed(s, row)
            done = s.execute(
                update(Run)
                .where(Run.id == run_id, Run.status.in_(("queued", "in_progress")))
                .values(status="cancelling")
            )
            s.refresh(row)
            if done.rowcount == 0 and not cancel_waiting(s, row):
                raise InvalidRequestError(
                    f"Cannot cancel run with status '{row.status}'.", param="run_id"
                )
            return row.as_api()

        return await self.db.work(work)

    # ---- within a caller's transaction ---------------------------------------------------
    def end_active_runs(self, s: Session, thread_id: str) -> list[str]:
        """End the thread's active runs as cancelled (its deletion); their ids."""
        rows = list(
            s.scalars(select(Run).filter_by(thread_id=thread_id).where(Run.status.in_(RUN_ACTIVE)))
        )
        for row in rows:
            row.status, row.cancelled_at = "cancelled", now()
        return [row.id for row in rows]

    async def start_reply(self, run: dict) -> tuple[dict, dict]:
        """The assistant's message (in progress) and its run step, for a run in progress
        on a thread that still exists."""

        def work(s: Session) -> tuple[dict, dict]:
            find(s, Thread, run["thread_id"])
            message = Message(
                id=new_id("msg"),
                thread_id=run["thread_id"],
                role="assistant",
                status="in_progress",
                assistant_id=run["assistant_id"],
                run_id=run["id"],
            )
            step = RunStep(
                id=new_id("step"),
                run_id=run["id"],
                thread_id=run["thread_id"],
                assistant_id=run["assistant_id"],
                message_id=message.id,
            )
            s.add_all([message, step])
            s.flush()
            return message.as_api(), step.as_api()

        return await self.db.work(work)

    async def end_run(
        self, run_id: str, run: dict, message: dict, step: dict
    ) -> tuple[dict, dict | None, list[dict]] | None:
        """End an active run with `run`'s changes, its reply message (still in progress,
        found by the run's id: also one whose making the run's cancellation interrupted)
        with `message`'s and every step still in progress with `step`'s; one transaction.
        The run, message and those steps as they are then; None when the run had already
        ended (cancelled, expired or lapsed meanwhile, or its thread deleted)."""

        def work(s: Session) -> tuple[dict, dict | None, list[dict]] | None:
            ended = s.execute(
                update(Run).where(Run.id == run_id, Run.status.in_(LEASED)).values(**run)
            )
            if ended.rowcount == 0:
                return None
            row = s.scalar(select(Message).filter_by(run_id=run_id, status="in_progress"))
            if row is not None:
                for name, value in message.items():
                    setattr(row, name, value)
            steps = list(s.scalars(select(RunStep).filter_by(run_id=run_id, status="in_progress")))
            for step_row in steps:
                for name, value in step.items():
                    setattr(step_row, name, value)
            s.flush()
            reply = None if row is None else row.as_api()
            return find(s, Run, run_id).as_api(), reply, [r.as_api() for r in steps]

        return await self.db.work(work)

    async def get_step(self, thread_id: str, run_id: str, step_id: str, who: Who = None) -> dict:
        def work(s: Session) -> dict:
            find(s, Thread, thread_id, who)
            return find(s, RunStep, step_id, thread_id=thread_id, run_id=run_id).as_api()

        return await self.db.work(work)

    async def list_steps(self, thread_id: str, run_id: str, who: Who = None, **cursor: Any) -> dict:
        def work(s: Session) -> dict:
            find(s, Thread, thread_id, who)
            find(s, Run, run_id, thread_id=thread_id)
            return page(s, RunStep, run_id=run_id, **cursor)

        return await self.db.work(work)

    def refuse_if_running(self, s: Session, thread_id: str, message: str) -> None:
        active = select(Run).filter_by(thread_id=thread_id).where(Run.status.in_(RUN_ACTIVE))
        for run in s.scalars(active):
            if not self.end_if_lapsed(s, run):
                raise InvalidRequestError(
                    message.format(thread=thread_id, run=run.id), param="thread_id"
                )

    def end_if_lapsed(self, s: Session, row: Run) -> bool:
        """End `row` if its lease has lapsed (only if no one renewed it meanwhile), or if
        it waited for its tool outputs past its expires_at."""
        if row.status == "requires_action":
            return expire_if_waited_out(s, row)
        cutoff = time.time() - self.lease_s
        if row.status not in RUN_ACTIVE or row.leased_at >= cutoff:
            return False
        t = now()
        expired = row.expires_at is not None and t >= row.expires_at
        changes = {"status": "expired"} if expired else {"status": "failed", "failed_at": t}
        done = s.execute(
            update(Run)
            .where(Run.id == row.id, Run.status.in_(LEASED), Run.leased_at < cutoff)
            .values(**changes, last_error=None if expired else LAPSED_ERROR)
        )
        if done.rowcount == 0:
            return False
        s.execute(
            update(RunStep)
            .where(RunStep.run_id == row.id, RunStep.status == "in_progress")
            .values(status="failed", failed_at=t, last_error=LAPSED_ERROR)
        )
        s.execute(
            update(Message)
            .where(Message.run_id == row.id, Message.status == "in_progress")
            .values(
                status="incomplete", incomplete_at=t, incomplete_details={"reason": "run_failed"}
            )
        )
        s.refresh(row)
        return True


def _transition(s: Session, run_id: str, allowed: tuple[str, ...], changes: dict) -> dict:
    s.execute(update(Run).where(Run.id == run_id, Run.status.in_(allowed)).values(**changes))
    return find(s, Run, run_id).as_api()
