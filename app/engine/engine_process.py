"""EngineProcess: an LLMEngine's step loop in a child process, streamed to asyncio consumers.

Why a process: the serving process runs an event loop that handles every token of every
stream (Ray's streaming, HTTP), and under load that Python work holds the GIL often
enough to stall the step loop's own Python between kernels. In its own process the step
loop never waits for it (vLLM's V1 engine core and SGLang's scheduler do the same).

Wire (a Unix socket pair, pickled tuples):
  parent -> child  ("add", request_id, prompt_ids, params) | ("abort", request_id)
                   | ("call", call_id, name, args) | ("stop",)
  child -> parent  ("ready", info) | ("fatal", *error)
                   | ("deltas", [TokenDelta, ...], stalled_s)
                   | ("error", request_id, *error) | ("reply", call_id, ok, value)
where *error is (status_code, error_type, message, param). One "deltas" message per step
(empty ones only as a heartbeat once a second while busy); `stalled_s` says how long
requests have waited with nothing scheduled, which fails the health check past a limit.
A step that schedules nothing is followed by a short wait for a message, not a spin.
Slot file calls run in a thread of the child: a 4 GB save never stalls the step loop.
The child exits when the parent's end closes, so a killed replica never leaves an engine
behind.

Same streaming contract as AsyncEngine: `generate` yields one request's deltas, and a
consumer that stops early aborts the request in the engine.
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
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from app.engine.async_engine import EngineDeadError, EngineUnavailableError
from app.engine.config import EngineConfig
from app.engine.streams import DeltaStreams
from app.protocol.errors import RemoteError, ShoalError
from app.protocol.messages import ContextOp
from app.protocol.outputs import TokenDelta
from app.protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
STALLED_POLL_S = 0.02  # after a step that scheduled nothing: wait this long for a message


def _error_parts(exc: BaseException) -> tuple[int, str, str, str | None]:
    if isinstance(exc, ShoalError):
        return exc.status_code, exc.error_type, exc.message, exc.param
    return 500, "engine_error", f"{type(exc).__name__}: {exc}", None


# ---- parent side -----------------------------------------------------------------------
class EngineProcess:
    def __init__(
        self,
        config: EngineConfig,
        tp_master: str | None = None,
        start_timeout_s: float = 900.0,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`tp_master`: with tensor_parallel_size > 1, the "host:port" where this engine
        (rank 0) meets its shards (app.engine.shard), which the caller starts.
        `on_death` is called (from the reader thread) after the engine died unasked and
        every stream got the error."""
        self.config = config
        self._on_death = on_death
        self._streams = DeltaStreams()
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self._stopping = False
        self._error: BaseException | None = None
        parent_end, child_end = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # Ray sets OMP_NUM_THREADS to the replica's num_cpus; the engine wants its own.
        env["OMP_NUM_THREADS"] = str(config.threads)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "app.engine.engine_process", str(child_end.fileno())],
            pass_fds=[child_end.fileno()],
            env=env,
        )
        child_end.close()
        self._conn = Connection(parent_end.detach())
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
        self.info: dict[str, Any] = first[1]
        self.last_message_at = time.monotonic()
        self.stalled_s = 0.0  # as of the last message
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
        """Raise when the process is gone, busy but silent for too long, or has had work
        waiting with nothing scheduled for too long."""
        if not self.is_alive:
            raise EngineDeadError(self._death())
        if len(self._streams) and time.monotonic() - self.last_message_at > stuck_after_s:
            raise EngineDeadError(f"engine has not completed a step in {stuck_after_s:.0f}s")
        if len(self._streams) and self.stalled_s > stalled_after_s:
            raise EngineDeadError(
                f"engine has had requests waiting and scheduled none for {self.stalled_s:.0f}s"
            )

    def _death(self) -> str:
        if self._error is not None:
            return str(self._error)
        return f"engine process exited with code {self._proc.poll()}"

    # ---- requests -----------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        context: ContextOp | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """With `context`, a Fill or Generate on it: `prompt_token_ids` are the tokens it
        adds (see LLMEngine.add_context_request)."""
        if not self.is_alive:
            raise EngineUnavailableError(self._death())
        if not len(self._streams):
            self.last_message_at = time.monotonic()  # idle until now: not stuck
        queue = self._streams.open(request_id)
        try:
            self._send(("add", request_id, list(prompt_token_ids), params, context))
        except EngineDeadError as exc:
            self._streams.close(request_id, queue)
            raise EngineUnavailableError(str(exc)) from exc
        except BaseException:
            self._streams.close(request_id, queue)
            raise
        async for delta in self._streams.iterate(
            request_id, queue, params.n, lambda: self.abort(request_id)
        ):
            yield delta

    def abort(self, request_id: str) -> None:
        if self.is_alive:
            with contextlib.suppress(EngineDeadError):
                self._send(("abort", request_id))

    async def call(self, name: str, *args: Any, timeout_s: float = 30.0) -> Any:
        """Run one of the engine process's named calls (see `_CALLS`) and return its value."""
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
                self.last_message_at = time.monotonic()
                kind = message[0]
                if kind == "deltas":
                    self.stalled_s = message[2]
                    self._streams.dispatch(message[1])
                elif kind == "error":
                    self._streams.fail(message[1], RemoteError(*message[2:]))
                elif kind == "reply":
                    self._resolve(*message[1:])
                elif kind == "fatal":
                    self._error = EngineDeadError(f"engine failed: {message[3]}")
        except (EOFError, OSError):
            pass
        if self._error is None and not self._stopping:
            self._error = EngineDeadError(self._death())
        if self._error is not None:
            logger.error("%s", self._error)
        error = self._error or EngineDeadError("engine stopped")
        self._streams.fail_all(error)
        for call_id in list(self._calls):
            self._resolve(call_id, False, _error_parts(error))
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


