"""EngineRegistry's bookkeeping, without Ray: register, heartbeat, drop the silent."""

import time

from deployments.registry import EngineRegistry, runtime_info


def test_register_heartbeat_and_drop_out():
    registry = EngineRegistry(stale_after_s=0.2)
    assert registry.heartbeat("r1", {}) is False  # unknown: must register first
    registry.register("r1", "model-a", {"block_size": 16})
    registry.register("r2", "model-a", {"block_size": 16})
    assert registry.heartbeat("r1", {"num_running": 3}) is True
    assert {e["engine_id"] for e in registry.list()} == {"r1", "r2"}
    time.sleep(0.12)
    registry.heartbeat("r1", {"num_running": 1})
    time.sleep(0.12)  # r2 has now missed its heartbeats, r1 has not
    listed = registry.list()
    assert [e["engine_id"] for e in listed] == ["r1"]
    assert listed[0]["runtime_info"] == {"num_running": 1}
    assert registry.heartbeat("r2", {}) is False  # dropped: it registers again


def test_runtime_info_rate():
    stats = {
        "num_running": 2,
        "num_waiting": 1,
        "kv_blocks_used": 10,
        "kv_blocks_free": 90,
        "kv_usage": 0.1,
        "num_contexts": 4,
        "num_generated_tokens": 150,
    }
    info = runtime_info(stats, {**stats, "num_generated_tokens": 50}, 2.0)
    assert info["tokens_per_s"] == 50.0 and info["num_contexts"] == 4
    assert info["kv_usage"] == 0.1  # /metrics shows it per replica
    assert runtime_info(stats, None, 0.0)["tokens_per_s"] == 0.0
