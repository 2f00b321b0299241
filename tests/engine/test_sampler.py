"""Sampling behaviour on a tiny random Llama (float32)."""

import math

import pytest

from app.protocol import FinishReason, SamplingParams
from tests.helpers import TINY_EOS, tiny_engine

PROMPTS = [[5, 6, 7, 8], [100, 3, 44], [9] * 11, [200, 201]]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return tiny_engine(tiny_llama, num_kv_blocks=256)


def tokens(engine, prompts, params):
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


def test_greedy_equals_top_k_one(engine):
    greedy = tokens(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    top1 = tokens(
        engine, PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True)
    )
    tiny_p = tokens(
        engine, PROMPTS, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=10, ignore_eos=True)
    )
    assert greedy == top1 == tiny_p


def test_seed_reproducible_across_batch_compositions(engine):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = tokens(engine, [PROMPTS[0]], params)[0]
    others = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    mixed = engine.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, params, others])
    assert mixed[1].outputs[0].token_ids == alone
    assert tokens(engine, [PROMPTS[0]], params)[0] == alone
    other_seed = tokens(engine, [PROMPTS[0]], params.model_copy(update={"seed": 99}))[0]
    assert other_seed != alone


def test_unseeded_sampling_varies(engine):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    outs = {tuple(t) for t in tokens(engine, [PROMPTS[0]] * 4, params)}
    assert len(outs) > 1


def test_logit_bias_forces_a_token(engine):
    out = tokens(
        engine, PROMPTS, SamplingParams(temperature=0, max_tokens=5, logit_bias={42: 100.0})
    )
    assert all(t == [42] * 5 for t in out)
    banned = tokens(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    first = banned[0][0]
    out = tokens(
        engine,
        [PROMPTS[0]],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={first: -100.0}),
    )
    assert out[0][0] != first


def test_stop_token_ids_min_tokens_and_eos(engine):
    out = engine.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, logit_bias={TINY_EOS: 100.0})
    )
    assert out[0].outputs[0].token_ids == [TINY_EOS]
    assert out[0].outputs[0].finish_reason == FinishReason.STOP
    held = engine.generate(
        [PROMPTS[0]],
        SamplingParams(temperature=0, max_tokens=5, min_tokens=3, logit_bias={TINY_EOS: 100.0}),
    )[0].outputs[0]
    assert (
        len(held.token_ids) == 4
        and TINY_EOS not in held.token_ids[:3]
        and held.token_ids[3] == TINY_EOS
    )
    ignored = engine.generate(
        [PROMPTS[0]],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={TINY_EOS: 100.0}),
    )[0].outputs[0]
    assert ignored.token_ids == [TINY_EOS] * 5 and ignored.finish_reason == FinishReason.LENGTH
    free = tokens(
        engine, [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )[0]
    stop_at = free[2]
    stopped = engine.generate(
        [PROMPTS[1]],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=(stop_at,)),
    )[0].outputs[0]
    assert stopped.token_ids == free[: free.index(stop_at) + 1]
    assert stopped.finish_reason == FinishReason.STOP


def test_penalties_discourage_repeats(engine):
    loop_prompt = [[9] * 11]
    base = tokens(
        engine, loop_prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )[0]
    rep = tokens(
        engine,
        loop_prompt,
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=5.0),
    )[0]
    freq = tokens(
        engine,
        loop_prompt,
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0),
    )[0]
    pres = tokens(
        engine,
        loop_prompt,
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=2.0),
    )[0]
    assert len(set(rep)) > len(set(base))
    assert 9 not in rep[:5]  # the prompt's token is penalised too
    assert len(set(freq)) >= len(set(base)) and len(set(pres)) >= len(set(base))
    assert freq != base or pres != base


def test_logprobs_with_alternatives(engine):
    out = engine.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    )
    lps = out[0].outputs[0].logprobs
    assert len(lps) == 4
    for token_id, lp in zip(out[0].outputs[0].token_ids, lps, strict=True):
        assert lp.token_id == token_id
        assert len(lp.top) == 3
        assert lp.top[0][0] == token_id  # greedy picks the best
        assert math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-6)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob <= 0
    none = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2, logprobs=0))
    assert none[0].outputs[0].logprobs[0].top == ()


def test_n_outputs_share_the_prompt_blocks(tiny_llama):
    eng = tiny_engine(tiny_llama, num_kv_blocks=64)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    eng.add_request("r", list(range(1, 18)), params)  # 17 tokens: 4 full blocks + 1 partial
    eng.step()  # prefill, then fork
    seqs = eng.requests.family("r")
    assert len(seqs) == 3
    assert seqs[0].block_table[:4] == seqs[1].block_table[:4] == seqs[2].block_table[:4]
    assert eng.block_manager.stats().used == 5  # shared until each writes its own token
    while eng.has_work:
        eng.step()
    out = eng.generate([list(range(1, 18))], params)[0].outputs
    assert [o.index for o in out] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out}) > 1
    assert all(len(o.token_ids) == 6 for o in out)
    assert eng.block_manager.stats().used == 0
    greedy = eng.generate(
        [[3, 4, 5]], SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True)
    )
    assert greedy[0].outputs[0].token_ids == greedy[0].outputs[1].token_ids
