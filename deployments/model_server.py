"""ModelServer: one replica = one engine (its step loop in its own process, its shards in
its placement group); a thin shim that streams the engine's token deltas to the ingress.

Every method speaks the neutral protocol (EngineRequest, ContextOp, SlotInfo,
ContextFile); no dialect's names or JSON here. A method that names a context takes its
ContextOp, which is what the request router reads to send it to the right replica.
"""

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ray
from ray import serve

from app.engine import slot_files
from app.engine.client import EngineClient, EngineDeadError, EngineUnavailableError
from app.engine.engine_process import EngineProcess
from app.protocol.errors import NotImplementedByServerError, ShoalError
from app.protocol.messages import ContextOp, EngineErrorMessage, EngineRequest
from app.protocol.outputs import ContextFile, EngineInfo, SlotInfo, WireDelta
from deployments.config import ModelDeploymentConfig
from deployments.context_moves import ContextMoves
from deployments.http.generation import ENGINE_UNAVAILABLE
from deployments.pacing import StreamPacer
from deployments.registry import HEARTBEAT_S, KEEPALIVE_S, runtime_info
from deployments.replica_adapters import ReplicaAdapters, keyed_engine_config
from deployments.routing_state import SharedRouting
from deployments.shard_actor import ShardGroup

logger = logging.getLogger("ray.serve")

EXIT_AFTER_ENGINE_DEATH_S = 0.3


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not in a Serve replica (in-process tests)
        return "local"


def _shared_routing() -> SharedRouting | None:
    """This replica's link to its app's RoutingState (None outside Serve)."""
    try:
        context = serve.get_replica_context()
    except Exception:
        return None
    return SharedRouting(context.app_name, context.deployment, max_blocks=0)


