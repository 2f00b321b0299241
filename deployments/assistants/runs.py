"""RunExecutor: carries out the Assistants API's runs in this ingress, one task each.

A run goes queued -> in_progress -> completed | incomplete (its token budget ran out) |
cancelled | failed, written to the store at each step together with its run step and the
assistant's message. Streamed or not, a run executes the same way: in its own task, its
events handed to a queue that a streaming response may read (a client that leaves
does not stop the run, as with OpenAI). While it runs its task renews the run's lease,
and a cancel asked through any ingress (the run's status becomes `cancelling`) cancels
it here within a lease tick.
"""

import asyncio
import contextlib
import logging
from typing import Any

from app.protocol.errors import ShoalError
from app.protocol.sampling import SamplingParams
from deployments.assistants.schema import now
from deployments.assistants.store import AssistantsStore
from deployments.assistants.thread_context import generate_in_thread
from deployments.ingress import Ingress

logger = logging.getLogger("ray.serve")
END = None  # on a run's event queue: no more events


def event(name: str, data: dict) -> tuple[str, dict]:
    return name, data


class RunExecutor:
    def __init__(self, ingress: Ingress, store: AssistantsStore) -> None:
        self.ingress = ingress
        self.store = store
        self.tasks: dict[str, asyncio.Task] = {}
        self.tick_s = min(1.0, store.lease_s / 3)

    def start(self, run: dict, tag: str, events: asyncio.Queue | None = None) -> None:
        """Execute `run` (queued) in a task of its own; its events go to `events`."""
        task = asyncio.get_running_loop().create_task(self._execute(run, tag, events))
        self.tasks[run["id"]] = task
        task.add_done_callback(lambda _: self.tasks.pop(run["id"], None))

    def cancel(self, run_id: str) -> None:
        """Cancel the run here, if this ingress executes it (else its lease tick does)."""
        task = self.tasks.get(run_id)
        if task is not None:
            task.cancel()

    async def shutdown(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def _execute(self, run: dict, tag: str, events: asyncio.Queue | None) -> None:
        def emit(name: str, data: dict) -> None:
            if events is not None:
                events.put_nowait((name, data))

        state: dict[str, Any] = {"text": "", "message": None, "step": None}
        watchdog = asyncio.get_running_loop().create_task(self._watch(run["id"]))
        try:
            await self._generate(run, tag, emit, state)
        except asyncio.CancelledError:
            await self._end(run, emit, state, "cancelled", cancelled_at=now())
        except ShoalError as exc:
            code = "rate_limit_exceeded" if exc.status_code == 429 else "server_error"
            if exc.status_code == 400:
                code = "invalid_prompt"
            error = {"code": code, "message": exc.message}
            logger.warning("run %s failed: %s", run["id"], exc.message)
            await self._end(run, emit, state, "failed", failed_at=now(), last_error=error)
        except Exception as exc:  # never a run stuck in progress
            logger.exception("run %s failed", run["id"])
            error = {"code": "server_error", "message": f"internal error: {type(exc).__name__}"}
            await self._end(run, emit, state, "failed", failed_at=now(), last_error=error)
        finally:
            watchdog.cancel()
            if events is not None:
                events.put_nowait(END)

    async def _generate(self, run: dict, tag: str, emit: Any, state: dict) -> None:
        store, run_id, thread_id = self.store, run["id"], run["thread_id"]
        emit(
            "thread.run.in_progress",
            await store.set_run(run_id, status="in_progress", started_at=now()),
        )
        model = run["model"]
        prompt_ids = await self._prompt(run)
        message = await store.add_message(
            thread_id,
            role="assistant",
            text="",
            status="in_progress",
            assistant_id=run["assistant_id"],
            run_id=run_id,
        )
        state["message"] = message
        step = state["step"] = await store.create_step(run, message["id"])
        emit("thread.run.step.created", step)
        emit("thread.run.step.in_progress", step)
        emit("thread.message.created", message)
        emit("thread.message.in_progress", message)
        params = await self._params(run, len(prompt_ids))
        gen, reused = await generate_in_thread(
            self.ingress, model, thread_id, prompt_ids, params, tag
        )
        state["generation"] = gen
        async for d in gen.deltas():
            if not d.text:
                continue
            state["text"] += d.text
            part = {"index": 0, "type": "text", "text": {"value": d.text, "annotations": []}}
            emit(
                "thread.message.delta",
                {
                    "id": message["id"],
                    "object": "thread.message.delta",
                    "delta": {"content": [part]},
                },
            )
        out = gen.outputs[0]
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": gen.completion_tokens,
            "total_tokens": len(prompt_ids) + gen.completion_tokens,
        }
        logger.info(
            "run %s: %d prompt tokens, %d already in the thread's context, %d generated",
            run_id,
            len(prompt_ids),
            reused,
            gen.completion_tokens,
        )
        if out.finish_reason == "length":
            await self._end(
                run,
                emit,
                state,
                "incomplete",
                usage=usage,
                incomplete_details={"reason": "max_completion_tokens"},
            )
        else:
            await self._end(run, emit, state, "completed", usage=usage, completed_at=now())

    async def _end(self, run: dict, emit: Any, state: dict, status: str, **fields: Any) -> None:
        """Write the run's end, its message's and its step's, and emit their events."""
        store, t = self.store, now()
        message, step = state["message"], state["step"]
        if message is not None:
            if status == "completed":
                changes = {"status": "completed", "completed_at": t}
            else:
                reason = {"cancelled": "run_cancelled", "failed": "run_failed"}.get(
                    status, "max_tokens"
                )
                changes = {
                    "status": "incomplete",
                    "incomplete_at": t,
                    "incomplete_details": {"reason": reason},
                }
            message = await store.set_message(message["id"], text=state["text"], **changes)
            emit(f"thread.message.{message['status']}", message)
        if step is not None:
            step_status = {"incomplete": "completed"}.get(status, status)
            step_fields = {"usage": fields.get("usage")} if step_status == "completed" else {}
            if status in ("cancelled", "failed"):
                step_fields[f"{status}_at"] = t
                step_fields["last_error"] = fields.get("last_error")
            else:
                step_fields["completed_at"] = t
            emit(
                f"thread.run.step.{step_status}",
                await store.set_step(step["id"], status=step_status, **step_fields),
            )
        ended = await store.set_run(run["id"], status=status, **fields)
        emit(f"thread.run.{status}", ended)

    async def _prompt(self, run: dict) -> list[int]:
        """The conversation as the model's chat template renders it, with the run's
        instructions as the system message; the oldest messages left out when it does not
        fit the run's max_prompt_tokens or the model (OpenAI's `auto` truncation)."""
        messages = await self.store.conversation(run["thread_id"])
        system = [{"role": "system", "content": run["instructions"]}] if run["instructions"] else []
        info = await self.ingress.info(run["model"])
        budget = info.max_model_len - 1
        if run["max_prompt_tokens"] is not None:
            budget = min(budget, run["max_prompt_tokens"])
        while True:
            ids = await self.ingress.encode_chat(run["model"], system + messages)
            if len(ids) <= budget:
                return ids
            if len(messages) <= 1:
                raise _PromptTooLong(
                    f"the thread's last message alone takes {len(ids)} tokens, more than the run's budget of {budget}"
                )
            messages = messages[1:]

    async def _params(self, run: dict, num_prompt: int) -> SamplingParams:
        info = await self.ingress.info(run["model"])
        room = max(1, info.max_model_len - num_prompt)
        wanted = run["max_completion_tokens"] or self.ingress.config.max_tokens_default
        params: dict[str, Any] = {"max_tokens": min(wanted, room)}
        if run["temperature"] is not None:
            params["temperature"] = run["temperature"]
        if run["top_p"] is not None:
            params["top_p"] = run["top_p"]
        return SamplingParams(**params)

    async def _watch(self, run_id: str) -> None:
        """Renew the run's lease every tick; cancel the run when someone asked to."""
        while True:
            await asyncio.sleep(self.tick_s)
            with contextlib.suppress(Exception):  # a database hiccup: the next tick tries again
                if await self.store.renew_lease(run_id) == "cancelling":
                    self.cancel(run_id)


class _PromptTooLong(ShoalError):
    status_code = 400
    error_type = "invalid_request_error"
