"""ModelServer: one replica = one engine (in its own process); streams token deltas back to
the ingress."""

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.config import ModelDeploymentConfig
from app.engine import slot_files
from app.engine.async_engine import EngineDeadError, EngineUnavailableError
from app.engine.engine_process import EngineProcess
from app.engine.pacing import StreamPacer
from app.protocol.errors import (
    InvalidRequestError,
    NotImplementedByServerError,
    RemoteError,
    ShoalError,
)
from app.protocol.messages import EngineErrorMessage, EngineRequest
from app.protocol.outputs import TokenDelta
from deployments.generation import ENGINE_UNAVAILABLE
from deployments.registry import HEARTBEAT_S, runtime_info
from deployments.shard_actor import ShardActor

logger = logging.getLogger("ray.serve")

SHARD_NAMESPACE = "shoal-shards"
EXIT_AFTER_ENGINE_DEATH_S = 0.3
SLOT_IO_TIMEOUT_S = 600.0


def slot_context(slot_id: int) -> str:
    """The context that holds llama.cpp slot `slot_id`'s tokens and KV."""
    return f"slot-{slot_id}"


class ModelServer:
    def __init__(self, config: ModelDeploymentConfig, registry: Any = None) -> None:
        self.config = config
        # The step loop runs in a child process with its own thread count (Ray sets
        # OMP_NUM_THREADS to num_cpus here), so this process's event loop, which handles
        # every token of every stream, never holds the GIL against it.
        self.shards: list = []  # ShardActor handles, ranks 1..N-1
        self.shard_names: list[str] = []
        self.shard_runs: list = []
        master = self._start_shards() if config.engine.tensor_parallel_size > 1 else None
        try:
            self.engine = EngineProcess(config.engine, tp_master=master, on_death=self._engine_died)
        except BaseException:
            self._stop_shards()
            raise
        self.pacer = StreamPacer(config.stream_messages_per_s)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._stopping = threading.Event()
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
        """Register with the EngineRegistry, then send runtime info every HEARTBEAT_S."""
        registered, previous, last = False, None, time.monotonic()
        while not self._stopping.is_set():
            try:
                if not registered:
                    engine = self.config.engine.model_dump(mode="json")
                    node = ray.get_runtime_context().get_node_id()
                    registry.register.remote(
                        self.replica_id, self.config.name, engine, node
                    ).result(timeout_s=10)
                    registered = True
                stats = asyncio.run(self.engine.call("stats"))
                now = time.monotonic()
                info = runtime_info(stats, previous, now - last)
                previous, last = stats, now
                registered = registry.heartbeat.remote(self.replica_id, info).result(timeout_s=10)
            except Exception as exc:  # the registry restarting, the engine gone: retry
                logger.debug("heartbeat failed: %s", exc)
            self._stopping.wait(HEARTBEAT_S)

    async def generate(
        self, request: EngineRequest
    ) -> AsyncIterator[TokenDelta | EngineErrorMessage]:
        """Yields the first delta as soon as the engine produces it; later ones are paced
        by the replica's message budget (see StreamPacer)."""
        logger.info(
            "request %s: %d prompt tokens", request.request_id, len(request.prompt_token_ids)
        )
        try:
            deltas = self.engine.generate(
                request.request_id, request.prompt_token_ids, request.params, request.context
            )
            async for delta in self.pacer.pace(deltas):
                yield delta
        except ShoalError as exc:
            yield EngineErrorMessage(exc.status_code, exc.error_type, exc.message, exc.param)
        except EngineUnavailableError as exc:  # the engine never saw it: send it elsewhere
            yield EngineErrorMessage(503, ENGINE_UNAVAILABLE, f"the model replica failed: {exc}")
        except EngineDeadError as exc:  # it was inside the engine: maybe its cause, no retry
            yield EngineErrorMessage(503, "engine_error", f"the model replica failed: {exc}")
        except Exception as exc:
            logger.exception("request %s failed", request.request_id)
            yield EngineErrorMessage(503, "engine_error", f"the model replica failed: {exc}")

    async def free_context(self, context_id: str) -> int:
        """Drop a context; returns how many tokens it held."""
        return await self.engine.call("free_context", context_id)

    async def slot_action(self, action: str, slot_id: int, filename: str | None) -> dict:
        """llama.cpp's POST /slots/{id}?action=save|restore|erase on context slot-{id}."""
        max_slots = self.config.engine.max_num_seqs
        if not 0 <= slot_id < max_slots:
            raise InvalidRequestError(f"id_slot must be in [0, {max_slots})", "id_slot")
        context_id = slot_context(slot_id)
        if action == "erase":
            try:
                n = await self.free_context(context_id)
            except RemoteError as exc:
                if exc.status_code != 404:
                    raise
                n = 0  # an empty slot: nothing to erase
            return {"id_slot": slot_id, "n_erased": n}
        if self.config.slot_save_path is None:
            raise NotImplementedByServerError(
                "slot save and restore are off: set slot_save_path in the model's config"
            )
        directory = Path(self.config.slot_save_path)
        path = slot_files.checked_path(directory, filename or "")
        directory.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        # Slot files can be large: the engine writes and reads them off its step loop.
        if action == "save":
            quota = self.config.slot_save_quota_bytes
            result = await self.engine.call(
                "save_context", context_id, str(path), quota, timeout_s=SLOT_IO_TIMEOUT_S
            )
        else:
            result = await self.engine.call(
                "restore_context", context_id, str(path), timeout_s=SLOT_IO_TIMEOUT_S
            )
        ms = 1000 * (time.perf_counter() - started)
        return {
            "id_slot": slot_id,
            "filename": path.name,
            **result,
            "timings": {f"{action}_ms": ms},
        }

    def info(self) -> dict:
        """What the engine reported at start-up: model, max_model_len."""
        return dict(self.engine.info)

    async def slots(self) -> list[dict]:
        return await self.engine.call("slots")

    async def context_tokens(self, context_id: str) -> list[int]:
        return await self.engine.call("context_tokens", context_id)

    async def stats(self) -> dict:
        stats = await self.engine.call("stats")
        stats["engine_pid"] = self.engine.pid
        stats["tensor_parallel_size"] = self.config.engine.tensor_parallel_size
        stats["shards"] = list(self.shard_names)  # named actors in SHARD_NAMESPACE
        stats["replica"] = serve.get_replica_context().replica_id.unique_id
        return stats

    def check_health(self) -> None:
        self.engine.check_health(stalled_after_s=self.config.stall_timeout_s)
        ended, _ = ray.wait(self.shard_runs, timeout=0) if self.shard_runs else ([], None)
        if ended:  # a shard's loop only ends with its replica: the group is broken
            raise RuntimeError("a tensor-parallel shard of this replica has stopped")

    # ---- tensor parallelism ---------------------------------------------------------
    def _start_shards(self) -> str:
        """Start ranks 1..N-1 in this replica's placement group; returns rank 0's address."""
        engine = self.config.engine
        size = engine.tensor_parallel_size
        group = get_current_placement_group()
        if group is None:
            raise RuntimeError("tensor_parallel_size > 1 needs the replica's placement group")
        with socket.socket() as s:  # rank 0 (our engine process) listens here
            s.bind(("", 0))
            port = s.getsockname()[1]
        master = f"{ray.util.get_node_ip_address()}:{port}"
        replica = serve.get_replica_context().replica_id.unique_id
        for rank in range(1, size):
            name = f"{self.config.name}-{replica}-{rank}"
            self.shard_names.append(name)
            actor = ShardActor.options(
                name=name,
                namespace=SHARD_NAMESPACE,
                num_cpus=self.config.num_cpus / size,
                num_gpus=self.config.num_gpus / size,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=rank
                ),
            ).remote()
            self.shards.append(actor)
            self.shard_runs.append(actor.run.remote(engine.model_dump_json(), rank, master))
        logger.info("model %s: %d shards, rank 0 at %s", self.config.name, size, master)
        return master

    def _stop_shards(self) -> None:
        for actor in self.shards:
            ray.kill(actor)
        self.shards.clear()

    def __del__(self) -> None:
        stopping = getattr(self, "_stopping", None)
        if stopping is not None:
            stopping.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()  # tells the shards to stop too
        if getattr(self, "shards", None):
            self._stop_shards()


# Three failed checks in a row replace the replica: a dead engine is gone within ~15 s.
ModelServerDeployment = serve.deployment(ModelServer, name="ModelServer", health_check_period_s=5)
