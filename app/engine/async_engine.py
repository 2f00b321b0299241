"""AsyncEngine: runs an LLMEngine's step loop in a background thread and streams each
request's token deltas to asyncio consumers.

Streaming contract: `generate` yields TokenDelta objects for one request; every one of
its `n` outputs ends with exactly one delta carrying a finish_reason; when the consumer
stops iterating (client gone, task cancelled) the request is aborted in the engine and
its KV blocks are freed before `generate` returns.
"""

import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence

import torch

from app.engine.engine import LLMEngine
from app.engine.streams import DeltaStreams
from app.protocol.outputs import TokenDelta
from app.protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop has stopped; the replica should be replaced."""


class EngineUnavailableError(EngineDeadError):
    """The engine was already dead when this request came: it never saw it, so it may be
    sent to another replica (unlike one that was inside the engine when it died)."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._streams = DeltaStreams()
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

    def check_health(self, stuck_after_s: float = 60.0, stalled_after_s: float = 60.0) -> None:
        """Raise when the loop is dead, busy but has not finished a step for too long, or
        has had work waiting with nothing scheduled for too long."""
        if not self.is_alive:
            raise EngineDeadError(f"engine loop is dead: {self._error!r}")
        if self.engine.has_work and time.monotonic() - self.last_step_at > stuck_after_s:
            raise EngineDeadError(f"engine loop has not completed a step in {stuck_after_s:.0f}s")
        if self.engine.stalled_s > stalled_after_s:
            raise EngineDeadError(
                f"engine has had requests waiting and scheduled none for "
                f"{self.engine.stalled_s:.0f}s"
            )

    # ---- requests -----------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        if not self.is_alive:
            raise EngineUnavailableError(f"engine loop is dead: {self._error!r}")
        queue = self._streams.open(request_id)
        try:
            self.engine.add_request(request_id, prompt_token_ids, params)
        except BaseException:
            self._streams.close(request_id, queue)
            raise
        self._wakeup.set()
        async for delta in self._streams.iterate(
            request_id, queue, params.n, lambda: self.abort(request_id)
        ):
            yield delta

    def abort(self, request_id: str) -> bool:
        aborted = self.engine.abort(request_id)
        self._wakeup.set()  # its blocks may let a waiting request in
        return aborted

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
                self._streams.dispatch(deltas)
                if not self.engine.last_step_scheduled:  # nothing fits: wait, do not spin
                    self._wakeup.wait(self._idle_wait_s)
                    self._wakeup.clear()
        except BaseException as exc:  # a bug in a step: fail every stream, then die
            logger.exception("engine step failed")
            self._error = exc
            self._streams.fail_all(EngineDeadError(f"engine failed: {exc!r}"))
