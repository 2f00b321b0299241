"""Scheduler behaviour, driven through a real engine on a tiny random Llama."""

import pytest

from app.protocol import (
    ContextLengthExceededError,
    FinishReason,
    InvalidRequestError,
    SamplingParams,
)
from app.protocol.errors import ConflictError
from tests.helpers import tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompt(n: int, start: int = 1) -> list[int]:
    return [(start + i) % 250 + 1 for i in range(n)]


def test_request_joins_running_batch_at_next_step(tiny_llama):
    eng = tiny_engine(tiny_llama)
    eng.add_request("a", prompt(10), GREEDY)
    eng.step()  # a: prefill
    eng.step()  # a: decode
    eng.add_request("b", prompt(6, 50), GREEDY)
    deltas = eng.step()
    assert {d.request_id for d in deltas} == {"a", "b"}
    assert eng.stats.batch_num_seqs == 2
    assert eng.stats.batch_num_tokens == 1 + 6  # a's decode token + b's whole prompt


def test_finished_sequences_leave_at_once(tiny_llama):
    eng = tiny_engine(tiny_llama)
    eng.add_request(
        "short", prompt(5), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    )
    eng.add_request(
        "long", prompt(5, 9), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    eng.step()
    deltas = eng.step()
    assert [d.finish_reason for d in deltas if d.request_id == "short"] == [FinishReason.LENGTH]
    eng.step()
    assert eng.stats.batch_num_seqs == 1 and eng.stats.num_running == 1


def test_chunked_prefill_respects_token_budget(tiny_llama):
    eng = tiny_engine(tiny_llama, max_num_batched_tokens=8)
    eng.add_request("a", prompt(30), GREEDY)
    steps = 0
    while not eng.step():
        steps += 1
        assert eng.stats.batch_num_tokens <= 8
    assert steps == 3  # 8 + 8 + 8 computed without sampling, the last 6 sample
    ref = tiny_engine(tiny_llama).generate([prompt(30)], GREEDY)[0].outputs[0].token_ids
    chunked = tiny_engine(tiny_llama, max_num_batched_tokens=8).generate([prompt(30)], GREEDY)
    assert chunked[0].outputs[0].token_ids == ref


def test_max_num_seqs_caps_the_batch(tiny_llama):
    eng = tiny_engine(tiny_llama, max_num_seqs=2)
    for i in range(4):
        eng.add_request(str(i), prompt(4, i * 10), GREEDY)
    eng.step()
    assert eng.stats.batch_num_seqs == 2 and eng.stats.num_waiting == 2


def test_preemption_recomputes_with_identical_output(tiny_llama):
    prompts = [prompt(9 + 3 * i, 17 * i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = tiny_engine(tiny_llama, num_kv_blocks=256).generate(prompts, params)
    small = tiny_engine(tiny_llama, num_kv_blocks=24)
    out = small.generate(prompts, params)
    assert small.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert small.block_manager.stats().used == 0


def test_abort_frees_blocks_at_once(tiny_llama):
    eng = tiny_engine(tiny_llama)
    eng.add_request("a", prompt(20), GREEDY)
    eng.add_request("b", prompt(7, 40), GREEDY)
    eng.step()
    assert eng.block_manager.stats().used > 0
    assert eng.abort("a")
    used_b = len(eng.requests.family("b")[0].block_table)
    assert eng.block_manager.stats().used == used_b
    assert eng.abort("b")
    assert eng.block_manager.stats().used == 0
    deltas = eng.step()
    assert sorted((d.request_id, d.finish_reason) for d in deltas) == [
        ("a", FinishReason.ABORT),
        ("b", FinishReason.ABORT),
    ]
    assert not eng.abort("a")  # already gone


def test_abort_of_a_waiting_request(tiny_llama):
    eng = tiny_engine(tiny_llama, max_num_seqs=1)
    eng.add_request("a", prompt(5), GREEDY)
    eng.add_request("b", prompt(5, 30), GREEDY)
    eng.step()
    assert eng.abort("b")
    assert eng.stats.num_waiting == 0


def test_admission_rejects_what_can_never_fit(tiny_llama):
    eng = tiny_engine(tiny_llama, max_model_len=64)
    with pytest.raises(ContextLengthExceededError) as err:
        eng.add_request("a", prompt(50), SamplingParams(max_tokens=20))
    assert "64" in str(err.value) and "70" in str(err.value)
    assert err.value.num_prompt_tokens == 50 and err.value.max_model_len == 64
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request("b", [], GREEDY)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        eng.add_request("c", [1, 2, 10_000], GREEDY)
    small_cache = tiny_engine(tiny_llama, num_kv_blocks=4)  # 16 tokens of KV in all
    with pytest.raises(InvalidRequestError, match="blocks"):
        small_cache.add_request("d", prompt(10), SamplingParams(max_tokens=10))
    assert not eng.has_work


def test_duplicate_request_id_is_rejected(tiny_llama):
    eng = tiny_engine(tiny_llama)
    eng.add_request("a", prompt(5), GREEDY)
    with pytest.raises(ConflictError, match="already"):  # 409: the first one runs on
        eng.add_request("a", prompt(5), GREEDY)


def test_prefix_cache_hits_across_requests(tiny_llama):
    eng = tiny_engine(tiny_llama)
    shared = prompt(16, 3)
    first = eng.generate([shared + [7, 8]], GREEDY)
    hits_before = eng.stats.prefix_cache_hit_tokens
    second = eng.generate([shared + [7, 8]], GREEDY)
    assert eng.stats.prefix_cache_hit_tokens - hits_before == 16
    assert second[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def test_slots_are_running_then_waiting_then_idle_seats(tiny_llama):
    eng = tiny_engine(tiny_llama, max_num_seqs=2)
    assert [(s.index, s.state, s.request_id) for s in eng.slots()] == [
        (0, "idle", None),
        (1, "idle", None),
    ]
    for rid in ("a", "b", "c"):
        eng.add_request(rid, prompt(6), GREEDY)
    eng.step()
    slots = eng.slots()
    assert [(s.index, s.state, s.request_id) for s in slots] == [
        (0, "running", "a"),
        (1, "running", "b"),
        (2, "waiting", "c"),  # more seats while more are busy
    ]
    assert slots[0].num_prompt_tokens == 6 and slots[0].num_output_tokens == 1
    assert slots[0].params == GREEDY and slots[0].max_model_len == eng.max_model_len
