"""StreamPacer: first and last tokens at once, tokens in between merged, nothing lost."""

import asyncio

from app.protocol import FinishReason
from app.protocol.outputs import TokenDelta, TokenLogprob
from deployments.pacing import StreamPacer, merge


def delta(i: int, index: int = 0, finish: FinishReason | None = None) -> TokenDelta:
    return TokenDelta("r", index, (i,), (TokenLogprob(i, -0.5, ()),), finish)


async def trickle(items: list[TokenDelta], gap_s: float):  # noqa: ANN201
    for item in items:
        await asyncio.sleep(gap_s)
        yield item


def paced(pacer: StreamPacer, items: list[TokenDelta], gap_s: float = 0.002) -> list[TokenDelta]:
    async def main() -> list[TokenDelta]:
        return [d async for d in pacer.pace(trickle(items, gap_s))]

    return asyncio.run(main())


def test_merge_concatenates_tokens_and_logprobs():
    merged = merge(delta(1), delta(2, finish=FinishReason.STOP))
    assert merged.token_ids == (1, 2) and [lp.token_id for lp in merged.logprobs] == [1, 2]
    assert merged.finish_reason == FinishReason.STOP
    assert merge(None, delta(3)) == delta(3)


def test_a_lone_stream_under_budget_and_gap_gets_every_token():
    items = [delta(i) for i in range(5)] + [delta(5, finish=FinishReason.LENGTH)]
    out = paced(StreamPacer(messages_per_s=1.0 / 0.001, min_interval_s=0), items)  # 1 ms, 2 ms gaps
    assert out == items


def test_busy_replica_merges_but_flushes_first_and_last():
    pacer = StreamPacer(messages_per_s=10.0)
    pacer.open_streams = 4  # three other streams: 0.5 s per message for this one
    items = [delta(i) for i in range(20)] + [delta(20, finish=FinishReason.LENGTH)]
    out = paced(pacer, items)
    assert out[0].token_ids == (0,)  # the first token is not held back
    assert len(out) == 2 and out[-1].finish_reason == FinishReason.LENGTH
    assert [t for d in out for t in d.token_ids] == list(range(21))
    assert pacer.open_streams == 4  # this stream's share is given back


def test_outputs_of_n_are_merged_separately():
    items = [delta(1, 0), delta(2, 1), delta(3, 0), delta(4, 1, FinishReason.STOP)]
    items.append(delta(5, 0, FinishReason.STOP))
    pacer = StreamPacer(messages_per_s=1.0)
    out = paced(pacer, items)
    tokens = {0: [], 1: []}
    for d in out:
        tokens[d.index] += d.token_ids
    assert tokens == {0: [1, 3, 5], 1: [2, 4]}
    assert sum(d.finish_reason is not None for d in out) == 2


def test_zero_budget_means_one_message_per_token():
    items = [delta(i) for i in range(4)]
    assert paced(StreamPacer(messages_per_s=0), items, gap_s=0) == items


def test_a_lone_stream_is_merged_below_the_shortest_gap():
    items = [delta(i) for i in range(30)] + [delta(30, finish=FinishReason.LENGTH)]
    pacer = StreamPacer(messages_per_s=1000.0, min_interval_s=0.02)  # 1 ms of budget, 20 ms gap
    out = paced(pacer, items)  # a token every 2 ms: ~60 ms in all
    assert [t for d in out for t in d.token_ids] == list(range(31))
    assert out[0].token_ids == (0,) and out[-1].finish_reason == FinishReason.LENGTH
    assert 2 <= len(out) < len(items) // 2  # first, a few 20 ms merges, last


def test_without_a_budget_the_shortest_gap_still_merges():
    items = [delta(i) for i in range(30)] + [delta(30, finish=FinishReason.LENGTH)]
    pacer = StreamPacer(messages_per_s=0, min_interval_s=0.02)  # a GPU replica's pacing
    pacer.open_streams = 1000  # as many streams as it likes: no budget to share
    out = paced(pacer, items)  # a token every 2 ms: ~60 ms in all
    assert [t for d in out for t in d.token_ids] == list(range(31))
    assert out[0].token_ids == (0,) and out[-1].finish_reason == FinishReason.LENGTH
    assert 2 <= len(out) < len(items) // 2


def test_a_stream_sends_before_its_next_token_would_pass_the_interval():
    items = [delta(i) for i in range(12)] + [delta(12, finish=FinishReason.LENGTH)]
    pacer = StreamPacer(messages_per_s=0, min_interval_s=0.1)  # a GPU replica's pacing
    out = paced(pacer, items, gap_s=0.03)  # tokens 30 ms apart: 3 a message, 90 ms apart
    assert [t for d in out for t in d.token_ids] == list(range(13))
    assert out[0].token_ids == (0,) and out[-1].finish_reason == FinishReason.LENGTH
    assert all(len(d.token_ids) <= 3 for d in out)  # never held past the interval
    assert all(len(d.token_ids) >= 2 for d in out[1:-1])  # yet merged up to it


def test_due():
    gpu = StreamPacer(messages_per_s=0, min_interval_s=0.1)  # the interval is the longest gap
    assert gpu.due(waited=0.1, gap=0.0)
    assert gpu.due(waited=0.08, gap=0.03)  # the next token would come too late
    assert not gpu.due(waited=0.06, gap=0.03)
    cpu = StreamPacer(messages_per_s=10, min_interval_s=0.1)  # the shortest gap (alone)
    cpu.open_streams = 1
    assert not cpu.due(waited=0.08, gap=0.03) and cpu.due(waited=0.1, gap=0.03)
    assert StreamPacer(messages_per_s=0).due(waited=0.0, gap=0.0)  # both 0: every token


def test_merged_tokens_go_out_before_a_failure():
    async def failing():
        for i in range(4):
            yield delta(i)
        raise RuntimeError("engine died")

    async def main() -> tuple[list[int], str]:
        got: list[int] = []
        try:
            async for d in StreamPacer(messages_per_s=1.0).pace(failing()):
                got += d.token_ids
        except RuntimeError as exc:
            return got, str(exc)
        return got, ""

    assert asyncio.run(main()) == ([0, 1, 2, 3], "engine died")
