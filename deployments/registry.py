"""EngineRegistry: which model replicas are alive and what they are doing (Parrot's
/register_engine and /engine_heartbeat, mapped onto Serve replicas).

Each ModelServer registers when it starts and sends a heartbeat with its runtime info
when it changes (read every HEARTBEAT_S while the engine has work), and at least every
KEEPALIVE_S while it does not; an engine that misses heartbeats for STALE_AFTER_S drops
out of the list. Nothing routes by these figures (Serve's router asks the replicas for
their queue lengths itself): they feed GET /engines, /metrics and the operator's
`metrics` events, so an idle replica says only that it is still there, and seldom. The
registry is plain state in one light Serve deployment; the ingress reads it for GET
/engines, the operator waits on it (`watch`) rather than polling. It also starts the app's
RoutingState actor (routing_state.py), or finds the one an earlier registry started.
"""

import asyncio
import contextlib
import threading
import time
from typing import Any

from ray import serve

from deployments.routing_state import start_routing_state

HEARTBEAT_S = 2.0  # a replica whose engine has work reads its figures this often
KEEPALIVE_S = 5.0  # an idle replica's figures do not change: it says it lives this often
STALE_AFTER_S = 3 * KEEPALIVE_S


class EngineRegistry:
    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_s = stale_after_s
        self.engines: dict[str, dict[str, Any]] = {}
        self.version = 0  # counts the changes of the list's figures (see `watch`)
        self._changed: tuple[asyncio.Event, asyncio.AbstractEventLoop] | None = None
        # Serve runs the sync methods in its thread pool and `watch` on the event loop:
        # the list, the version and the watchers' event change under this lock, so a
        # change between a watcher's look at the version and its wait still wakes it.
        self._lock = threading.RLock()
        try:
            app = serve.get_replica_context().app_name
        except Exception:  # noqa: BLE001 (not a Serve replica: a test's own registry)
            app = None
        self._routing = None if app is None else start_routing_state(app)

    def _bump(self) -> None:
        """An engine joined, left or reported other figures: wake the watchers (called
        under the lock)."""
        self.version += 1
        waiting, self._changed = self._changed, None
        if waiting is not None:
            event, loop = waiting
            try:
                here = asyncio.get_running_loop()
            except RuntimeError:
                here = None
            if here is loop:
                event.set()
            else:  # a sync method run in Serve's thread pool
                loop.call_soon_threadsafe(event.set)

    async def watch(self, version: int, timeout_s: float) -> tuple[int, list[dict[str, Any]]]:
        """(version, list) once the figures differ from those of `version` (at once if
        they already do), or after `timeout_s`: a long poll, so that a reader learns of a
        change when it happens and costs nothing while there is none."""
        with self._lock:
            changed = None
            if version == self.version:
                if self._changed is None:
                    self._changed = (asyncio.Event(), asyncio.get_running_loop())
                changed = self._changed[0]
        if changed is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout_s)
        with self._lock:  # the version of this very list
            engines = self.list()  # drops the silent ones first (a change)
            return self.version, engines

    def register(
        self, engine_id: str, engine_name: str, config: dict[str, Any], node_id: str | None = None
    ) -> None:
        now = time.time()
        with self._lock:
            self.engines[engine_id] = {
                "engine_id": engine_id,
                "engine_name": engine_name,
                "node_id": node_id,  # the Ray node the replica runs on
                "config": config,
                "registered_at": now,
                "last_heartbeat": now,
                "runtime_info": {},
            }
            self._bump()

    def heartbeat(self, engine_id: str, runtime_info: dict[str, Any]) -> bool:
        """False when the engine is not registered (dropped out): it registers again."""
        with self._lock:
            engine = self.engines.get(engine_id)
            if engine is None:
                return False
            engine["last_heartbeat"] = time.time()
            if engine["runtime_info"] != runtime_info:
                engine["runtime_info"] = runtime_info
                self._bump()
            return True

    def list(self) -> list[dict[str, Any]]:
        now = time.time()
        with self._lock:
            for engine_id in [
                e for e, v in self.engines.items() if now - v["last_heartbeat"] > self.stale_after_s
            ]:
                del self.engines[engine_id]
                self._bump()
            return [
                {**v, "seconds_since_heartbeat": round(now - v["last_heartbeat"], 2)}
                for v in self.engines.values()
            ]


RegistryDeployment = serve.deployment(EngineRegistry, name="EngineRegistry")


# The second KV tier's figures (app/engine/kv_tier.py) and speculative decoding's
# (app/engine/speculation.py), as /metrics shows them.
TIER_FIGURES = ("kv_tier_hit_tokens", "kv_tier_bytes", "kv_tier_read_s", "kv_tier_write_s")
SPEC_FIGURES = ("spec_proposals", "spec_draft_tokens", "spec_accepted_tokens")


def runtime_info(stats: dict[str, Any], previous: dict[str, Any] | None, dt: float) -> dict:
    """What a heartbeat carries, from the engine's stats (tokens/s since the last one)."""
    generated = stats["num_generated_tokens"]
    rate = 0.0
    if previous is not None and dt > 0:
        rate = (generated - previous["num_generated_tokens"]) / dt
    return {
        "num_running": stats["num_running"],
        "num_waiting": stats["num_waiting"],
        "kv_blocks_used": stats["kv_blocks_used"],
        "kv_blocks_free": stats["kv_blocks_free"],
        "kv_usage": stats["kv_usage"],
        "num_contexts": stats["num_contexts"],
        "tokens_per_s": round(rate, 1),
        **{key: stats.get(key, 0) for key in (*TIER_FIGURES, *SPEC_FIGURES)},
    }
