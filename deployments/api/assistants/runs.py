"""RunExecutor: carries out the Assistants API's runs in this ingress, one task each.

A run goes queued -> in_progress -> completed | incomplete (its token budget ran out) |
cancelled | failed | expired, or requires_action when the model called its functions:
the client's tool outputs (submit_tool_outputs) put it back in progress, and it is
carried out again from there, on the thread's warm context (the thread's conversation,
then the calls and their outputs). Tools: run_search.py (file_search, before the run
generates) and run_calls.py (function calls, read as the output streams).

Streamed or not, a run executes the same way: in its own task, its events handed to a
queue that a streaming response may read (a client that leaves does not stop the run,
as with OpenAI). While it runs, a watchdog renews its lease every tick and stops it when
a cancel was asked through any ingress (the run's status is then `cancelling`), when it
passes its `expires_at`, or when someone else ended it. Its end (run, message and
steps), or its wait for tool outputs, is written in one transaction that changes nothing
if the run had already ended, so no two endings overwrite each other.
"""

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from app.protocol.errors import ShoalError
from app.protocol.sampling import SamplingParams
from deployments.api.assistants.run_calls import Reply, required_action, shown_tools
from deployments.api.assistants.run_search import search_for_run, searched
from deployments.api.assistants.schema import output_constraint
from deployments.api.assistants.store import AssistantsStore
from deployments.api.assistants.thread_context import generate_in_thread
from deployments.http.chat_turn import ChatTurn, PreparedTurn, prepare
from deployments.ingress import Ingress
from deployments.retrieval.excerpts import citations
from deployments.retrieval.service import Retrieval
from deployments.state.assistants import RUN_ACTIVE
from deployments.state.base import now

logger = logging.getLogger("ray.serve")
END = None  # on a run's event queue: no more events
# More text a token than any tokenizer served here packs (long runs of spaces included):
# the bound of the text a run reads from its thread before it renders and trims it.
MAX_CHARS_PER_TOKEN = 32
STOPPED = {"code": "server_error", "message": "the server was stopped; create a new run"}


