"""One request can never take the engine (or another request) down with it."""

import asyncio

import pytest
from pydantic import ValidationError

from app.engine.async_engine import AsyncEngine
from app.engine.engine_process import EngineProcess
from app.protocol import FinishReason, InvalidRequestError, SamplingParams
from app.protocol.errors import ConflictError, ShoalError
from app.protocol.messages import EngineRequest
from app.protocol.sampling import MAX_LOGIT_BIAS, MAX_SEED
from tests.helpers import TINY_VOCAB, tiny_config, tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def drain(engine, limit: int = 500) -> list:  # noqa: ANN001
    deltas = []
    for _ in range(limit):
        if not engine.has_work:
            return deltas
        deltas += engine.step()
    raise AssertionError(f"the engine still has work after {limit} steps")


def unchecked_seed_params() -> SamplingParams:
    """What a client's {"n": 2, "seed": 2**64 - 1} became before seeds were bounded at the
    edge: the second output's seed (2**64) cannot seed a generator."""
    return SamplingParams.model_construct(
        **{**SamplingParams().model_dump(), "n": 2, "seed": 2**64 - 1, "max_tokens": 8}
    )


def test_a_sequence_that_fails_in_a_step_ends_its_request_alone(tiny_llama):
    engine = tiny_engine(tiny_llama)
    engine.add_request("good", [1, 2, 3, 4], GREEDY)
    engine.add_request("bad", [5, 6, 7], unchecked_seed_params())
    deltas = drain(engine)
    errors = [d for d in deltas if d.error is not None]
    assert [d.request_id for d in errors] == ["bad"]
    assert errors[0].finish_reason == FinishReason.ABORT and errors[0].error.status_code == 500
    good = [t for d in deltas if d.request_id == "good" for t in d.token_ids]
    assert good == tiny_engine(tiny_llama).generate([[1, 2, 3, 4]], GREEDY)[0].outputs[0].token_ids
    assert engine.block_manager.stats().used == 0 and not engine.requests
    # The engine goes on serving.
    assert len(engine.generate([[9, 9, 9]], GREEDY)[0].outputs[0].token_ids) == 8


def test_a_sampling_failure_in_one_row_ends_that_request_only(tiny_llama, monkeypatch):
    engine = tiny_engine(tiny_llama)
    sample = engine.sampler.__class__.__call__

    def failing(self, logits, seqs, forbidden=None):  # noqa: ANN001, ANN202
        if any(s.request_id == "victim" for s in seqs):
            raise RuntimeError("boom")
        return sample(self, logits, seqs, forbidden)

    monkeypatch.setattr(engine.sampler.__class__, "__call__", failing)
    engine.add_request("victim", [1, 2, 3], GREEDY)
    engine.add_request("bystander", [4, 5, 6], GREEDY)
    deltas = drain(engine)
    assert {d.request_id for d in deltas if d.error} == {"victim"}
    assert sum(len(d.token_ids) for d in deltas if d.request_id == "bystander") == 8


def test_a_failed_forward_ends_its_batch_and_the_engine_carries_on(tiny_llama, monkeypatch):
    engine = tiny_engine(tiny_llama)
    run = engine.runner.run
    calls = {"n": 0}

    def flaky(batch):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device error")
        return run(batch)

    monkeypatch.setattr(engine.runner, "run", flaky)
    engine.add_request("a", [1, 2, 3], GREEDY)
    deltas = drain(engine)
    assert deltas[-1].error is not None and deltas[-1].request_id == "a"
    assert engine.block_manager.stats().used == 0
    assert len(engine.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids) == 8


@pytest.mark.live  # an engine process
def test_the_error_reaches_only_its_stream_through_the_engine_process(tiny_llama):
    proc = EngineProcess(tiny_config(tiny_llama))

    async def collect(rid: str, params: SamplingParams) -> list:
        return [d async for d in proc.generate(EngineRequest(rid, [1, 2, 3], params))]

    async def main() -> None:
        good = asyncio.create_task(collect("good", GREEDY))
        with pytest.raises(ShoalError) as info:
            await collect("bad", unchecked_seed_params())
        assert info.value.status_code == 500 and "engine failed on this request" in str(info.value)
        assert sum(len(d.token_ids) for d in await good) == 8
        assert len(await collect("after", GREEDY)) == 8

    try:
        asyncio.run(main())
        proc.check_health()
    finally:
        proc.shutdown()


