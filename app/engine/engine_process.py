"""EngineProcess: an EngineClient whose LLMEngine step loop runs in a child process
(app.engine.engine_child). See app.engine.client for the contract.

Why a process: the serving process runs an event loop that handles every token of every
stream (Ray's streaming, HTTP), and under load that Python work holds the GIL often
enough to stall the step loop's own Python between kernels. In its own process the step
loop never waits for it (vLLM's V1 engine core and SGLang's scheduler do the same).

Wire (a Unix socket pair, pickled tuples of typed values):
  parent -> child  (config_json, tp_master) once, then
                   ("add", EngineRequest) | ("abort", request_id)
                   | ("call", call_id, name, args) | ("stop",)
  child -> parent  ("ready", EngineInfo) | ("fatal", *error)
                   | ("deltas", [TokenDelta, ...], stalled_s)
                   | ("error", request_id, *error) | ("reply", call_id, ok, value)
where *error is (status_code, error_type, message, param) and a call's name is one of
the EngineClient queries (stats, slots, context_tokens, free_context, save_context,
restore_context). One "deltas" message per step (empty ones only as a heartbeat once a
second while busy); `stalled_s` says how long requests have waited with nothing
scheduled, which fails the health check past a limit. A step that schedules nothing is
followed by a short wait for a message, not a spin. Context files are written and read
by one worker thread of the child: a 4 GB save never stalls the step loop. The child
exits when the parent's end closes, so a killed replica never leaves an engine behind.
"""

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from typing import Any

from app.engine.client import EngineDeadError, EngineUnavailableError
from app.engine.config import EngineConfig
from app.engine.streams import DeltaStreams
from app.protocol.errors import RemoteError, ShoalError
from app.protocol.messages import EngineRequest
from app.protocol.outputs import ContextFile, EngineInfo, SlotInfo, TokenDelta

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
STALLED_POLL_S = 0.02  # after a step that scheduled nothing: wait this long for a message
CALL_TIMEOUT_S = 30.0  # a query waits for the step in progress at most
FILE_TIMEOUT_S = 600.0  # context files can be GBs, and wait for the ones queued before


def error_parts(exc: BaseException) -> tuple[int, str, str, str | None]:
    """An exception as the wire carries it; rebuilt as a RemoteError on the other side."""
    if isinstance(exc, ShoalError):
        return exc.status_code, exc.error_type, exc.message, exc.param
    return 500, "engine_error", f"{type(exc).__name__}: {exc}", None