class RunExecutor:
    def __init__(
        self,
        ingress: Ingress,
        store: AssistantsStore,
        retrieval: Callable[[], Retrieval | None] = lambda: None,
    ) -> None:
        self.ingress = ingress
        self.runs = store.runs
        self.store = store
        # Looked up when a run searches: vector stores are made after the Assistants.
        self.retrieval = retrieval
        self.tasks: dict[str, asyncio.Task] = {}
        self._why: dict[str, str] = {}  # run id -> why its task was cancelled
        self.tick_s = min(1.0, store.runs.lease_s / 3)

    def start(
        self,
        run: dict,
        tag: str,
        events: asyncio.Queue | None = None,
        include: list[str] | None = None,
    ) -> None:
        """Carry out `run` (queued, or in progress again after its tool outputs) in a
        task of its own; its events go to `events`, which gets END however the task ends
        (even cancelled before it began). `include`: as the run's (run_search.py)."""
        emit = (lambda *_: None) if events is None else (lambda *e: events.put_nowait(e))
        work = self._execute(run, tag, emit, include or [])
        task = asyncio.get_running_loop().create_task(work)
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

    async def _execute(self, run: dict, tag: str, emit: Any, include: list[str]) -> None:
        reply: dict[str, Any] = {}  # what the end writes: the Reply, its annotations
        watchdog = asyncio.get_running_loop().create_task(self._watch(run))
        try:
            status, fields = await self._generate(run, tag, emit, reply, include)
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

    async def _begin(self, run: dict, emit: Any) -> dict:
        """queued -> in_progress (a run after its tool outputs is in progress already)."""
        run_id = run["id"]
        if run["status"] == "queued":
            begun = await self.runs.begin_run(run_id)
        else:
            begun = await self.runs.renew_lease(run_id)
        if begun["status"] != "in_progress":  # cancelled (or ended) before it began
            self._why.setdefault(
                run_id, "cancelled" if begun["status"] == "cancelling" else "ended"
            )
            raise asyncio.CancelledError
        emit("thread.run.in_progress", begun)
        return await self.runs.work_of(run_id)

    async def _generate(
        self, run: dict, tag: str, emit: Any, box: dict, include: list[str]
    ) -> tuple[str, dict]:
        run = await self._begin(run, emit)
        run_id, thread_id, model = run["id"], run["thread_id"], run["model"]
        continuing = bool(run["tool_turns"])  # after tool outputs: searched already
        box["prelude"] = run["tool_turns"]  # the reply renders after them in later runs
        if continuing:
            found = await searched(self.store, run)
        else:
            found = await search_for_run(self.store, self.retrieval, run, emit, include)
        prepared = await self._prompt(run, continuing)
        prompt_ids = prepared.prompt_ids
        reply = box["reply"] = Reply(self.runs, run, emit, prepared.tool_format)
        if prepared.tool_format is None:
            await reply.open()
        params = await self._params(run, prepared)
        gen, reused = await generate_in_thread(
            self.ingress, model, thread_id, prompt_ids, params, tag, prepared.reasoning
        )
        async for d in gen.deltas():
            await reply.feed(d.text, d.finish_reason is not None)
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
        box["usage"] = usage
        total = _added(run["usage"], usage)  # with its generations before the outputs
        cut = gen.outputs[0].finish_reason == "length"
        calls = reply.tool_calls()
        if calls and not cut:
            changes = {
                "required_action": required_action(calls),
                "tool_turns": [*run["tool_turns"], reply.turn(calls)],
                "usage": total,
            }
            return "requires_action", {"changes": changes, "calls": calls, "usage": usage}
        if found is not None:
            box["annotations"] = citations(reply.text, found)
        if cut:
            return "incomplete", {
                "usage": total,
                "incomplete_details": {"reason": "max_completion_tokens"},
            }
        return "completed", {"usage": total, "completed_at": now()}

    async def _wait_for_outputs(self, run: dict, emit: Any, reply: Reply, fields: dict) -> bool:
        """The run waits for its calls' outputs; False when it had been cancelled or
        ended meanwhile."""
        assert reply.step is not None  # its first call made it
        step_id = reply.step["id"]
        got = await self.runs.tools.await_outputs(
            run["id"], fields["changes"], step_id, fields["calls"], fields["usage"]
        )
        if got is None:
            return False
        run_now, _ = got
        emit("thread.run.requires_action", run_now)
        return True

    async def _end(self, run: dict, emit: Any, box: dict, status: str, fields: dict) -> None:
        """Write the run's end with its message's and steps', and emit their events (or,
        when the model called functions, the run's wait for their outputs)."""
        reply: Reply | None = box.get("reply")
        if status == "requires_action":
            assert reply is not None
            if await self._wait_for_outputs(run, emit, reply, fields):
                return
            status, fields = "cancelled", {"cancelled_at": now()}  # or ended: nothing changes
        if status in ("completed", "incomplete") and reply is not None:
            await reply.open()  # a reply that wrote nothing is an empty message
        t = now()
        if status == "completed":
            message = {"status": "completed", "completed_at": t}
        else:
            why = {"cancelled": "run_cancelled", "incomplete": "max_tokens"}
            details = {"reason": why.get(status, "run_failed")}
            message = {"status": "incomplete", "incomplete_at": t, "incomplete_details": details}
        message["text"] = "" if reply is None else reply.text
        message["annotations"] = box.get("annotations") or []
        if box.get("prelude"):
            message["prelude"] = box["prelude"]
        step_status = "completed" if status in ("completed", "incomplete") else status
        step: dict[str, Any] = {"status": step_status}
        if step_status == "completed":
            step.update(completed_at=t, usage=box.get("usage"))  # this generation's
        elif step_status in ("cancelled", "failed", "expired"):
            step[f"{step_status}_at"] = t
            step["last_error"] = fields.get("last_error")
        ended = await self.runs.end_run(run["id"], {"status": status, **fields}, message, step)
        if ended is None:
            return  # it had ended already (cancelled, expired, lapsed, its thread deleted)
        run_now, message_now, steps_now = ended
        if message_now is not None:
            emit(f"thread.message.{message_now['status']}", message_now)
        for step_now in steps_now:
            emit(f"thread.run.step.{step_now['status']}", step_now)
        emit(f"thread.run.{status}", run_now)

    async def _prompt(self, run: dict, continuing: bool) -> PreparedTurn:
        """The conversation as a chat turn (chat_turn.py: rendered by the model's chat
        template with the run's functions, a reasoning model's thinking split off, the
        response format applied to the answer), with the run's instructions as the
        system message and, after tool outputs, the run's calls and their outputs last;
        the oldest messages left out when it does not fit the run's max_prompt_tokens or
        the model (OpenAI's `auto` truncation)."""
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
        tools, choice = shown_tools(run, continuing)
        while True:
            turn = ChatTurn(
                run["model"],
                system + messages + run["tool_turns"],
                SamplingParams(),
                constraint,
                tools=tools,
                tool_choice=choice,
                parallel_tool_calls=run["parallel_tool_calls"],
            )
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
            messages = _whole_turns(messages[min(over, len(messages) - 1) :])

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


def _whole_turns(messages: list[dict]) -> list[dict]:
    """Start at a message, not amid the calls and tool outputs before a reply (a template
    may refuse outputs without their call)."""
    start = 0
    while start < len(messages) - 1 and (
        messages[start]["role"] == "tool" or messages[start].get("tool_calls")
    ):
        start += 1
    return messages[start:]


def _added(before: dict | None, usage: dict) -> dict:
    return {k: v + (before or {}).get(k, 0) for k, v in usage.items()}


class PromptTooLongError(ShoalError):
    status_code = 400
    error_type = "invalid_request_error"
