"""The child end of EngineProcess: an LLMEngine's step loop served over a socket.

Run as `python -m app.engine.engine_child FD` by EngineProcess, which documents the wire.
Between steps the loop reads the parent's messages: it waits up to a heartbeat for one
while idle, briefly after a step that scheduled nothing, and not at all while busy.
Queries run on the loop's thread between steps (they are quick); context files run on
one worker thread beside it.
"""

import contextlib
import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import torch

from app.engine.config import EngineConfig
from app.engine.context_files import ContextFiles
from app.engine.engine import LLMEngine
from app.engine.engine_process import HEARTBEAT_S, STALLED_POLL_S, error_parts
from app.engine.openmp_threads import run_then_release
from app.engine.shard import HEARTBEAT
from app.engine.stats import EngineStats
from app.models.parallel import TPGroup, init_tp_group
from app.protocol.messages import EngineRequest
from app.protocol.outputs import EngineInfo
from app.protocol.sampling import Constraint, ConstraintKind, SamplingParams

logger = logging.getLogger(__name__)

# Off the step loop: they read or write files (a LoRA adapter's are read outside the
# engine's lock, so steps go on meanwhile).
FILE_CALLS = frozenset({"save_context", "restore_context", "set_lora"})


class EngineChild:
    def __init__(self, conn: Connection, engine: LLMEngine, tp: TPGroup) -> None:
        self.conn = conn
        self.engine = engine
        self.tp = tp
        files = ContextFiles(engine)
        self.calls = {
            "stats": engine.stats_snapshot,
            "slots": engine.slots,
            "context_tokens": engine.context_tokens,
            "free_context": engine.free_context,
            "save_context": files.save,
            "restore_context": files.restore,
            "set_lora": engine.set_lora,
        }
        self._send_lock = threading.Lock()  # the file worker replies too
        # One at a time: each holds a copy of a context's KV, and a save's quota check
        # must see the file of the save before it.
        self._file_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-slot-io")

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self.conn.send(message)

    def run(self) -> int:
        """Step until the parent says stop (0); a failed step raises."""
        engine = self.engine
        vision = engine.loaded.vision is not None
        self.send(("ready", EngineInfo(engine.source.name, engine.max_model_len, vision)))
        last_sent = time.monotonic()
        while self._receive():
            if not engine.has_work:
                continue
            deltas = engine.step()
            now = time.monotonic()
            if deltas or now - last_sent > HEARTBEAT_S:
                self.send(("deltas", deltas, engine.stalled_s))
                last_sent = now
        return 0

    def _receive(self) -> bool:
        """Handle the messages that have come (or come within this turn's wait); False
        once the parent said stop."""
        if not self.engine.has_work:
            timeout = HEARTBEAT_S
            self.tp.broadcast_object(HEARTBEAT)  # idle shards stay in touch (app.engine.shard)
        else:
            timeout = 0.0 if self.engine.last_step_scheduled else STALLED_POLL_S
        while self.conn.poll(timeout):
            if not self._handle(self.conn.recv()):
                self.tp.broadcast_object(None)  # the shards stop too
                return False
            timeout = 0.0
        return True

    def _handle(self, message: tuple) -> bool:
        kind = message[0]
        if kind == "add":
            request: EngineRequest = message[1]
            try:
                self.engine.add_request(
                    request.request_id,
                    request.prompt_token_ids,
                    request.params,
                    request.context,
                    request.images,
                )
            except Exception as exc:
                self.send(("error", request.request_id, *error_parts(exc)))
        elif kind == "abort":
            self.engine.abort(message[1])
        elif kind == "call":
            _, call_id, name, args = message
            if name in FILE_CALLS:
                # Its OpenMP workers would halve the step loop's speed: ended after each call.
                self._file_io.submit(run_then_release, self._run_call, call_id, name, args)
            else:
                self._run_call(call_id, name, args)
        return kind != "stop"

    def _run_call(self, call_id: int, name: str, args: tuple) -> None:
        try:
            self.send(("reply", call_id, True, self.calls[name](*args)))
        except (OSError, EOFError):
            pass  # the parent is gone
        except Exception as exc:
            with contextlib.suppress(OSError):
                self.send(("reply", call_id, False, error_parts(exc)))


def _start(conn: Connection) -> EngineChild | None:
    """Load the engine the parent's config names; None (after telling it) on failure."""
    config_json, tp_master = conn.recv()
    config = EngineConfig.model_validate(config_json)
    try:
        torch.set_num_threads(config.threads)
        tp = TPGroup()
        if config.tensor_parallel_size > 1:
            backend = config.torch_distributed_backend
            tp = init_tp_group(0, config.tensor_parallel_size, tp_master, backend)
        engine = LLMEngine(config, tp=tp)  # its grammar's vocabulary loaded (grammar.py)
        warm_up(engine)
        return EngineChild(conn, engine, tp)
    except Exception as exc:
        logger.exception("engine failed to start")
        conn.send(("fatal", *error_parts(exc)))
        return None


WARM_UP_PROMPT = list(range(1, 9))  # under one KV block: no cached prefix is left behind


def warm_up(engine: LLMEngine) -> None:
    """Run a plain and a constrained request before the engine says it is ready: what
    runs on first use only (OpenMP's team, the kernels' buffers, the grammar's first
    mask in a step) is then not a client's first request's to wait for. Greedy (the
    sampler's seeded generator draws nothing), and left out of the stats."""
    started = time.perf_counter()
    plain = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    params = [plain]
    if engine.grammar is not None and engine.grammar.vocabulary_loaded():
        schema = Constraint(kind=ConstraintKind.JSON, spec='{"type": "object"}')
        params.append(plain.model_copy(update={"constraint": schema}))
    engine.generate([WARM_UP_PROMPT] * len(params), params)
    engine.stats = EngineStats()
    engine.block_manager.prefix_hit_tokens = engine.block_manager.prefix_query_tokens = 0
    if engine.grammar is not None:
        engine.grammar.mask_seconds, engine.grammar.mask_steps = 0.0, 0
    logger.info("engine warmed up in %.2f s", time.perf_counter() - started)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the parent dies, even in the middle of a step."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the closed socket still ends the loop


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    _die_with_parent()
    conn = Connection(int(sys.argv[1]))
    try:
        child = _start(conn)
        return 1 if child is None else child.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the parent is gone
    except Exception as exc:  # a failed step, or a shard that died under a heartbeat
        logger.exception("engine failed")
        with contextlib.suppress(OSError):
            conn.send(("fatal", *error_parts(exc)))
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
