"""A run's tool steps in the database: a file_search done, calls that wait for their
outputs (`requires_action`), the outputs submitted, and a wait that expired.

As in run_store.py, every transition is one conditional UPDATE, so a submission that
lands after the run was cancelled or expired changes nothing, and is refused.

A run waiting for its outputs is active (it holds its thread: RUN_ACTIVE) but no ingress
works on it, so it has no lease: it expires at its `expires_at` (ten minutes after it
asked, as OpenAI's), whoever reads it next.
"""

import time
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from app.protocol.errors import InvalidRequestError
from deployments.http.caller import Caller
from deployments.state.assistants import Message, Run, RunStep, Thread
from deployments.state.base import new_id, now
from deployments.state.database import Database, find

RUN_EXPIRES_AFTER_S = 600  # OpenAI's: a run not done (or not answered) in ten minutes expires
# Who asks (OWNERS in state/assistants.py): a run is its thread's, so a thread another
# key made is a 404 before its runs are looked at. None: the server itself, sees all.
Who = Caller | None


class ToolStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def tool_step(self, run: dict, tool_calls: list[dict], done: bool) -> dict:
        """A tool_calls step of the run: done (a file_search) or in progress (calls the
        model is making)."""

        def work(s: Session) -> dict:
            step = RunStep(
                id=new_id("step"),
                run_id=run["id"],
                thread_id=run["thread_id"],
                assistant_id=run["assistant_id"],
                type="tool_calls",
                tool_calls=tool_calls,
                status="completed" if done else "in_progress",
                completed_at=now() if done else None,
            )
            s.add(step)
            s.flush()
            return step.as_api()

        return await self.db.work(work)

    async def await_outputs(
        self, run_id: str, changes: dict, step_id: str, tool_calls: list[dict], usage: dict
    ) -> tuple[dict, dict] | None:
        """The run (in progress) waits for its calls' outputs: `changes` (its
        required_action, tool turns, usage) and a new expires_at; the step holds the
        calls; the reply message begun meanwhile (text before the calls) goes, with its
        step: the calls' turn carries that text. None when the run had ended or is being
        cancelled."""

        def work(s: Session) -> tuple[dict, dict] | None:
            waits = s.execute(
                update(Run)
                .where(Run.id == run_id, Run.status == "in_progress")
                .values(
                    status="requires_action",
                    expires_at=now() + RUN_EXPIRES_AFTER_S,
                    **changes,
                )
            )
            if waits.rowcount == 0:
                return None
            step = find(s, RunStep, step_id)
            step.tool_calls, step.usage = tool_calls, usage
            begun = select(Message.id).filter_by(run_id=run_id, status="in_progress")
            ids = list(s.scalars(begun))
            if ids:
                s.execute(delete(RunStep).where(RunStep.message_id.in_(ids)))
                s.execute(delete(Message).where(Message.id.in_(ids)))
            s.flush()
            return find(s, Run, run_id).as_api(), step.as_api()

        return await self.db.work(work)

    async def submit_outputs(
        self, thread_id: str, run_id: str, outputs: list[dict], who: Who = None
    ) -> tuple[dict, dict, dict]:
        """Take the outputs of every call the run waits for (400 unless it waits, and
        unless each call has exactly one output): its step completes with them, and the
        run goes back in progress, its tool turns ending with the outputs as `tool`
        messages. The run (as its executor continues it), its step, and the run as shown."""

        def work(s: Session) -> tuple[dict, dict, dict]:
            find(s, Thread, thread_id, who)
            row = find(s, Run, run_id, thread_id=thread_id)
            expire_if_waited_out(s, row)
            if row.status != "requires_action":
                raise InvalidRequestError(
                    f'Runs in status "{row.status}" do not accept tool outputs.', param="run_id"
                )
            calls = row.required_action["submit_tool_outputs"]["tool_calls"]
            by_id = _one_each([c["id"] for c in calls], outputs)
            step = s.scalar(
                select(RunStep).filter_by(run_id=run_id, type="tool_calls", status="in_progress")
            )
            if step is not None:
                step.tool_calls = [_answered(c, by_id.get(c["id"])) for c in step.tool_calls]
                step.status, step.completed_at = "completed", now()
            results = [
                {"role": "tool", "tool_call_id": c["id"], "content": by_id[c["id"]]} for c in calls
            ]
            changes: dict[str, Any] = {
                "status": "in_progress",
                "required_action": None,
                "tool_turns": [*(row.tool_turns or []), *results],
                "expires_at": now() + RUN_EXPIRES_AFTER_S,
                "leased_at": time.time(),
            }
            moved = s.execute(
                update(Run)
                .where(Run.id == run_id, Run.status == "requires_action")
                .values(**changes)
            )
            if moved.rowcount == 0:  # cancelled or expired since the read
                raise InvalidRequestError("The run no longer waits for tool outputs.", "run_id")
            s.flush()
            s.refresh(row)
            shown = None if step is None else step.as_api()
            return row.as_work(), shown, row.as_api()

        return await self.db.work(work)


def _one_each(call_ids: list[str], outputs: list[dict]) -> dict[str, str]:
    given = [o["tool_call_id"] for o in outputs]
    unknown = [i for i in given if i not in call_ids]
    missing = [i for i in call_ids if i not in given]
    if unknown or missing or len(set(given)) != len(given):
        why = []
        if unknown:
            why.append(f"no call has the id(s) {', '.join(unknown)}")
        if missing:
            why.append(f"no output for {', '.join(missing)}")
        if len(set(given)) != len(given):
            why.append("a call has more than one output")
        raise InvalidRequestError(
            "tool_outputs: give one output for each tool call: " + "; ".join(why), "tool_outputs"
        )
    return {o["tool_call_id"]: o["output"] for o in outputs}


def _answered(call: dict, output: str | None) -> dict:
    return {**call, "function": {**call["function"], "output": output}}


def expire_if_waited_out(s: Session, row: Run) -> bool:
    """End `row` as expired if it waited for its tool outputs past its expires_at (only
    if it still waits); its step expires with it, and the thread is free again."""
    t = now()
    if row.status != "requires_action" or row.expires_at is None or t < row.expires_at:
        return False
    done = s.execute(
        update(Run)
        .where(Run.id == row.id, Run.status == "requires_action")
        .values(status="expired", required_action=None)
    )
    if done.rowcount == 0:
        return False
    _end_waiting_step(s, row.id, {"status": "expired", "expired_at": t})
    s.refresh(row)
    return True


def cancel_waiting(s: Session, row: Run) -> bool:
    """Cancel `row` at once if it waits for tool outputs (no ingress works on it)."""
    t = now()
    done = s.execute(
        update(Run)
        .where(Run.id == row.id, Run.status == "requires_action")
        .values(status="cancelled", cancelled_at=t, required_action=None)
    )
    if done.rowcount == 0:
        return False
    _end_waiting_step(s, row.id, {"status": "cancelled", "cancelled_at": t})
    s.refresh(row)
    return True


def _end_waiting_step(s: Session, run_id: str, changes: dict) -> None:
    s.execute(
        update(RunStep)
        .where(RunStep.run_id == run_id, RunStep.status == "in_progress")
        .values(**changes)
    )
