"""The operator's event log (long poll, order, a follower that fell behind, a restart)
and the ingress's broadcaster (a slow WebSocket client is dropped, not buffered)."""

import asyncio
import time

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
