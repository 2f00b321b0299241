"""The operator's event log (long poll, order, a follower that fell behind, a restart)
and the ingress's broadcaster (a slow WebSocket client is dropped, not buffered)."""

import asyncio
import time

import pytest

from deployments.operator.events import EventLog
from deployments.operator.follower import CLIENT_QUEUE, Broadcaster
from tests.local_app import run


def test_long_poll_waits_for_the_next_event_and_keeps_order():
    async def scenario():
        log = EventLog()
        started = time.monotonic()
        empty = await log.since(0, timeout_s=0.2)
        assert empty == {"events": [], "seq": 0, "lost": False}
        assert time.monotonic() - started >= 0.2
        waiting = asyncio.ensure_future(log.since(0, timeout_s=5))
        await asyncio.sleep(0.05)
        log.publish("download_status", {"status": "queued"})
        log.publish("download_status", {"status": "downloading"})
        got = await asyncio.wait_for(waiting, 1)
        assert [e["data"]["status"] for e in got["events"]][:1] == ["queued"]
        rest = await log.since(got["events"][-1]["seq"], timeout_s=0)
        seen = [e["data"]["status"] for e in got["events"] + rest["events"]]
        assert seen == ["queued", "downloading"]

    run(scenario())


def test_a_follower_too_far_behind_is_told_and_a_restarted_log_starts_again():
    async def scenario():
        log = EventLog(kept=3)
        for i in range(5):
            log.publish("status", {"i": i})
        behind = await log.since(1, timeout_s=0)
        assert behind["lost"] and [e["data"]["i"] for e in behind["events"]] == [2, 3, 4]
        fresh = EventLog()
        fresh.publish("status", {"i": 0})
        restarted = await fresh.since(40, timeout_s=0)  # a number from the old log
        assert [e["data"]["i"] for e in restarted["events"]] == [0]

    run(scenario())


def test_a_slow_client_is_dropped_and_the_others_keep_their_events():
    async def scenario():
        broadcaster = Broadcaster()
        slow, fast = broadcaster.join(), broadcaster.join()
        for i in range(CLIENT_QUEUE + 1):
            broadcaster.send({"seq": i})
            if not fast.queue.empty():
                await fast.queue.get()
        assert slow.dropped.is_set() and slow not in broadcaster.clients
        assert not fast.dropped.is_set() and fast in broadcaster.clients

    run(scenario())


def test_metrics_events_follow_the_registry_down_to_no_replica(tmp_path, monkeypatch):
    """The operator's `metrics` events come from the registry's long poll: one when a
    model's figures change, none while they do not, and one saying 0 replicas when the
    model's last replica stops sending heartbeats (before, the model just went quiet)."""
    from deployments.config import AppConfig
    from deployments.operator import operator as operator_module
    from deployments.registry import EngineRegistry
    from tests.local_app import LocalHandle

    monkeypatch.setattr(operator_module, "METRICS_EVERY_S", 0.02)
    monkeypatch.setattr(operator_module, "WATCH_S", 0.1)
    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "database": {"path": str(tmp_path / "shoal.sqlite3")},
            "operator": {"models_dir": str(tmp_path / "models")},
        }
    )
    registry = EngineRegistry(stale_after_s=1.5)  # well past the quiet window below
    operator = operator_module.Operator(config, registry=LocalHandle(registry))

    def replicas(events: list[dict]) -> list[int]:
        return [e["data"]["meta"]["replicas"] for e in events if e["event"] == "metrics"]

    async def scenario():
        loop = asyncio.ensure_future(operator._metrics())
        try:
            registry.register("r1", "m", {})
            registry.heartbeat("r1", {"num_running": 1, "tokens_per_s": 5.0})
            first = await operator.events.since(0, timeout_s=2)
            assert replicas(first["events"])[-1:] == [1]
            quiet = await operator.events.since(first["seq"], timeout_s=0.3)
            assert replicas(quiet["events"]) in ([], [1])  # at most the catch-up
            gone = await operator.events.since(quiet["seq"], timeout_s=5)
            assert replicas(gone["events"]) == [0]
            after = await operator.events.since(gone["seq"], timeout_s=0.4)
            assert replicas(after["events"]) == []  # said once
        finally:
            loop.cancel()

    run(scenario())


def test_run_time_adapters_are_kept_in_the_operator_s_database(tmp_path):
    """The LoRA adapters loaded at run time: recorded (a second of one name is a 400
    unless replaced), announced to the ingresses (`lora_adapters` events), and known to
    an operator started again on the same database."""
    from app.protocol.errors import InvalidRequestError
    from deployments.config import AppConfig
    from deployments.operator.operator import Operator

    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "database": {"path": str(tmp_path / "shoal.sqlite3")},
            "operator": {"models_dir": str(tmp_path / "models")},
        }
    )

    async def scenario() -> None:
        operator = Operator(config)
        await operator.add_lora("m", "sea", "/models/sea", 1)
        with pytest.raises(InvalidRequestError, match="already"):
            await operator.add_lora("m", "sea", "/models/other", 2)
        await operator.add_lora("m", "sea", "/models/other", 3, True)  # replaced
        await operator.add_lora("m", "gulf", "/models/gulf", 4)
        assert await operator.remove_lora("gulf") and not await operator.remove_lora("gulf")
        events = (await operator.events.since(0, 0.1))["events"]
        states = [(e["data"]["name"], e["data"]["state"]) for e in events]
        assert states == [("sea", "loaded"), ("sea", "loaded"), ("gulf", "loaded"),
                          ("gulf", "unloaded")]  # fmt: skip
        assert Operator(config).lora_adapters() == {"m": {"sea": ("/models/other", 3)}}

    run(scenario())
