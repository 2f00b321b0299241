"""StreamPacer: caps how many stream messages a model replica sends per second.

Every message from a replica to the ingress crosses Ray and then HTTP, and costs about a
millisecond of CPU across the processes on its way, whatever it carries. At 32 streams
on a 2-core machine, one message per token takes a third of the CPU away from the model.
So a replica shares a budget of messages per second among its open streams: each stream
flushes at most once per `open streams / budget` seconds and merges the tokens in
between, and never more often than once per `min_interval_s` (the replica's
`stream_message_interval_s`, 20 ms by default: a lone stream of 3 ms tokens sent 100
messages a second, and its Serve hops then took enough CPU from the engine to slow the
stream itself by about a quarter). The first token and the last one always go out at
once; tokens merged before a failure go out before it.
"""

import time
from collections.abc import AsyncIterator

from app.protocol.outputs import TokenDelta


def merge(earlier: TokenDelta | None, later: TokenDelta) -> TokenDelta:
    if earlier is None:
        return later
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = (earlier.logprobs or ()) + (later.logprobs or ())
    return TokenDelta(
        request_id=later.request_id,
        index=later.index,
        token_ids=earlier.token_ids + later.token_ids,
        logprobs=logprobs,
        finish_reason=later.finish_reason,
        num_prompt_tokens=later.num_prompt_tokens,
        num_cached_tokens=later.num_cached_tokens,
    )


class StreamPacer:
    def __init__(self, messages_per_s: float, min_interval_s: float = 0.0) -> None:
        self.messages_per_s = messages_per_s
        self.min_interval_s = min_interval_s
        self.open_streams = 0

    @property
    def interval_s(self) -> float:
        """A stream's shortest gap between messages; 0 (one per token) with no budget."""
        if self.messages_per_s <= 0:
            return 0.0
        return max(self.open_streams / self.messages_per_s, self.min_interval_s)

    async def pace(self, deltas: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
        self.open_streams += 1
        try:
            pending: dict[int, TokenDelta] = {}  # by output index
            last_flush = float("-inf")
            try:
                async for delta in deltas:
                    pending[delta.index] = merge(pending.get(delta.index), delta)
                    now = time.monotonic()
                    if delta.finish_reason is not None or now - last_flush >= self.interval_s:
                        for merged in pending.values():
                            yield merged
                        pending.clear()
                        last_flush = now
            except Exception:
                for merged in pending.values():  # the tokens the engine did make, first
                    yield merged
                raise
            for merged in pending.values():
                yield merged
        finally:
            self.open_streams -= 1
