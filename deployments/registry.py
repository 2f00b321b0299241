"""EngineRegistry: which model replicas are alive and what they are doing (Parrot's
/register_engine and /engine_heartbeat, mapped onto Serve replicas).

Each ModelServer registers when it starts and sends a heartbeat with its runtime info
every HEARTBEAT_S; an engine that misses heartbeats for STALE_AFTER_S drops out of the
list. The registry is plain state in one light Serve deployment; the ingress reads it for
GET /engines.
"""

import time
from typing import Any

from ray import serve

HEARTBEAT_S = 2.0
STALE_AFTER_S = 3 * HEARTBEAT_S


class EngineRegistry:
    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_s = stale_after_s
        self.engines: dict[str, dict[str, Any]] = {}

    def register(
        self, engine_id: str, engine_name: str, config: dict[str, Any], node_id: str | None = None
    ) -> None:
        now = time.time()
        self.engines[engine_id] = {
            "engine_id": engine_id,
            "engine_name": engine_name,
            "node_id": node_id,  # the Ray node the replica runs on
            "config": config,
            "registered_at": now,
            "last_heartbeat": now,
            "runtime_info": {},
        }

    def heartbeat(self, engine_id: str, runtime_info: dict[str, Any]) -> bool:
        """False when the engine is not registered (dropped out): it registers again."""
        engine = self.engines.get(engine_id)
        if engine is None:
            return False
        engine["last_heartbeat"] = time.time()
        engine["runtime_info"] = runtime_info
        return True

    def list(self) -> list[dict[str, Any]]:
        now = time.time()
        for engine_id in [
            e for e, v in self.engines.items() if now - v["last_heartbeat"] > self.stale_after_s
        ]:
            del self.engines[engine_id]
        return [
            {**v, "seconds_since_heartbeat": round(now - v["last_heartbeat"], 2)}
            for v in self.engines.values()
        ]


RegistryDeployment = serve.deployment(EngineRegistry, name="EngineRegistry")


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
    }
