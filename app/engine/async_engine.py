"""AsyncEngine: runs an LLMEngine's step loop in a background thread and streams each
request's token deltas to asyncio consumers.

Streaming contract: `generate` yields TokenDelta objects for one request; every one of
its `n` outputs ends with exactly one delta carrying a finish_reason; when the consumer
stops iterating (client gone, task cancelled) the request is aborted in the engine and
its KV blocks are freed before `generate` returns.
"""

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence

import torch

from app.engine.engine import LLMEngine
from app.protocol.outputs import TokenDelta
from app.protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop has stopped; the replica should be replaced."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self.last_step_at = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="shoal-engine", daemon=True)
        self._thread.start()

    # ---- health -------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def check_health(self, stuck_after_s: float = 60.0) -> None:
        """Raise when the loop is dead, or busy but has not finished a step for too long."""
        if not self.is_alive:
            raise EngineDeadError(f"engine loop is dead: {self._error!r}")
        if self.engine.has_work and time.monotonic() - self.last_step_at > stuck_after_s:
            raise EngineDeadError(f"engine loop has not completed a step in {stuck_after_s:.0f}s")

    # ---- requests -----------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        if not self.is_alive:
            raise EngineDeadError(f"engine loop is dead: {self._error!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add_request(request_id, prompt_token_ids, params)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        self._wakeup.set()
        open_outputs = params.n
        try:
            while open_outputs:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    open_outputs -= 1
                yield item
        finally:
            self._queues.pop(request_id, None)
            if open_outputs:
                self.engine.abort(request_id)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def shutdown(self) -> None:
        self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout=30)

    # ---- the loop -----------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_num_threads(self.engine.config.threads)
        try:
            while not self._stopping.is_set():
                if not self.engine.has_work:
                    self._wakeup.wait(self._idle_wait_s)
                    self._wakeup.clear()
                    self.last_step_at = time.monotonic()
                    continue
                deltas = self.engine.step()
                self.last_step_at = time.monotonic()
                self._dispatch(deltas)
        except BaseException as exc:  # a bug in a step: fail every stream, then die
            logger.exception("engine step failed")
            self._error = exc
            for loop, queue in list(self._queues.values()):
                loop.call_soon_threadsafe(
                    queue.put_nowait, EngineDeadError(f"engine failed: {exc!r}")
                )

    def _dispatch(self, deltas: list[TokenDelta]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, TokenDelta]]] = {}
        for delta in deltas:
            target = self._queues.get(delta.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], delta))
        for loop, items in by_loop.items():
            # A closed event loop raises RuntimeError: its consumers are gone anyway.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, TokenDelta]]) -> None:
    for queue, delta in items:
        queue.put_nowait(delta)