class ModelServer:
    def __init__(
        self,
        config: ModelDeploymentConfig,
        registry: Any = None,
        engine: EngineClient | None = None,
    ) -> None:
        """`engine`: an engine already running (in-process tests); by default the replica
        starts its own EngineProcess (and, with tensor parallelism, its shards)."""
        self.config = config
        self._closed = False
        self.replica_id = _replica_id()
        self.shards = ShardGroup(config, self.replica_id)
        if engine is None:
            master = self.shards.start() if config.engine.tensor_parallel_size > 1 else None
            try:
                # The step loop runs in a child process with its own thread count, so this
                # process's event loop, which handles every token of every stream, never
                # holds the GIL against it.
                engine = EngineProcess(
                    keyed_engine_config(config.engine), master, on_death=self._engine_died
                )
            except BaseException:
                self.shards.stop()
                raise
        self.engine: EngineClient = engine
        self.moves = ContextMoves(engine, _shared_routing(), self.replica_id)
        self.adapters = ReplicaAdapters(engine, config.engine.max_loras)
        self.pacer = StreamPacer(config.stream_messages_per_s, config.stream_message_interval_s)
        self._stopping = threading.Event()
        # Set by what changes the engine's figures (a request, a context freed or
        # restored): wakes an idle heartbeat loop. `_streams`: generations open here.
        self._activity = threading.Event()
        self._streams = 0
        if registry is not None:
            threading.Thread(
                target=self._heartbeats, args=(registry,), name="shoal-heartbeat", daemon=True
            ).start()
        logger.info("model %s ready", config.name)

    def _engine_died(self, error: BaseException) -> None:
        """Leave at once: a replica without an engine would answer every request with an
        error instantly, so the router (which favours idle replicas) would send it most of
        the traffic until three failed health checks. Once this actor is gone, routers drop
        it and Serve starts a new one. The pause lets the streams' error events out."""
        logger.error("model %s: %s; this replica exits", self.config.name, error)
        threading.Timer(EXIT_AFTER_ENGINE_DEATH_S, os._exit, args=(1,)).start()

    def _heartbeats(self, registry: Any) -> None:
        """Register with the EngineRegistry, then send runtime info when it changes. While
        the engine has work (or had since the last reading) its figures are read every
        HEARTBEAT_S; once they show it idle they are not read again until something
        happens here (`_activity`), and the replica only says it lives every KEEPALIVE_S:
        an idle replica neither wakes its engine nor calls the registry on a short timer."""
        registered, previous, last = False, None, time.monotonic()
        info: dict | None = None
        sent, sent_at, quiet = None, 0.0, False
        while not self._stopping.is_set():
            try:
                if not registered:
                    engine = self.config.engine.model_dump(mode="json")
                    node = ray.get_runtime_context().get_node_id()
                    registry.register.remote(
                        self.replica_id, self.config.name, engine, node
                    ).result(timeout_s=10)
                    registered, sent = True, None
                if not quiet or self._activity.is_set():
                    self._activity.clear()
                    stats = asyncio.run(self.engine.stats())
                    now = time.monotonic()
                    info = runtime_info(stats, previous, now - last)
                    previous, last = stats, now
                    busy = info["num_running"] or info["num_waiting"] or info["tokens_per_s"]
                    quiet = not busy and not self._streams
                now = time.monotonic()
                if info is not None and (info != sent or now - sent_at >= 0.9 * KEEPALIVE_S):
                    registered = registry.heartbeat.remote(self.replica_id, info).result(
                        timeout_s=10
                    )
                    sent, sent_at = info, now
                    if not registered:  # dropped out (a new registry): register at once
                        continue
            except Exception as exc:  # the registry restarting, the engine gone: retry
                logger.debug("heartbeat failed: %s", exc)
                quiet = False
            if quiet:
                self._activity.wait(KEEPALIVE_S)
            else:
                self._stopping.wait(HEARTBEAT_S)

    # ---- generation -----------------------------------------------------------------
    async def generate(
        self, request: EngineRequest
    ) -> AsyncIterator[WireDelta | EngineErrorMessage]:
        """Yields the first delta as soon as the engine produces it; later ones are paced
        by the replica's message budget and a stream's shortest gap (see StreamPacer).
        Deltas go in their wire form (TokenDelta.wire: cheap for Ray to serialize). A
        failure is the last item."""
        logger.info(
            "request %s: %d prompt tokens", request.request_id, len(request.prompt_token_ids)
        )
        self._streams += 1
        self._activity.set()
        try:
            await self.moves.bring(request.context)
            self.moves.seen(request.context)
            if request.params.lora is not None and request.lora_path is not None:
                await self.adapters.hold(request.params.lora, request.lora_path)
            async for delta in self.pacer.pace(self.engine.generate(request)):
                yield delta.wire()
        except ShoalError as exc:
            yield EngineErrorMessage(exc.status_code, exc.error_type, exc.message, exc.param)
        except EngineUnavailableError as exc:  # the engine never saw it: send it elsewhere
            yield EngineErrorMessage(503, ENGINE_UNAVAILABLE, f"the model replica failed: {exc}")
        except EngineDeadError as exc:  # it was inside the engine: maybe its cause, no retry
            yield EngineErrorMessage(503, "engine_error", f"the model replica failed: {exc}")
        except Exception as exc:
            logger.exception("request %s failed", request.request_id)
            yield EngineErrorMessage(503, "engine_error", f"the model replica failed: {exc}")
        finally:
            self._streams -= 1
            self._activity.set()

    async def load_adapter(self, key: str, path: str) -> None:
        """Load a LoRA adapter (its adapter_id) here now: the API's load call, so that a
        bad one is refused before any request names it."""
        await self.adapters.load(key, path)

    # ---- contexts -------------------------------------------------------------------
    async def context_tokens(self, op: ContextOp) -> list[int]:
        await self.moves.bring(op)
        return await self.engine.context_tokens(op.context_id)

    async def free_context(self, op: ContextOp) -> int:
        """Drop a context; returns how many tokens it held."""
        await self.moves.bring(op)  # a parked one is freed too, not left behind
        try:
            held = await self.engine.free_context(op.context_id)
            self.moves.freed(op.context_id)
            return held
        finally:
            self._activity.set()

    async def save_context(self, op: ContextOp, filename: str) -> ContextFile:
        """Write the context's tokens and KV to `filename` in the model's slot_save_path
        (off the engine's step loop), within the directory's quota."""
        path = self._slot_file(filename)
        quota = self.config.slot_save_quota_bytes
        await self.moves.bring(op)
        return await self.engine.save_context(op.context_id, str(path), quota)

    async def restore_context(self, op: ContextOp, filename: str) -> ContextFile:
        try:
            restored = await self.engine.restore_context(
                op.context_id, str(self._slot_file(filename))
            )
            self.moves.seen(op)
            return restored
        finally:
            self._activity.set()

    async def move_context(self, op: ContextOp, to: str) -> int:
        """Send the context to replica `to` (an operator's move, context_moves.py);
        returns how many tokens it holds."""
        if to == self.replica_id:
            return len(await self.context_tokens(op))
        try:
            return await self.moves.move(op.context_id, to)
        finally:
            self._activity.set()

    def _slot_file(self, filename: str) -> Path:
        if self.config.slot_save_path is None:
            raise NotImplementedByServerError(
                "slot save and restore are off: set slot_save_path in the model's config"
            )
        directory = Path(self.config.slot_save_path)
        path = slot_files.checked_path(directory, filename)
        directory.mkdir(parents=True, exist_ok=True)
        return path

    # ---- state ----------------------------------------------------------------------
    def info(self) -> EngineInfo:
        return self.engine.info

    async def slots(self) -> list[SlotInfo]:
        return await self.engine.slots()

    async def stats(self) -> dict:
        stats = await self.engine.stats()
        stats["engine_pid"] = getattr(self.engine, "pid", os.getpid())
        stats["tensor_parallel_size"] = self.config.engine.tensor_parallel_size
        stats["shards"] = list(self.shards.names)  # named actors in SHARD_NAMESPACE
        stats["replica"] = self.replica_id
        return stats

    def check_health(self) -> None:
        self.engine.check_health(stalled_after_s=self.config.stall_timeout_s)
        self.shards.check()

    def __del__(self):  # noqa: ANN204 (None, or what Serve awaits)
        """Serve calls this when it drains the replica, and awaits a coroutine returned:
        the contexts are sent away (context_moves.py) before the engine stops. Called
        again by the collector, or outside Serve, it only closes."""
        if getattr(self, "_closed", True):
            return None
        self._closed = True
        moves = getattr(self, "moves", None)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            moves = None
        if moves is None or not moves.held or moves.shared is None:
            self._close()
            return None
        return self._send_away_then_close(moves)

    async def _send_away_then_close(self, moves: ContextMoves) -> None:
        try:
            await moves.send_away()
        except Exception:
            logger.exception("contexts could not be sent away")
        finally:
            self._close()

    def _close(self) -> None:
        stopping = getattr(self, "_stopping", None)
        if stopping is not None:
            stopping.set()
        activity = getattr(self, "_activity", None)
        if activity is not None:
            activity.set()  # an idle heartbeat loop waits on this one
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()  # tells the shards to stop too
        shards = getattr(self, "shards", None)
        if shards is not None:
            shards.stop()


# Three failed checks in a row replace the replica: a dead engine is gone within ~15 s.
ModelServerDeployment = serve.deployment(ModelServer, name="ModelServer", health_check_period_s=5)