# ---- child side ------------------------------------------------------------------------
_CALLS = {
    "stats": lambda engine: engine.stats_snapshot(),
    "free_context": lambda engine, context_id: engine.free_context(context_id),
    "context_tokens": lambda engine, context_id: engine.context_tokens(context_id),
    "slots": lambda engine: engine.slots(),
    "save_context": lambda engine, *args: engine.save_context(*args),
    "restore_context": lambda engine, context_id, path: engine.restore_context(context_id, path),
}
# File I/O: run by one worker thread, never on the step loop (the engine locks what it
# touches).
_THREADED_CALLS = {"save_context", "restore_context"}


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the parent dies, even in the middle of a step."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the closed socket still ends the loop


def _serve(conn: Connection) -> int:
    import torch

    from app.engine.engine import LLMEngine
    from app.engine.shard import HEARTBEAT
    from app.models.parallel import TPGroup, init_tp_group

    config_json, tp_master = conn.recv()
    config = EngineConfig.model_validate(config_json)
    try:
        torch.set_num_threads(config.threads)
        tp = TPGroup()
        if config.tensor_parallel_size > 1:
            tp = init_tp_group(
                0, config.tensor_parallel_size, tp_master, config.torch_distributed_backend
            )
        engine = LLMEngine(config, tp=tp)
    except Exception as exc:
        logger.exception("engine failed to start")
        conn.send(("fatal", *_error_parts(exc)))
        return 1
    send_lock = threading.Lock()
    # One at a time: each holds a copy of a context's KV, and the quota check of a save
    # must see the file of the save before it.
    slot_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-slot-io")

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    def run_call(call_id: int, name: str, args: tuple) -> None:
        try:
            send(("reply", call_id, True, _CALLS[name](engine, *args)))
        except (OSError, EOFError):
            pass  # the parent is gone
        except Exception as exc:
            with contextlib.suppress(OSError):
                send(("reply", call_id, False, _error_parts(exc)))

    send(("ready", {"model": engine.source.name, "max_model_len": engine.max_model_len}))
    last_sent = time.monotonic()
    while True:
        if not engine.has_work:
            timeout = HEARTBEAT_S
            tp.broadcast_object(HEARTBEAT)  # idle shards stay in touch (see app.engine.shard)
        else:
            timeout = 0.0 if engine.last_step_scheduled else STALLED_POLL_S
        while conn.poll(timeout):
            message = conn.recv()
            kind = message[0]
            if kind == "add":
                _, request_id, token_ids, params, context = message
                try:
                    if context is None:
                        engine.add_request(request_id, token_ids, params)
                    else:
                        engine.add_context_request(request_id, context, token_ids, params)
                except Exception as exc:
                    send(("error", message[1], *_error_parts(exc)))
            elif kind == "abort":
                engine.abort(message[1])
            elif kind == "call":
                _, call_id, name, args = message
                if name in _THREADED_CALLS:
                    slot_io.submit(run_call, call_id, name, args)
                else:
                    run_call(call_id, name, args)
            elif kind == "stop":
                tp.broadcast_object(None)
                return 0
            timeout = 0.0
        if not engine.has_work:
            continue
        try:
            deltas = engine.step()
        except Exception as exc:
            logger.exception("engine step failed")
            send(("fatal", *_error_parts(exc)))
            return 1
        now = time.monotonic()
        if deltas or now - last_sent > HEARTBEAT_S:
            send(("deltas", deltas, engine.stalled_s))
            last_sent = now


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    _die_with_parent()
    conn = Connection(int(sys.argv[1]))
    try:
        return _serve(conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the parent is gone
    except Exception as exc:  # e.g. a shard died under a heartbeat
        logger.exception("engine failed")
        with contextlib.suppress(OSError):
            conn.send(("fatal", *_error_parts(exc)))
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