def test_seeds_are_bounded_where_params_are_made():
    SamplingParams(seed=0)
    SamplingParams(seed=MAX_SEED, n=128)  # seed + index still seeds a generator
    for bad in (-1, MAX_SEED + 1, 2**64 - 1):
        with pytest.raises(ValidationError):
            SamplingParams(seed=bad)


def test_logit_bias_is_bounded_and_checked_against_the_vocabulary(tiny_llama):
    with pytest.raises(ValidationError):
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})
    engine = tiny_engine(tiny_llama)
    for field, params in (
        ("logit_bias", SamplingParams(logit_bias={TINY_VOCAB: 5.0})),
        ("stop_token_ids", SamplingParams(stop_token_ids=(TINY_VOCAB + 7,))),
    ):
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(field, [1, 2], params)
        assert info.value.param == field and "vocabulary" in info.value.message


def test_n_outputs_never_push_the_batch_past_max_num_seqs(tiny_llama):
    engine = tiny_engine(tiny_llama, max_num_seqs=4)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("huge", [1, 2], SamplingParams(n=5))
    assert info.value.param == "n"
    params = SamplingParams(n=3, max_tokens=6, ignore_eos=True, temperature=1.0, seed=1)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [4, 5, 6], params)
    engine.add_request("c", [7], GREEDY)
    most = 0
    while engine.has_work:
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most <= 4


def test_duplicate_stream_ids_leave_the_first_stream_alone(tiny_llama):
    engine = AsyncEngine(tiny_engine(tiny_llama))

    async def main() -> None:
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        first = engine.generate(EngineRequest("same", [1, 2, 3], params))
        got = [await anext(first)]
        with pytest.raises(ConflictError):
            await anext(engine.generate(EngineRequest("same", [4, 5], GREEDY)))
        got += [d async for d in first]
        assert sum(len(d.token_ids) for d in got) == 30

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_nothing_schedulable_fails_health_without_spinning(tiny_llama, monkeypatch):
    engine = tiny_engine(tiny_llama)
    calls = {"n": 0}
    schedule = engine.scheduler.schedule

    def starved():  # noqa: ANN202 (as if every block were pinned)
        calls["n"] += 1
        batch = schedule()
        for seq in batch.seqs:  # give them back: nothing runs
            engine.block_manager.free(seq)
        return type(batch)()

    monkeypatch.setattr(engine.scheduler, "schedule", starved)
    runner = AsyncEngine(engine, idle_wait_s=0.05)
    try:
        engine.add_request("stuck", [1, 2, 3], GREEDY)
        runner._wakeup.set()
        asyncio.run(asyncio.sleep(1.0))
        assert engine.stalled_s > 0.5
        assert calls["n"] < 60  # about one try per idle wait, not thousands
        with pytest.raises(Exception, match="scheduled none"):
            runner.check_health(stalled_after_s=0.5)
        runner.check_health(stalled_after_s=30)
    finally:
        runner.shutdown()


def test_a_wide_request_waiting_for_seats_lets_narrow_ones_pass_for_a_while(tiny_llama):
    engine = tiny_engine(tiny_llama, max_num_seqs=4)
    engine.add_request("long", [1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True))
    engine.step()
    wide = SamplingParams(n=4, max_tokens=4, ignore_eos=True, temperature=1.0, seed=3)
    engine.add_request("wide", [4, 5, 6], wide)
    engine.add_request("short", [7, 8], SamplingParams(max_tokens=2, ignore_eos=True))
    first: dict[str, int] = {}
    for step in range(200):
        if not engine.has_work:
            break
        for d in engine.step():
            first.setdefault(d.request_id, step)
    assert first["short"] <= 2, first  # it did not wait for the long request to end
    assert "wide" in first and not engine.has_work


def test_narrow_requests_cannot_keep_a_wide_one_out_for_ever(tiny_llama):
    engine = tiny_engine(tiny_llama, max_num_seqs=4)
    engine.add_request("wide", [4, 5, 6], SamplingParams(n=4, max_tokens=2, ignore_eos=True))
    engine.add_request("long", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True))
    started = None
    for step in range(400):
        # A new short request every step would always find a free seat.
        engine.add_request(f"s{step}", [7, 8], SamplingParams(max_tokens=8, ignore_eos=True))
        if any(d.request_id == "wide" for d in engine.step()):
            started = step
            break
    assert started is not None, "the wide request never ran"
