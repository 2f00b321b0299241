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
        "kv_tier_hit_tokens": 64,
    }
    info = runtime_info(stats, {**stats, "num_generated_tokens": 50}, 2.0)
    assert info["kv_tier_hit_tokens"] == 64 and info["kv_tier_bytes"] == 0  # /metrics
    assert info["spec_accepted_tokens"] == 0  # no speculation: /metrics shows zeros
    assert info["tokens_per_s"] == 50.0 and info["num_contexts"] == 4
    assert info["kv_usage"] == 0.1  # /metrics shows it per replica
    assert runtime_info(stats, None, 0.0)["tokens_per_s"] == 0.0


def test_watch_waits_for_a_change_and_ignores_same_figures():
    import asyncio

    async def scenario() -> None:
        registry = EngineRegistry(stale_after_s=60)
        version, engines = await registry.watch(-1, 5.0)  # another version: at once
        assert engines == []
        start = time.monotonic()
        assert await registry.watch(version, 0.1) == (version, [])  # nothing: the timeout
        assert time.monotonic() - start >= 0.09
        waiter = asyncio.ensure_future(registry.watch(version, 5.0))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        registry.register("r1", "model-a", {})
        version, engines = await asyncio.wait_for(waiter, 1.0)
        assert [e["engine_id"] for e in engines] == ["r1"]
        registry.heartbeat("r1", {"num_running": 1})
        version, _ = await registry.watch(version, 5.0)
        registry.heartbeat("r1", {"num_running": 1})  # the same figures: no change
        assert (await registry.watch(version, 0.1))[0] == version

    asyncio.run(scenario())


def test_a_change_from_another_thread_wakes_every_watcher():
    """Serve runs register/heartbeat in its thread pool while watchers wait on the loop:
    each of many changes made from threads, each racing a fresh watcher, wakes it."""
    import asyncio
    import threading

    async def scenario() -> None:
        registry = EngineRegistry(stale_after_s=60)
        registry.register("r1", "model-a", {})
        for i in range(200):
            version = registry.version
            watcher = asyncio.ensure_future(registry.watch(version, 5.0))
            change = threading.Thread(target=registry.heartbeat, args=("r1", {"n": i}))
            change.start()
            got, _ = await asyncio.wait_for(watcher, 2.0)  # never the 5 s timeout
            change.join()
            assert got > version

    asyncio.run(scenario())
