"""RunExecutor: carries out the Assistants API's runs in this ingress, one task each.

A run goes queued -> in_progress -> completed | incomplete (its token budget ran out) |
cancelled | failed | expired. Streamed or not, a run executes the same way: in its own
task, its events handed to a queue that a streaming response may read (a client that
leaves does not stop the run, as with OpenAI). While it runs, a watchdog renews its lease
every tick and stops it when a cancel was asked through any ingress (the run's status
is then `cancelling`), when it passes its `expires_at`, or when someone else ended it.
Its end (run, message and step) is written in one transaction that changes nothing if
the run had already ended, so no two endings overwrite each other.
"""

import asyncio
import contextlib
import logging
from typing import Any

from app.protocol.errors import ShoalError
from app.protocol.sampling import SamplingParams
from deployments.api.assistants.schema import output_constraint
from deployments.api.assistants.store import AssistantsStore
from deployments.api.assistants.thread_context import generate_in_thread
from deployments.http.chat_turn import ChatTurn, PreparedTurn, prepare
from deployments.ingress import Ingress
from deployments.state.assistants import RUN_ACTIVE
from deployments.state.base import now

logger = logging.getLogger("ray.serve")
END = None  # on a run's event queue: no more events
# More text a token than any tokenizer served here packs (long runs of spaces included):
# the bound of the text a run reads from its thread before it renders and trims it.
MAX_CHARS_PER_TOKEN = 32
STOPPED = {"code": "server_error", "message": "the server was stopped; create a new run"}


