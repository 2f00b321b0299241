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

A replica whose engine does not share its CPU (a GPU replica) needs no budget, and there
`min_interval_s` bounds a stream's gaps instead (`messages_per_s` 0): held tokens go out
as soon as the next token, due one token gap later, would come after it, so a client
never waits longer for text the engine has made while tokens come steadily. At 70 ms a
stream of 40 tokens a second gets two tokens a message and one of 80 tokens a second
five: 13-20 messages a second a stream, whatever its rate. With both 0, every token is a
message.
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

    def due(self, waited: float, gap: float) -> bool:
        """Whether a stream's held tokens go out, `waited` seconds after its last message,
        its tokens `gap` seconds apart. With a budget: once its interval (the shortest gap)
        has passed. Without: also when the next token would come after the interval (the
        longest gap)."""
        interval = self.interval_s
        if waited >= interval:
            return True
        return self.messages_per_s <= 0 and waited + gap > interval

    @property
    def interval_s(self) -> float:
        """A stream's share of the budget, never under `min_interval_s`; `min_interval_s`
        alone with no budget (messages_per_s 0)."""
        share = self.open_streams / self.messages_per_s if self.messages_per_s > 0 else 0.0
        return max(share, self.min_interval_s)

    async def pace(self, deltas: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
        self.open_streams += 1
        try:
            pending: dict[int, TokenDelta] = {}  # by output index
            last_flush = last_delta = float("-inf")
            try:
                async for delta in deltas:
                    pending[delta.index] = merge(pending.get(delta.index), delta)
                    now = time.monotonic()
                    gap, last_delta = now - last_delta, now
                    if delta.finish_reason is not None or self.due(now - last_flush, gap):
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
