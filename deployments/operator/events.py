"""EventLog: the operator's events in order, for every ingress replica to follow.

Each event gets the next sequence number and stays in a bounded ring. An ingress asks
for the events after the last number it saw (`since`) and waits, up to a timeout, when
there are none yet: one long poll per ingress replica, however many WebSocket clients it
has. A follower that fell further behind than the ring holds gets `lost: true` and the
oldest events kept, and carries on.
"""

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

KEPT_EVENTS = 2048


class EventLog:
    def __init__(self, kept: int = KEPT_EVENTS) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=kept)
        self.seq = 0
        self._changed = asyncio.Condition()

    def publish(self, event: str, data: dict[str, Any]) -> None:
        """Must run on the event loop that owns the log (threads: call_soon_threadsafe)."""
        self.seq += 1
        self.events.append({"seq": self.seq, "event": event, "time": time.time(), "data": data})
        asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def since(self, seq: int, timeout_s: float) -> dict[str, Any]:
        """{"events": [...], "seq": last number, "lost": bool}: the events after `seq`,
        waiting up to `timeout_s` for one when there are none yet."""
        if seq > self.seq:  # the operator restarted: its numbers started again
            seq = 0
        if seq == self.seq:
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: self.seq > seq), timeout_s
                    )
        events = [e for e in self.events if e["seq"] > seq]
        lost = bool(events) and events[0]["seq"] > seq + 1
        return {"events": events, "seq": self.seq, "lost": lost}