class EngineProcess:
    def __init__(
        self,
        config: EngineConfig,
        tp_master: str | None = None,
        start_timeout_s: float = 900.0,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        """Start the child and wait until its model is loaded (a load failure is raised
        here, as a RemoteError). `tp_master`: with tensor_parallel_size > 1, the
        "host:port" where this engine (rank 0) meets its shards (app.engine.shard), which
        the caller starts. `on_death` is called (from the reader thread) after the engine
        died unasked and every stream got the error."""
        self.config = config
        self._on_death = on_death
        self._streams = DeltaStreams()
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self._stopping = False
        self._error: BaseException | None = None
        self._proc, self._conn = _spawn(config)
        try:
            self._conn.send((config.model_dump(mode="json"), tp_master))
            if not self._conn.poll(start_timeout_s):
                raise EngineDeadError(f"engine process did not start in {start_timeout_s:.0f}s")
            first = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._proc.kill()
            raise EngineDeadError(
                f"engine process exited at start-up (code {self._proc.wait()})"
            ) from exc
        except BaseException:
            self._proc.kill()
            raise
        if first[0] == "fatal":
            self._proc.wait()
            raise RemoteError(*first[1:])
        self.info: EngineInfo = first[1]
        self._last_message_at = time.monotonic()
        self._stalled_s = 0.0  # as of the last message
        self._reader = threading.Thread(target=self._read_loop, name="shoal-engine-io", daemon=True)
        self._reader.start()

    # ---- health -------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def is_alive(self) -> bool:
        return self._error is None and self._proc.poll() is None

    def check_health(self, stuck_after_s: float = 60.0, stalled_after_s: float = 60.0) -> None:
        if not self.is_alive:
            raise EngineDeadError(self._death())
        if len(self._streams) and time.monotonic() - self._last_message_at > stuck_after_s:
            raise EngineDeadError(f"engine has not completed a step in {stuck_after_s:.0f}s")
        if len(self._streams) and self._stalled_s > stalled_after_s:
            raise EngineDeadError(
                f"engine has had requests waiting and scheduled none for {self._stalled_s:.0f}s"
            )

    def _death(self) -> str:
        if self._error is not None:
            return str(self._error)
        return f"engine process exited with code {self._proc.poll()}"

    # ---- requests -----------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        if not self.is_alive:
            raise EngineUnavailableError(self._death())
        if not len(self._streams):
            self._last_message_at = time.monotonic()  # idle until now: not stuck
        rid = request.request_id
        queue = self._streams.open(rid)
        try:
            self._send(("add", request))
        except EngineDeadError as exc:
            self._streams.close(rid, queue)
            raise EngineUnavailableError(str(exc)) from exc
        except BaseException:
            self._streams.close(rid, queue)
            raise
        num_outputs = 1 if request.context is not None else request.params.n
        async for delta in self._streams.iterate(rid, queue, num_outputs, lambda: self.abort(rid)):
            yield delta

    def abort(self, request_id: str) -> None:
        if self.is_alive:
            with contextlib.suppress(EngineDeadError):
                self._send(("abort", request_id))

    # ---- queries ------------------------------------------------------------------
    async def stats(self) -> dict:
        return await self._call("stats")

    async def slots(self) -> list[SlotInfo]:
        return await self._call("slots")

    async def context_tokens(self, context_id: str) -> list[int]:
        return await self._call("context_tokens", context_id)

    async def free_context(self, context_id: str) -> int:
        return await self._call("free_context", context_id)

    async def save_context(
        self, context_id: str, path: str, quota_bytes: int | None = None
    ) -> ContextFile:
        args = (context_id, path, quota_bytes)
        return await self._call("save_context", *args, timeout_s=FILE_TIMEOUT_S)

    async def restore_context(self, context_id: str, path: str) -> ContextFile:
        args = (context_id, path)
        return await self._call("restore_context", *args, timeout_s=FILE_TIMEOUT_S)

    async def set_lora(self, name: str, path: str | None) -> None:
        await self._call("set_lora", name, path, timeout_s=FILE_TIMEOUT_S)

    async def _call(self, name: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """Run one of the child's named calls and return its value."""
        if not self.is_alive:
            raise EngineDeadError(self._death())
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (asyncio.get_running_loop(), future)
        try:
            self._send(("call", call_id, name, args))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        try:
            self._send(("stop",))
            self._proc.wait(timeout_s)
        except (EngineDeadError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()
        finally:
            self._conn.close()

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:  # ValueError: closed connection
            raise EngineDeadError(self._death()) from exc

    # ---- the reader thread --------------------------------------------------------
    def _read_loop(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                self._last_message_at = time.monotonic()
                kind = message[0]
                if kind == "deltas":
                    self._stalled_s = message[2]
                    self._streams.dispatch(message[1])
                elif kind == "error":
                    self._streams.fail(message[1], RemoteError(*message[2:]))
                elif kind == "reply":
                    self._resolve(*message[1:])
                elif kind == "fatal":
                    self._error = EngineDeadError(f"engine failed: {message[3]}")
        except (EOFError, OSError):
            pass
        self._fail_everything()

    def _fail_everything(self) -> None:
        """The child is gone: end every stream and call, then tell the owner."""
        if self._error is None and not self._stopping:
            self._error = EngineDeadError(self._death())
        if self._error is not None:
            logger.error("%s", self._error)
        error = self._error or EngineDeadError("engine stopped")
        self._streams.fail_all(error)
        for call_id in list(self._calls):
            self._resolve(call_id, False, error_parts(error))
        if self._error is not None and self._on_death is not None:
            self._on_death(self._error)

    def _resolve(self, call_id: int, ok: bool, value: Any) -> None:
        target = self._calls.get(call_id)
        if target is None:
            return
        loop, future = target

        def settle() -> None:
            if future.done():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(RemoteError(*value))

        with contextlib.suppress(RuntimeError):  # the caller's loop is closed
            loop.call_soon_threadsafe(settle)


def _spawn(config: EngineConfig) -> tuple[subprocess.Popen, Connection]:
    """The child process and this end of its socket."""
    parent_end, child_end = socket.socketpair()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    # Ray sets OMP_NUM_THREADS to the replica's num_cpus; the engine wants its own.
    env["OMP_NUM_THREADS"] = str(config.threads)
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.engine.engine_child", str(child_end.fileno())],
        pass_fds=[child_end.fileno()],
        env=env,
    )
    child_end.close()
    return proc, Connection(parent_end.detach())