class RunExecutor:
    def __init__(self, ingress: Ingress, store: AssistantsStore) -> None:
        self.ingress = ingress
        self.runs = store.runs
        self.store = store
        self.tasks: dict[str, asyncio.Task] = {}
        self._why: dict[str, str] = {}  # run id -> why its task was cancelled
        self.tick_s = min(1.0, store.runs.lease_s / 3)

    def start(self, run: dict, tag: str, events: asyncio.Queue | None = None) -> None:
        """Carry out `run` (queued) in a task of its own; its events go to `events`,
        which gets END however the task ends (even cancelled before it began)."""
        emit = (lambda *_: None) if events is None else (lambda *e: events.put_nowait(e))
        task = asyncio.get_running_loop().create_task(self._execute(run, tag, emit))
        self.tasks[run["id"]] = task

        def done(_: asyncio.Task) -> None:
            self.tasks.pop(run["id"], None)
            self._why.pop(run["id"], None)
            if events is not None:
                events.put_nowait(END)

        task.add_done_callback(done)

    def stop(self, run_id: str, why: str = "cancelled") -> None:
        """Stop the run here, if this ingress carries it out (else its watchdog will)."""
        task = self.tasks.get(run_id)
        if task is not None:
            self._why.setdefault(run_id, why)
            task.cancel()

    async def shutdown(self) -> None:
        """The ingress stops: its runs end as failed (the client may start another)."""
        tasks = list(self.tasks.values())
        for run_id in list(self.tasks):
            self.stop(run_id, "stopped")
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    async def _execute(self, run: dict, tag: str, emit: Any) -> None:
        reply: dict[str, Any] = {"text": ""}
        watchdog = asyncio.get_running_loop().create_task(self._watch(run))
        try:
            status, fields = await self._generate(run, tag, emit, reply)
        except asyncio.CancelledError:
            status, fields = self._stopped(run["id"])
        except ShoalError as exc:
            codes = {429: "rate_limit_exceeded", 400: "invalid_prompt"}
            error = {"code": codes.get(exc.status_code, "server_error"), "message": exc.message}
            logger.warning("run %s failed: %s", run["id"], exc.message)
            status, fields = "failed", {"failed_at": now(), "last_error": error}
        except Exception as exc:  # never a run stuck in progress
            logger.exception("run %s failed", run["id"])
            error = {"code": "server_error", "message": f"internal error: {type(exc).__name__}"}
            status, fields = "failed", {"failed_at": now(), "last_error": error}
        finally:
            watchdog.cancel()  # no second cancel while the end is written
        try:
            await self._end(run, emit, reply, status, fields)
        except Exception:  # the database is away: the lease lapses and readers end it
            logger.exception("run %s: its end could not be written", run["id"])

    def _stopped(self, run_id: str) -> tuple[str, dict]:
        why = self._why.get(run_id, "cancelled")
        if why == "expired":
            return "expired", {}
        if why == "stopped":
            return "failed", {"failed_at": now(), "last_error": STOPPED}
        return "cancelled", {"cancelled_at": now()}  # also "ended": the end then changes nothing

    async def _generate(self, run: dict, tag: str, emit: Any, reply: dict) -> tuple[str, dict]:
        run_id, thread_id, model = run["id"], run["thread_id"], run["model"]
        begun = await self.runs.begin_run(run_id)
        if begun["status"] != "in_progress":  # cancelled (or ended) before it began
            self._why.setdefault(
                run_id, "cancelled" if begun["status"] == "cancelling" else "ended"
            )
            raise asyncio.CancelledError
        emit("thread.run.in_progress", begun)
        prepared = await self._prompt(run)
        prompt_ids = prepared.prompt_ids
        message, step = await self.runs.start_reply(run)
        emit("thread.run.step.created", step)
        emit("thread.run.step.in_progress", step)
        emit("thread.message.created", message)
        emit("thread.message.in_progress", message)
        params = await self._params(run, prepared)
        gen, reused = await generate_in_thread(
            self.ingress, model, thread_id, prompt_ids, params, tag, prepared.reasoning
        )
        async for d in gen.deltas():
            if d.text:
                reply["text"] += d.text
                part = {"index": 0, "type": "text", "text": {"value": d.text, "annotations": []}}
                delta = {"content": [part]}
                emit(
                    "thread.message.delta",
                    {"id": message["id"], "object": "thread.message.delta", "delta": delta},
                )
        logger.info(
            "run %s: %d prompt tokens, %d of them already in the thread's context; %d generated",
            run_id,
            len(prompt_ids),
            reused,
            gen.completion_tokens,
        )
        n = gen.completion_tokens
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": n}
        usage["total_tokens"] = len(prompt_ids) + n
        if gen.outputs[0].finish_reason == "length":
            return "incomplete", {
                "usage": usage,
                "incomplete_details": {"reason": "max_completion_tokens"},
            }
        return "completed", {"usage": usage, "completed_at": now()}

    async def _end(self, run: dict, emit: Any, reply: dict, status: str, fields: dict) -> None:
        """Write the run's end with its message's and step's, and emit their events."""
        t = now()
        if status == "completed":
            message = {"status": "completed", "completed_at": t}
        else:
            why = {"cancelled": "run_cancelled", "incomplete": "max_tokens"}
            details = {"reason": why.get(status, "run_failed")}
            message = {"status": "incomplete", "incomplete_at": t, "incomplete_details": details}
        message["text"] = reply["text"]
        step_status = "completed" if status in ("completed", "incomplete") else status
        step: dict[str, Any] = {"status": step_status}
        if step_status == "completed":
            step.update(completed_at=t, usage=fields.get("usage"))
        elif step_status in ("cancelled", "failed"):
            step.update({f"{step_status}_at": t, "last_error": fields.get("last_error")})
        ended = await self.runs.end_run(run["id"], {"status": status, **fields}, message, step)
        if ended is None:
            return  # it had ended already (cancelled, expired, lapsed, its thread deleted)
        run_now, message_now, step_now = ended
        if message_now is not None:
            emit(f"thread.message.{message_now['status']}", message_now)
        if step_now is not None:
            emit(f"thread.run.step.{step_now['status']}", step_now)
        emit(f"thread.run.{status}", run_now)

    async def _prompt(self, run: dict) -> PreparedTurn:
        """The conversation as a chat turn (chat_turn.py: rendered by the model's chat
        template, a reasoning model's thinking split off, the response format applied to
        the answer), with the run's instructions as the system message; the oldest
        messages left out when it does not fit the run's max_prompt_tokens or the model
        (OpenAI's `auto` truncation)."""
        system = [{"role": "system", "content": run["instructions"]}] if run["instructions"] else []
        constraint = output_constraint(run["response_format"])
        info = await self.ingress.info(run["model"])
        budget = info.max_model_len - 1
        if run["max_prompt_tokens"] is not None:
            budget = min(budget, run["max_prompt_tokens"])
        # Each message takes at least a token of its template, and a token no more than
        # MAX_CHARS_PER_TOKEN characters: what is left out here could never fit.
        messages = await self.store.conversation(
            run["thread_id"], budget * MAX_CHARS_PER_TOKEN, budget
        )
        while True:
            turn = ChatTurn(run["model"], system + messages, SamplingParams(), constraint)
            prepared = await prepare(self.ingress, turn)
            ids = prepared.prompt_ids
            if len(ids) <= budget:
                return prepared
            if len(messages) <= 1:
                raise PromptTooLongError(
                    f"the thread's last message alone takes {len(ids)} tokens, more than "
                    f"the run's budget of {budget}"
                )
            # Roughly the share that is too much, at least one message (few encodes).
            over = max(1, len(messages) * (len(ids) - budget) // len(ids))
            messages = messages[min(over, len(messages) - 1) :]

    async def _params(self, run: dict, prepared: PreparedTurn) -> SamplingParams:
        """As OpenAI: no cap but the model's context unless the run sets one."""
        info = await self.ingress.info(run["model"])
        room = max(1, info.max_model_len - len(prepared.prompt_ids))
        wanted = run["max_completion_tokens"] or room
        params: dict[str, Any] = {"max_tokens": min(wanted, room)}
        if run["temperature"] is not None:
            params["temperature"] = run["temperature"]
        if run["top_p"] is not None:
            params["top_p"] = run["top_p"]
        return SamplingParams(**params, constraint=prepared.params.constraint)

    async def _watch(self, run: dict) -> None:
        """Renew the run's lease every tick; stop the run when a cancel was asked, when it
        passed its expires_at, or when someone else ended it."""
        run_id = run["id"]
        while True:
            await asyncio.sleep(self.tick_s)
            with contextlib.suppress(Exception):  # a database hiccup: the next tick tries again
                status = (await self.runs.renew_lease(run_id))["status"]
                if status == "cancelling":
                    self.stop(run_id, "cancelled")
                elif status not in RUN_ACTIVE:
                    self.stop(run_id, "ended")
                elif run["expires_at"] is not None and now() >= run["expires_at"]:
                    self.stop(run_id, "expired")


class PromptTooLongError(ShoalError):
    status_code = 400
    error_type = "invalid_request_error"
