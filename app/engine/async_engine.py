"""AsyncEngine: an EngineClient that runs an LLMEngine's step loop in a thread of this
process (tests, benchmarks, in-process serving). See app.engine.client for the contract.

Stats, slots and context lookups are answered on the caller's thread (they take the
engine's lock between forwards); context files are written and read by one worker thread
of their own, never by the step loop.
"""

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from app.engine.client import EngineDeadError, EngineUnavailableError
from app.engine.context_files import ContextFiles
from app.engine.engine import LLMEngine
from app.engine.openmp_threads import release_pool, run_then_release
from app.engine.streams import DeltaStreams
from app.protocol.messages import EngineRequest
from app.protocol.outputs import ContextFile, EngineInfo, SlotInfo, TokenDelta

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.info = EngineInfo(
            engine.source.name, engine.max_model_len, engine.loaded.vision is not None
        )
        self._idle_wait_s = idle_wait_s
        self._streams = DeltaStreams()
        self._files = ContextFiles(engine)
        # One at a time: each holds a copy of a context's KV, and a save's quota check
        # must see the file of the save before it.
        self._file_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-slot-io")
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self.last_step_at = time.monotonic()
        release_pool()  # the loading thread's OpenMP workers would halve the loop's speed
        self._thread = threading.Thread(target=self._loop, name="shoal-engine", daemon=True)
        self._thread.start()

    # ---- health -------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def check_health(self, stuck_after_s: float = 60.0, stalled_after_s: float = 60.0) -> None:
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
    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        if not self.is_alive:
            raise EngineUnavailableError(f"engine loop is dead: {self._error!r}")
        rid = request.request_id
        queue = self._streams.open(rid)
        try:
            self.engine.add_request(
                rid, request.prompt_token_ids, request.params, request.context, request.images
            )
        except BaseException:
            self._streams.close(rid, queue)
            raise
        self._wakeup.set()
        num_outputs = 1 if request.context is not None else request.params.n
        async for delta in self._streams.iterate(rid, queue, num_outputs, lambda: self.abort(rid)):
            yield delta

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wakeup.set()  # its blocks may let a waiting request in

    # ---- queries ------------------------------------------------------------------
    async def stats(self) -> dict:
        self._raise_if_dead()
        return self.engine.stats_snapshot()

    async def slots(self) -> list[SlotInfo]:
        self._raise_if_dead()
        return self.engine.slots()

    async def context_tokens(self, context_id: str) -> list[int]:
        self._raise_if_dead()
        return self.engine.context_tokens(context_id)

    async def free_context(self, context_id: str) -> int:
        self._raise_if_dead()
        held = self.engine.free_context(context_id)
        self._wakeup.set()  # its blocks may let a waiting request in
        return held

    async def save_context(
        self, context_id: str, path: str, quota_bytes: int | None = None
    ) -> ContextFile:
        return await self._in_file_thread(self._files.save, context_id, path, quota_bytes)

    async def restore_context(self, context_id: str, path: str) -> ContextFile:
        return await self._in_file_thread(self._files.restore, context_id, path)

    async def set_lora(self, name: str, path: str | None) -> None:
        self._raise_if_dead()
        await asyncio.to_thread(self.engine.set_lora, name, path)

    async def _in_file_thread(self, fn: Callable[..., ContextFile], *args: object) -> ContextFile:
        self._raise_if_dead()
        return await asyncio.get_running_loop().run_in_executor(
            self._file_io, run_then_release, fn, *args
        )

    def _raise_if_dead(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"engine loop is dead: {self._error!r}")

    def shutdown(self) -> None:
        self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout=30)
        self._file_io.shutdown(wait=False, cancel_futures=True)

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
